"""torch's memory-efficient attention kernel on CUDA, called directly (the CUTLASS kernel behind
``scaled_dot_product_attention`` for float32 and the half types): the forward pass with the row
log-sum-exp L, and the VJP, of the streamed kernel (:mod:`meanfield.streamed_attention`) wherever its
mask allows (none, or the causal mask of a sequence). It is to CUDA what :mod:`meanfield.flash_cpu` is to
the CPU: the VJP of a graph recorded through ``attend`` is then the very kernel behind SDPA's backward,
reading the out and L of our forward pass, in O(N) memory.

The layout is :func:`meanfield.flash_cpu.layout` with the head as the third axis (B, rows, 1, width), the
width zero-padded to a multiple of :data:`meanfield.accelerator_paths.FUSED_ALIGN`. Log-weights ride as the
extra coordinate q' = [q, 1], k' = [k, log a] (log 0 as a finite number far below every score,
:func:`meanfield.flash_cpu.weight_coordinates`; their gradient is then the extra column of dk') with the
causal mask, when their gradient is needed, or where the coordinate costs no width (d = 3: 4 -> 8; never in
float16, whose coordinates take two columns); otherwise as an additive bias row broadcast over the queries
(stride 0: O(N) memory; log 0 stays -inf), since one more column would send a head of 64 to the kernel built
for 128 (1.7x slower on an H200). The kernel's L has
its rows padded to a multiple of 32 (:data:`LSE_ALIGN`); the backward receives L in that layout again.

``FORWARD`` / ``BACKWARD`` are None on a torch without these operators. Where the kernel's operator refuses a
call (a GPU or an input layout it was not built for: :class:`Refused`), the first refusal warns
(RuntimeWarning) and the streamed kernel's own engines (Triton or tile loops) compute that kind of call from
then on, as :func:`particles.device.run_triton` does for the Triton kernels. Errors of the computation itself
(out of memory, a CUDA error) and of this module's own code propagate.
"""

from __future__ import annotations

import math

import torch

from .flash_cpu import aten_op, clear_empty_rows, layout

__all__ = ["FORWARD", "BACKWARD", "LSE_ALIGN", "DTYPES", "MAX_BATCH", "BIAS_ALIGN", "Refused", "runs", "takes",
           "forward", "backward", "guarded"]


#: the forward operator (out, L padded, seed, offset, max rows, max keys), or None
FORWARD = aten_op("_efficient_attention_forward")
#: its backward (dq, dk, dv, d bias), or None
BACKWARD = aten_op("_efficient_attention_backward")
#: the kernel stores L with its rows padded to a multiple of this
LSE_ALIGN = 32
#: the dtypes it takes (float64 has no fused CUDA kernel)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: its mask codes: none, causal from the top-left corner (key j visible to query i iff j <= i)
_NO_MASK, _CAUSAL = 0, 1
#: the largest batch (its third grid dimension on the GPU) one call takes
MAX_BATCH = 65535
#: the bias row's batch stride is padded to a multiple of this many elements (the kernel asks 16 bytes)
BIAS_ALIGN = 16
#: keys of the calls the kernel refused in this process (:func:`guarded`)
_REFUSED: dict = {}


class Refused(RuntimeError):
    """The kernel does not take this call (an error raised by its operator that is neither out of memory nor a
    CUDA error): the caller computes it another way."""


def runs(device_type: str, dtype) -> bool:
    """Whether the kernel may take a call on this device type and dtype (CUDA built for NVIDIA GPUs,
    :data:`DTYPES`; ROCm builds have other kernels behind these operators)."""
    return (device_type == "cuda" and dtype in DTYPES and FORWARD is not None and BACKWARD is not None
            and torch.version.hip is None)


def takes(batch: int, m: int, n: int) -> bool:
    """Whether the shapes suit one call: a batch of at most :data:`MAX_BATCH`, at least one query and one key."""
    return 0 < batch <= MAX_BATCH and m > 0 and n > 0


def _call(op, *args, **kwargs):
    """``op(*args, **kwargs)``; an error the operator raises that is neither out of memory nor a CUDA error
    becomes :class:`Refused` (errors of this module's own code are not caught)."""
    try:
        return op(*args, **kwargs)
    except (RuntimeError, NotImplementedError) as exc:
        if isinstance(exc, torch.OutOfMemoryError) or "CUDA error" in str(exc):
            raise
        raise Refused(str(exc)) from exc


def _fold(q, v, lw, causal, grad_lw) -> bool:
    """Whether the log-weights ride as the extra coordinate (module docstring) rather than as a bias row."""
    from .accelerator_paths import fused_widths

    return lw is not None and (grad_lw or fused_widths(q.shape[-1], v.shape[-1], True, causal, q.dtype)[1])


