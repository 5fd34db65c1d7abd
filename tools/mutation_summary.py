"""Summary of a mutation run (docs/mutation.md): one row per mutated module, then the survivors.

Reads what ``mutmut run`` left in ``mutants/`` (one ``.meta`` file per mutated module) and prints a
Markdown table: mutants, killed, timeouts, survived, no tests, not yet run, the score and the
seconds spent. Score = (killed + timeouts) / (mutants run); a mutant no test reaches counts as a
survivor. mutmut 3.8's forkserver runner (``process_isolation = "forkserver"``) records 0 s for
every mutant, so the seconds column reads "-" when no duration was recorded: time the run itself.
Run from the repository root after (or during) a run:

    python tools/mutation_summary.py            # every module
    python tools/mutation_summary.py 'studies.common.*' --survivors
"""

from __future__ import annotations

import argparse
import fnmatch
import json
from pathlib import Path

#: mutmut's exit codes (mutmut.stats.status_by_exit_code), grouped as the table counts them
KILLED = {1, 3}
TIMEOUT = {36, 24, -24, 152, 255}
SURVIVED = {0}
NO_TESTS = {5, 33}


def load(root: Path) -> dict[str, dict]:
    """{module path: its meta data} for every mutated module under root/mutants."""
    return {str(p.relative_to(root / "mutants"))[: -len(".meta")]: json.loads(p.read_text())
            for p in sorted((root / "mutants").rglob("*.py.meta"))}


def summarize(metas: dict[str, dict], pattern: str) -> tuple[list[dict], list[str]]:
    rows, survivors = [], []
    for path, meta in metas.items():
        codes = {k: v for k, v in meta["exit_code_by_key"].items() if fnmatch.fnmatch(k, pattern)}
        if not codes:
            continue
        seconds = sum(meta.get("durations_by_key", {}).get(k, 0.0) for k in codes)
        count = lambda group, codes=codes: sum(v in group for v in codes.values())
        row = dict(module=path, mutants=len(codes), killed=count(KILLED), timeout=count(TIMEOUT),
                   survived=count(SURVIVED), no_tests=count(NO_TESTS),
                   not_run=sum(v is None for v in codes.values()), seconds=seconds)
        row["other"] = row["mutants"] - sum(row[k] for k in ("killed", "timeout", "survived", "no_tests", "not_run"))
        rows.append(row)
        survivors += [k for k, v in codes.items() if v in SURVIVED or v in NO_TESTS]
    return rows, survivors


def table(rows: list[dict]) -> str:
    head = "| module | mutants | killed | timeout | survived | no tests | other | not run | score | s / mutant |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    total = {k: sum(r[k] for r in rows) for k in ("mutants", "killed", "timeout", "survived", "no_tests", "other",
                                                   "not_run", "seconds")}
    for r in [*rows, dict(module="**total**", **total)]:
        run = r["mutants"] - r["not_run"]
        score = f"{(r['killed'] + r['timeout']) / run:.1%}" if run else "-"
        per = f"{r['seconds'] / run:.1f}" if run and r["seconds"] > 0 else "-"
        lines.append(f"| {r['module']} | {r['mutants']} | {r['killed']} | {r['timeout']} | {r['survived']} | "
                     f"{r['no_tests']} | {r['other']} | {r['not_run']} | {score} | {per} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pattern", nargs="?", default="*", help="mutant names to count (a glob, as mutmut run takes)")
    parser.add_argument("--survivors", action="store_true", help="list the surviving mutants (see: mutmut show NAME)")
    args = parser.parse_args(argv)
    metas = load(Path.cwd())
    if not metas:
        parser.error("no mutants/ folder here: run `mutmut run` from the repository root first")
    rows, survivors = summarize(metas, args.pattern)
    print(table(rows))
    if args.survivors:
        print("\nsurvivors:\n" + "\n".join(f"  {s}" for s in survivors))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
