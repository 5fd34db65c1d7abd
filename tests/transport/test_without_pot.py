"""The GPU machines' image has no POT: the package, its studies' modules and the GPU benchmark import without it,
the streamed solver runs, and exact W2 says what it needs (POT was imported at the top of transport.exact and
transport.sinkhorn, so `import transport` failed there, and with it every GPU benchmark)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import importlib.abc, runpy, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "ot" or name.startswith("ot."):
            raise ImportError("no module named " + name)
sys.meta_path.insert(0, Block())
import torch
import meanfield, studies, transport
from particles import Measure
sys.argv = ["bench_gpu.py", "--help"]
try:
    runpy.run_path("benchmarks/bench_gpu.py", run_name="__main__")
except SystemExit:
    pass
g = torch.Generator().manual_seed(0)
mu = Measure(torch.randn(40, 3, generator=g, dtype=torch.float64))
nu = Measure(torch.randn(50, 3, generator=g, dtype=torch.float64))
print("streaming", transport.w2(mu, nu, method="streaming", reg=0.05))
try:
    transport.w2(mu, nu)
except ImportError as exc:
    print("exact:", exc)
print("ot" in sys.modules)
'''


def test_the_package_and_the_gpu_benchmark_import_without_pot():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "False"   # nothing imported POT
    assert lines[-2].startswith("exact: w2: exact W2 and the dense Sinkhorn need POT (pip install pot)")
    assert float(lines[-3].split()[1]) > 0
    assert "usage" in out.stdout   # bench_gpu's --help ran