def _inputs(q, k, v, lw, causal, grad_lw=False):
    """(Q, K, V, bias or None, width of the values) in the kernel's layout (module docstring)."""
    from .accelerator_paths import FUSED_ALIGN

    fold = _fold(q, v, lw, causal, grad_lw)
    Q, K, V, _, c = layout(q, k, v, lw, causal=causal, fold=fold, align=FUSED_ALIGN, heads=2)
    bias = None
    if lw is not None and not fold:
        # log a as it is (-inf for a weight 0: the kernel takes infinite biases; rows left with no visible key
        # are set by the caller), in q's dtype (the kernel's), its batch stride a multiple of BIAS_ALIGN
        # elements (the kernel's alignment)
        B, m, n = q.shape[0], q.shape[-2], lw.shape[-1]
        row = q.new_full((B, BIAS_ALIGN * -(-n // BIAS_ALIGN)), -math.inf)
        row[:, :n] = lw
        bias = row[:, None, None, :n].expand(B, 1, m, n)
    # the kernel refuses operands whose first element is not aligned to 16 bytes (a view into a larger buffer)
    own = lambda t: t.contiguous() if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)
    return own(Q), own(K), own(V), bias, c


def _own(t):
    """``t``, or a copy where it is a view of a kernel output (an autograd function must return tensors of
    its own: forward-mode AD fails on a view)."""
    return t.clone() if t._base is not None else t


def forward(q, k, v, lw, causal):
    """(out (B, m, c), L (B, m) in float32 for the half types) of 3-D inputs, log-weights ``lw`` (B, n) or
    None; ``causal``: the sequence's mask (m == n). Rows with no visible key of positive weight give
    out = 0 and L = -inf."""
    m = q.shape[-2]
    Q, K, V, bias, c = _inputs(q, k, v, lw, causal)
    out, lse = _call(FORWARD, Q, K, V, bias, None, None, None, None, 0.0, _CAUSAL if causal else _NO_MASK,
                     True, scale=1.0)[:2]
    out, lse = clear_empty_rows(out[:, :, 0, :c], lse[:, 0, :m], lw, causal)
    return _own(out.contiguous()), _own(lse.contiguous())


def backward(q, k, v, lw, out, lse, g_out, causal, need):
    """(dq, dk, dv, dlw) for the cotangent ``g_out`` of ``out`` (none on L); ``need`` flags which (None for
    the others). d(log a) is the extra column of dk' (module docstring)."""
    B, m, e = q.shape
    n = k.shape[-2]
    Q, K, V, bias, c = _inputs(q, k, v, lw, causal, grad_lw=bool(need[3]))
    width = Q.shape[-1]
    live = torch.isfinite(lse)
    # a row with no visible key has output 0 whatever its inputs: zero cotangent, and any finite L (the
    # kernel recomputes P = exp(s - L) and must see no -inf there)
    g = torch.where(live.unsqueeze(-1), g_out, torch.zeros_like(g_out))
    # the kernel reads L as float32 whatever L came from (a streamed engine's forward pass gives the half
    # types' L in their dtype); float64 never reaches the kernel (it serves the tests' stand-in)
    L = torch.zeros(B, 1, LSE_ALIGN * -(-m // LSE_ALIGN), device=lse.device,
                    dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    L[:, 0, :m] = torch.where(live, lse, torch.zeros_like(lse))
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1])).unsqueeze(2).contiguous()
    seed = torch.empty((), dtype=torch.long)
    offset = torch.empty((), dtype=torch.long)
    dQ, dK, dV = _call(BACKWARD, pad(g), Q, K, V, bias, pad(out), None, None, m, n, L, 0.0, seed, offset,
                       _CAUSAL if causal else _NO_MASK, False, scale=1.0)[:3]
    dq = dQ[:, :, 0, :e] if need[0] else None
    dk = dK[:, :, 0, :e] if need[1] else None
    dv = dV[:, :, 0, :c] if need[2] else None
    dlw = dK[:, :, 0, e] if need[3] and lw is not None else None
    return dq, dk, dv, dlw


def guarded(key, kernel, fallback, what: str):
    """``kernel()``, or ``fallback()`` where the kernel refused a call of this ``key`` before (or refuses
    this one: the first refusal warns, RuntimeWarning naming the error)."""
    from particles.device import run_or_fall_back

    return run_or_fall_back(_REFUSED, key, kernel, fallback, lambda exc: isinstance(exc, Refused),
                            lambda exc: f"{what}: torch's memory-efficient CUDA kernel refused the call "
                                        f"({str(exc)[:200]}); computing with the streamed kernel's own engine from "
                                        "now on in this process")
