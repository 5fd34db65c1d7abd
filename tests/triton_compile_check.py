"""Compile the framework's Triton kernels for NVIDIA GPUs without one, and report their resources.

    python tests/triton_compile_check.py [--arch 80 90]

For every configuration the framework launches on a GPU (the dtypes and padded widths the streamed
attention kernel sends to Triton, meanfield.accelerator_paths.TRITON_MAX_WIDTH, and for sm_90 the forward
pass and JVP at TRITON_WIDE_MAX_WIDTH, at the tile sizes of
meanfield.triton_attention._blocks; the Sinkhorn soft-min at d = 3 and d = 64, its truncated variant at d = 3
and 6), each kernel in its
heaviest variant (log-weights and positions, every tangent, every gradient) is compiled to a cubin for
the given architectures with Triton's own compiler and ptxas (both ship in the triton wheel), and ptxas
reports registers and spills. Prints one JSON line per kernel. Must run with TRITON_INTERPRET unset
(tests/test_triton_compile.py runs it in a subprocess).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from meanfield import accelerator_paths as ap  # noqa: E402
from meanfield import triton_attention as ta  # noqa: E402
from transport import triton_softmin as ts  # noqa: E402

try:
    from triton.backends.nvidia.compiler import get_ptxas
except ImportError:  # another Triton layout: the plain ptxas of the wheel
    get_ptxas = None
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
NAMES = {torch.float32: "fp32", torch.float64: "fp64", torch.float16: "fp16", torch.bfloat16: "bf16"}
#: largest shared memory per block (bytes) by architecture
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


def compile_one(fn, dtype, constexprs, arch, warps, types=None):
    sig = {n: ("constexpr" if n in constexprs else ("*" + NAMES[dtype] if n[0].isupper() else "i32"))
           for n in fn.arg_names}
    sig.update(types or {})
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                            target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    target = re.search(r"^\.target\s+(\w+)", kernel.asm["ptx"], re.M).group(1)  # sm_90a on Hopper
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        ptxas = get_ptxas(arch).path if get_ptxas is not None else str(PTXAS)  # Triton's own choice per arch
        out = subprocess.run([ptxas, "-v", f"-arch={target}", str(ptx), "-o", str(ptx.with_suffix(".o"))],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spills.group(1)) if spills else None,
            "shared": kernel.metadata.shared, "shared_limit": SHARED_LIMIT.get(arch), "ptxas_ok": out.returncode == 0}


def attention_cases(arch):
    """(dtype, width, kernels launched there): every kernel at the widths of TRITON_MAX_WIDTH; from
    TRITON_WIDE_CAPABILITY on, the forward pass and the JVP at the wide float32 widths too."""
    every = ("forward", "jvp", "backward_q", "backward_kv")
    for dtype, widest in ap.TRITON_MAX_WIDTH.items():
        smallest = ap.triton_width(1, dtype)
        for width in sorted({smallest, widest}):
            yield dtype, width, every
    if (arch // 10, arch % 10) >= ap.TRITON_WIDE_CAPABILITY:
        for dtype, widest in ap.TRITON_WIDE_MAX_WIDTH.items():
            for width in (2 * ap.TRITON_MAX_WIDTH[dtype], widest):
                yield dtype, width, ("forward", "jvp")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    a = p.parse_args(argv)
    if ta._INTERPRETED:
        sys.exit("TRITON_INTERPRET is set: unset it to compile")
    extra = {"forward": {}, "jvp": dict(HAS_TQ=True, HAS_TK=True, HAS_TV=True, HAS_TLW=True), "backward_q": {},
             "backward_kv": dict(NEED_DK=True, NEED_DV=True, NEED_DLW=True)}
    kernels = {"forward": ta._forward_kernel, "jvp": ta._jvp_kernel, "backward_q": ta._backward_q_kernel,
               "backward_kv": ta._backward_kv_kernel}
    for arch in a.arch:
        for dtype, width, launched in attention_cases(arch):
            for mask in (dict(HAS_POS=True, CAUSAL=False), dict(HAS_POS=False, CAUSAL=True)):
                for name, fn in ((n, kernels[n]) for n in launched):
                    bm, bn, warps = ta._blocks(dtype, width, name)
                    c = dict(HAS_LW=True, **mask, E=width, C=width, BLOCK_M=bm, BLOCK_N=bn,
                             PREC=ta._precision(dtype, width), ACC=tl.float64 if dtype == torch.float64 else tl.float32,
                             **extra[name])
                    res = compile_one(fn, dtype, c, arch, warps)
                    print(json.dumps({"kernel": name, "arch": arch, "dtype": NAMES[dtype], "width": width,
                                      "mask": "positions" if mask["HAS_POS"] else "causal", "block": [bm, bn],
                                      "warps": warps, **res}), flush=True)
        for dtype in (torch.float32, torch.float64):
            for K in (5, 14, 66):  # d = 3, 12 and 64
                KP = ts._width(K, dtype)
                bm, bn, warps = ts._blocks(dtype, KP)
                c = dict(K=K, KP=KP, BLOCK_M=bm, BLOCK_N=bn, ACC=tl.float64 if dtype == torch.float64 else tl.float32)
                res = compile_one(ts._lse_kernel, dtype, c, arch, warps)
                print(json.dumps({"kernel": "sinkhorn_lse", "arch": arch, "dtype": NAMES[dtype], "width": KP,
                                  "block": [bm, bn], "warps": warps, **res}), flush=True)
            for K in (5, 8):  # the truncated soft-min, d = 3 and d = 6 (transport.truncation.MAX_DIM)
                KP = ts._width(K, dtype)
                bm, bn, warps = ts._blocks(dtype, KP)
                c = dict(TILE=256, K=K, KP=KP, BLOCK_M=bm, BLOCK_N=bn,
                         ACC=tl.float64 if dtype == torch.float64 else tl.float32)
                res = compile_one(ts._lse_blocks_kernel, dtype, c, arch, warps, types={"PTR": "*i32", "TILES": "*i32"})
                print(json.dumps({"kernel": "sinkhorn_lse_blocks", "arch": arch, "dtype": NAMES[dtype], "width": KP,
                                  "block": [bm, bn], "warps": warps, **res}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    main()
