"""Peak memory and time of each study of the reproduction report, one fresh process per study.

    python benchmarks/bench_memory.py [--level quick|full] [--only NAME ...] [--threads T] [--whole]
                                      [--model NAME ...] [--cache DIR]

Each study runs alone in a new Python process (``studies.report.run_study`` with the run context
of ``meanfield reproduce``), which then reports its claims' verdicts (stored with ``--write``: the
report's next steps at the quick level say what the full grid found), its peak resident memory (``VmHWM`` of
``/proc/self/status``; with the largest ``ru_maxrss`` of any child process, in case a study's sweep
spawns workers), its wall time and its CPU time. ``--whole`` also runs the whole report
(``meanfield reproduce`` at that level) in one process and reports the same for it. Prints a
markdown table; the machine's load average before and after is printed with it, since both times
depend on it. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, resource, sys, time
sys.path.insert(0, {root!r})
import torch
if {threads}:
    torch.set_num_threads({threads})
from studies.context import RunContext
from studies.report import reproduce, run_study
ctx = RunContext({out!r}, level={level!r}, seed=0, progress=False, cache={cache!r}, models={models!r})
t0, c0 = time.perf_counter(), time.process_time()
verdicts = None
if {name!r} == "(whole job)":
    summary = reproduce(ctx)
    status = "ok" if not summary["failed"] else "failed: " + ", ".join(summary["failed"])
else:
    entry = run_study({name!r}, ctx)
    status = entry["status"] if entry["status"] == "ok" else "failed: " + entry["error"][:80]
    verdicts = [c["verdict"] for c in entry.get("claims", [])]
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
children = resource.getrusage(resource.RUSAGE_CHILDREN)
print("RESULT " + json.dumps({{"hwm_kib": hwm, "children_maxrss_kib": children.ru_maxrss, "wall": wall,
                               "cpu": cpu + children.ru_utime + children.ru_stime, "status": status,
                               "threads": torch.get_num_threads(), "verdicts": verdicts}}))
"""


def measure(name: str, level: str, threads: int, cache: str | None, models=()) -> dict:
    with tempfile.TemporaryDirectory() as out:
        code = _CHILD.format(root=str(ROOT), out=out, level=level, name=name, threads=threads, cache=cache,
                             models=tuple(models))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"name": name, "status": f"process failed ({proc.returncode}): {proc.stderr.strip()[-200:]}"}
    return {"name": name, **json.loads(lines[-1][len("RESULT "):])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--level", choices=("quick", "full"), default="quick")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME")
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    p.add_argument("--whole", action="store_true", help="also run the whole report in one process")
    p.add_argument("--cache", default=None, help="cache folder of the pretrained weights (default: the usual)")
    p.add_argument("--model", action="append", default=[], dest="models",
                   help="the real-model study's models (default: as meanfield reproduce)")
    p.add_argument("--write", action="store_true",
                   help="store the figures in studies/data/costs.json, the one source of the README's table and "
                        "of `meanfield --help` (then paste studies.costs.markdown_table() into the README)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from studies.contract import registry

    names = args.only or list(registry())
    if args.whole:
        names.append("(whole job)")
    load0 = os.getloadavg()
    rows = []
    for name in names:
        r = measure(name, args.level, args.threads, args.cache, args.models)
        rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    models = f"; real_models models {args.models}" if args.models else ""
    print(f"level {args.level}{models}; {os.cpu_count()} CPUs; torch threads {rows[0].get('threads', '?')}; "
          f"load average before {load0[0]:.1f}, after {load1[0]:.1f} (1 min); {time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| study | peak RSS (VmHWM) | wall | CPU time | status |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "hwm_kib" not in r:
            print(f"| {r['name']} | | | | {r['status']} |")
            continue
        peak = max(r["hwm_kib"], r["children_maxrss_kib"]) / 2**20
        print(f"| {r['name']} | {peak:.2f} GiB | {r['wall']:.0f} s | {r['cpu']:.0f} s | {r['status']} |")
    if args.write:
        from studies import costs

        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                   "unknown CPU")
        command = "python benchmarks/bench_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
        costs.record(args.level, rows, command=command.strip(), date=time.strftime("%Y-%m-%d"),
                     load_average=f"{load0[0]:.1f}",
                     machine=f"{os.cpu_count()} x {cpu}, {mem:.0f} GiB, torch threads {rows[0].get('threads', '?')}")
        print(f"\nwritten to {costs.PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
