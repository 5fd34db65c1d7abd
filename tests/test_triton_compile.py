"""The Triton kernels compile for NVIDIA GPUs (sm_80: A100, sm_90: H100) without one, at the tile sizes
the framework launches, with no register spills and within the architecture's shared memory
(tests/triton_compile_check.py, in a subprocess: Triton must not be in interpreter mode there).

What this cannot check: speed, and that the compiled code computes what the interpreter does (the
interpreter tests of tests/meanfield/test_kernels_triton.py check the latter for the same source).
Skipped without Triton or without its NVIDIA backend (ptxas ships in the wheel).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_launched_kernel_compiles_without_spills():
    triton = pytest.importorskip("triton", reason="Triton is not installed (the 'gpu' extra)")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("Triton's NVIDIA backend (ptxas) is not in this installation")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_compile_check.py")], capture_output=True,
                         text=True, env=env, timeout=3600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    kinds = {(r["kernel"], r["arch"]) for r in rows}
    small = ("small_forward", "small_jvp", "small_backward_q", "small_backward_kv")
    for kernel in ("forward", "jvp", "backward_q", "backward_kv", "sinkhorn_lse", "sinkhorn_lse_blocks") + small:
        for arch in (80, 90):
            assert (kernel, arch) in kinds
    assert ("jvp", 90, 64) in {(r["kernel"], r["arch"], r["width"]) for r in rows}  # the wide float32 heads
    for r in rows:
        assert r["ptxas_ok"], r
        # one measured exception: the float32 JVP at width 64 on sm_90 (three-pass TF32) spills 8 bytes; it is
        # the configuration timed on an H200 at 1.4-1.6x SDPA's backward (benchmarks/gpu.md, "wide")
        wide_jvp = (r["kernel"], r["arch"], r["dtype"], r["width"]) == ("jvp", 90, "fp32", 64)
        # and the small heads' causal dq pass: 8 bytes, at the tiles that keep every other small kernel unspilled
        small_dq = (r["kernel"], r.get("mask")) == ("small_backward_q", "causal")
        assert r["spill_bytes"] <= (8 if wide_jvp or small_dq else 0), r
        assert r["registers"] is not None and r["registers"] <= 255, r
        assert r["shared"] <= r["shared_limit"], r
    # the small heads' FMA loops against the matrix-product kernel's at d = 3 (padded to 8 columns with Triton 3.9,
    # to 16 with 3.6), float32, sm_90: the instructions each score entry costs a thread
    loop = {(r["kernel"], r["arch"], r["dtype"], r["width"], r.get("mask")): r["loop_per_entry"] for r in rows}
    for mask in ("positions", "causal"):
        ours = loop[("small_forward", 90, "fp32", 3, mask)]
        general = [v for (k, a, t, w, m), v in loop.items() if (k, a, t, m) == ("forward", 90, "fp32", mask)]
        assert ours is not None and general and ours < 0.7 * min(general), (ours, general)
