"""Compile the framework's Triton kernels for NVIDIA GPUs without one, and report their resources.

    python tests/triton_compile_check.py [--arch 80 90]

For every configuration the framework launches on a GPU (the dtypes and padded widths the streamed
attention kernel sends to Triton, meanfield.accelerator_paths.TRITON_MAX_WIDTH, and for sm_90 the forward
pass and JVP at TRITON_WIDE_MAX_WIDTH, at the tile sizes of
meanfield.triton_attention._blocks; the Sinkhorn soft-min at d = 3 and d = 64, its truncated variant at d = 3
and 6; the small heads' kernels of meanfield.triton_small_heads at d = 3), each kernel in its
heaviest variant (log-weights and positions, every tangent, every gradient) is compiled to a cubin for
the given architectures with Triton's own compiler and ptxas (both ship in the triton wheel), and ptxas
reports registers and spills; nvdisasm's listing gives the instructions of the main loop per score entry and
thread (``loop_per_entry``, and the commonest opcodes: what the loop costs, not how fast it runs). Prints one JSON
line per kernel. Must run with TRITON_INTERPRET unset (tests/test_triton_compile.py runs it in a subprocess).
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
from meanfield import triton_small_heads as sh  # noqa: E402
from transport import triton_softmin as ts  # noqa: E402

try:
    from triton.backends.nvidia.compiler import get_ptxas
except ImportError:  # another Triton layout: the plain ptxas of the wheel
    get_ptxas = None
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
NAMES = {torch.float32: "fp32", torch.float64: "fp64", torch.float16: "fp16", torch.bfloat16: "bf16"}
#: largest shared memory per block (bytes) by architecture
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"


def loop_mix(sass: str) -> dict:
    """The instructions of a kernel's main loop (the longest backward branch's body) by opcode."""
    lines = sass.splitlines()
    ins = [(i, m.group(1)) for i, line in enumerate(lines) if (m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line))]
    labels = {line.strip()[:-1]: i for i, line in enumerate(lines) if re.match(r"\s*\.L_x_\d+:", line)}
    best = []
    for i, text in ins:
        target = re.search(r"BRA\s.*?(\.L_x_\d+)", text)
        if target and labels.get(target.group(1), i) < i:
            body = [t for j, t in ins if labels[target.group(1)] < j <= i]
            best = max(best, body, key=len)
    counts: dict = {}
    for text in best:
        op = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text)
        if op:
            counts[op.group(1)] = counts.get(op.group(1), 0) + 1
    return counts


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
        sass = subprocess.run([str(NVDISASM), "-c", str(ptx.with_suffix(".o"))], capture_output=True,
                              text=True).stdout if out.returncode == 0 and NVDISASM.exists() else ""
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    mix = loop_mix(sass) if sass else {}
    # the loop's instructions per score entry and thread: a (BLOCK_M, BLOCK_N) tile is spread over 32 * warps threads
    entries = constexprs.get("BLOCK_M", 0) * constexprs.get("BLOCK_N", 0) / (32 * warps)
    per_entry = round(sum(mix.values()) / entries, 1) if mix and entries else None
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spills.group(1)) if spills else None,
            "shared": kernel.metadata.shared, "shared_limit": SHARED_LIMIT.get(arch), "ptxas_ok": out.returncode == 0,
            "loop_per_entry": per_entry,
            "loop_top": {k: round(v / entries, 1) for k, v in sorted(mix.items(), key=lambda kv: -kv[1])[:6]}
            if per_entry else {}}


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
        # the small heads' FMA kernels, at their largest default head (d = 3) and at the tiles they launch
        F = ap.SMALL_HEAD_FEATURES
        for dtype in ap.SMALL_HEAD_DTYPES:
            if dtype == torch.bfloat16 and arch < 80:
                continue
            for mask in (dict(HAS_POS=True, CAUSAL=False), dict(HAS_POS=False, CAUSAL=True)):
                for name, fn in sh.KERNELS.items():
                    bm, bn, warps = sh.blocks(dtype, name)
                    c = dict(HAS_LW=True, **mask, E=F, C=F, BLOCK_M=bm, BLOCK_N=bn, PREC="ieee", ACC=tl.float32,
                             **extra[name])
                    res = compile_one(fn, dtype, c, arch, warps)
                    print(json.dumps({"kernel": "small_" + name, "arch": arch, "dtype": NAMES[dtype], "width": F,
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
