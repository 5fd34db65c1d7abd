"""Streaming attention: the kernel of :mod:`meanfield.kernels` in O(N (d + block)) memory.

Computes the same map as the dense kernel,

    out_i = sum_j P_ij v_j,   P_ij = exp(s_ij - L_i),   s_ij = <q_i, k_j> + log a_j  (-inf where s_j > t_i),
    L_i = log sum_j exp(s_ij)                         (row log-sum-exp; -inf for a row with no visible key),

without ever holding the (m, n) matrix: queries and keys are cut into tiles of at most
``block_q x block_k`` scores and the softmax is accumulated online (running max, running sum,
flash-attention style). Rows with no visible key give zeros, as in the dense kernel.

Derivatives are analytic and streamed the same way (:class:`StreamAttention`):

* VJP (reverse mode): with dO the output cotangent and D_i = <dO_i, out_i>,
  ds_ij = P_ij (<dO_i, v_j> - D_i) (+ P_ij dL_i for a cotangent on L), then
  dq_i = sum_j ds_ij k_j, dk_j = sum_i ds_ij q_i, dv_j = sum_i P_ij dO_i, d(log a)_j = sum_i ds_ij.
  Scores are recomputed tile by tile from the saved L (no stored probabilities).
* JVP (forward mode), the kernel-level form of the Jacobian of docs/math.md section 4.1:
  ds_ij = <dq_i, k_j> + <q_i, dk_j> + d(log a)_j,
  d out_i = sum_j P_ij dv_j + sum_j P_ij ds_ij v_j - (sum_j P_ij ds_ij) out_i,   dL_i = sum_j P_ij ds_ij.

The function returns (out, L) so that the backward is itself a differentiable expression of the
inputs and outputs: double backward and forward-over-reverse are exact (their recorded graph is
O(m n), as any second-order quantity built from tiles is). All loops depend on shapes only, so
``torch.func`` transforms (jvp, vjp, vmap via ``generate_vmap_rule``, jacrev, jacfwd) apply.

Engines. Each pass has a fast engine and a differentiable one; the results agree to rounding:

* On CPU, where the mask is absent or is the causal mask of a sequence (query and key positions
  equal and strictly increasing), the forward pass (out and L) and the VJP run in torch's fused
  flash-attention kernel (the C++ kernel behind ``scaled_dot_product_attention``), with log-weights
  as a broadcast additive mask row or, with the causal mask (which the kernel cannot combine with a
  mask) or when their gradient is needed, as one extra key coordinate (q' = [q, 1], k' = [k, log a]).
* On CUDA, for float32 and the half types with the same masks, heads of more than 3 features (smaller ones take
  the small-head Triton kernels for every pass, :data:`meanfield.accelerator_paths.SMALL_HEADS_FIRST`; in bfloat16
  their VJP at radius 100 carries bfloat16's own rounding, as the dense path's), the forward pass and the VJP run in
  torch's memory-efficient kernel (the CUTLASS kernel behind SDPA's forward and backward), called
  directly with our out and L (:mod:`meanfield.efficient_cuda`): the VJP of a graph recorded through
  ``attend`` takes SDPA's backward time (0.99-1.04x on an H200 at N = 1e5). The JVP, and every pass
  with arbitrary positions or in float64, takes the engine of :func:`meanfield.accelerator_paths.stream_engine`
  (the Triton kernels, or the tile loops).
* Otherwise the tiles run in Python with in-place updates (one score buffer per tile, hoisted
  transposes, ``baddbmm`` accumulation, one host read for the whole mask layout); on accelerators,
  where a tile is a block of rows against all keys, their products are regrouped to pass over each
  tile fewer times (``fold`` in :mod:`meanfield.attention_tiles`).
* A backward recorded for differentiation (``create_graph=True``) is a node of its own
  (an autograd function): its forward is the fast VJP, its derivative in the cotangent is the
  fast streamed JVP (the VJP is linear in the cotangent), and its derivative in q, k, v, log a comes
  from the functional tiles (partial derivatives of the VJP in q, k, v, log a, out and L, the cotangents
  attached: higher orders follow them), computed only when the backward pass asks for it.
  Reverse-over-reverse Jacobian products (:func:`meanfield.local_lipschitz`) thus record O(N) and never touch the tiles'
  graph. A backward whose tensors carry forward-mode tangents (forward-over-reverse) or legacy batch
  dimensions (``torch.autograd.functional``'s ``vectorize=True``) runs in the functional tiles. Under
  ``torch.func`` transforms (which wrap tensors and forbid in-place updates) every derivative takes the
  functional tiles: ``torch.func.jvp`` / ``vjp`` are exact but slower than ``torch.autograd.forward_ad`` /
  ``torch.autograd.grad``.

Where it lives: this module holds the autograd functions, the choice of engine and the public calls;
the tiles (mask layout, functional and in-place tile loops) are in :mod:`meanfield.attention_tiles`,
the CPU flash kernel's calls in :mod:`meanfield.flash_cpu`, CUDA's memory-efficient kernel's in
:mod:`meanfield.efficient_cuda` and the Triton kernels in :mod:`meanfield.triton_attention`.

:func:`fused_attend` is the forward path through ``torch.nn.functional.scaled_dot_product_attention``
in its 4-D layout (fused kernels on CPU and CUDA), chosen by :func:`meanfield.kernels.attend`
(``method="auto"``) for forward passes.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
from torch.autograd import forward_ad as _forward_ad

from particles.validation import broadcast_shapes

from . import attention_tiles as tiles
from . import efficient_cuda as efficient
from . import flash_cpu as flash
from .accelerator_paths import efficient_first
from .kernel_inputs import transforms_active, watched

__all__ = ["StreamAttention", "stream_attend", "fused_attend", "sequence_mask", "DEFAULT_BLOCK", "ENGINES"]

#: Default tile edge. A 256 x 256 tile of float64 is 512 KiB and stays in cache; in the Python tile
#: loops it beat 128, 512, 1024 and wide (256 x 1024 to 64 x 4096) tiles at d = 3 and 64, masked or
#: not (forward, JVP, VJP; benchmarks/attention.md)
DEFAULT_BLOCK = 256


#: :func:`fused_attend` runs batches of more entries in chunks of this many (CUDA's fused kernels put the batch and
#: the heads on grid axes of at most 65535 programs)
FUSED_BATCH_MAX = 65535


#: a backward node recorded with create_graph keeps its probability tiles for repeated JVPs (the
#: Jacobian products of local_lipschitz) up to this many bytes; above, they are recomputed (O(N) memory)
P_CACHE_BYTES = 64 * 2**20



# ---------------------------------------------------------------------- what may run fast
def _vmapped_size(*tensors) -> int:
    """The product of the batch sizes of the ``torch.func.vmap`` levels around this call (1 without vmap).

    Inside vmap a tensor's shape is one sample's: the dense path's memory guard and auto's thresholds, which
    count all batch entries, would see 1/B of the scores that the batched kernel allocates (a 96 MiB dense call
    passing a 4 MiB limit). The batched tensors are unwrapped level by level (grad and jvp wrappers in between
    carry no batch dimension), each vmap level's size read from the unwrapped tensor at its batch dimension;
    an input not batched at a level (``in_dims=None``) meets one that is, and the product broadcasts to it."""
    try:
        functorch = torch._C._functorch
        sizes = {}
        for t in tensors:
            while t is not None and functorch.is_functorch_wrapped_tensor(t):
                inner = functorch.get_unwrapped(t)
                if functorch.is_batchedtensor(t):
                    sizes[functorch.maybe_get_level(t)] = inner.shape[functorch.maybe_get_bdim(t)]
                t = inner
    except (AttributeError, RuntimeError):   # private API gone: the logical size, as before
        return 1
    return math.prod(sizes.values())


def _functional_only(*tensors) -> bool:
    """Whether only the functional tiles may compute now: inside a torch.func transform, or on tensors that
    carry what the fused, Triton and in-place engines would drop: a forward-mode tangent (forward-over-reverse:
    ``torch.autograd.forward_ad`` around a backward pass) or a legacy batch dimension
    (``torch.autograd.functional``'s ``vectorize=True``, ``grad(..., is_grads_batched=True)``)."""
    if transforms_active():
        return True
    present = [t for t in tensors if t is not None]
    legacy = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)
    if legacy is not None and any(legacy(t) for t in present):
        return True   # (first: unpacking a legacy batched tensor's tangent has no batching rule)
    return _forward_ad._current_level >= 0 and any(_forward_ad.unpack_dual(t).tangent is not None for t in present)


def _plain(*tensors) -> bool:
    """True when nothing will differentiate what is computed now: in-place and non-differentiable
    fused kernels are then allowed."""
    if _functional_only(*tensors):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def _flash_ok(q, plan, qp) -> bool:
    return (plan.engine == "auto" and flash.FORWARD is not None and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64) and (qp is None or plan.causal) and not transforms_active())


def _efficient_ok(q, k, plan, qp) -> bool:
    return (plan.fused and plan.efficient and efficient.runs(q.device.type, q.dtype) and (qp is None or plan.causal)
            and efficient.takes(q.shape[0], q.shape[-2], k.shape[-2]) and not transforms_active())


def _efficient_key(name, q, v, lw, plan, grad_lw=False):
    """What a refusal of the memory-efficient kernel is remembered by: the pass, device, dtype, widths, the mask,
    whether log-weights ride and how (their gradient needs the coordinate layout), and whether the call is
    batched (their layouts differ)."""
    return _key(name, q, v) + (plan.causal, lw is not None, bool(grad_lw), q.shape[0] > 1)


# ---------------------------------------------------------------------- the autograd Function
def _flat3(t, rows_dims=2):
    """(..., rows, f) -> (B, rows, f) (or (..., rows) -> (B, rows) for rows_dims=1); None stays None."""
    if t is None:
        return None
    return t.reshape(math.prod(t.shape[:t.dim() - rows_dims]), *t.shape[t.dim() - rows_dims:])


#: elements a batch entry of a Triton kernel's tensor may span, its padded rows and columns included: the kernels
#: index within a batch entry in int32 (rows x row stride + columns x column stride; only the batch offset is int64),
#: which would wrap beyond it (a strided head of a multi-head layout, row stride 768, at N = 2.8e6)
TRITON_MAX_SPAN = 2**31 - 1
#: rows or columns a kernel's last block may reach past a tensor's end (masked, but their offsets are computed)
_TRITON_PAD = 256


def _int32_spans(*tensors) -> bool:
    """Whether every batch entry of ``tensors`` (3-D, or 2-D for log-weights and positions) is indexable in int32
    by the Triton kernels, padding included (:data:`TRITON_MAX_SPAN`)."""
    return all(t is None or sum((size + _TRITON_PAD) * abs(stride) for size, stride in zip(t.shape[1:], t.stride()[1:]))
               <= TRITON_MAX_SPAN for t in tensors)


def _output_shaped(q, v) -> torch.Tensor:
    """A meta tensor of the forward pass's output shape (B, m, c), for :func:`_int32_spans`: an output wider than its
    queries (c > e) may pass int32 where they do not (e = 2, c = 3 from m of about 7.2e8)."""
    return torch.empty(q.shape[0], q.shape[1], v.shape[-1], device="meta")


def _triton_ok(plan, *tensors) -> bool:
    """The Triton engine: chosen, outside torch.func transforms, for tensors whose batch entries it indexes in
    int32 (:func:`_int32_spans`; larger ones go to the tile loops)."""
    return plan.engine == "triton" and not transforms_active() and _int32_spans(*tensors)


def _triton_vjp_ok(plan, q, v, *tensors) -> bool:
    """The Triton engine for a VJP: forced, or chosen by device for a width whose VJP it also takes
    (:func:`meanfield.accelerator_paths.triton_vjp`)."""
    from .accelerator_paths import triton_vjp

    return _triton_ok(plan, q, v, *tensors) and (not plan.fused or triton_vjp(q.dtype, q.shape[-1], v.shape[-1]))


def _triton():
    from . import triton_attention

    return triton_attention


def _key(name, q, v, lw=None, qp=None, plan=None):
    """What a compile failure (Triton) or refusal of a kernel is remembered by: the pass, the device (its index:
    GPUs of a process may differ), dtype and widths, and, for the Triton kernels, the mask they were specialized
    for (whether log-weights ride; none, a sequence's causal mask or arbitrary positions)."""
    mask = () if plan is None else (lw is not None, "causal" if plan.causal else "none" if qp is None else "positions")
    return ("attention " + name, str(q.device), q.dtype, q.shape[-1], v.shape[-1]) + mask


def _forward(q, k, v, lw, qp, kp, plan):
    """(out, L) for 3-D inputs."""
    if _efficient_ok(q, k, plan, qp):
        return efficient.guarded(_efficient_key("forward", q, v, lw, plan),
                                 lambda: efficient.forward(q, k, v, lw, plan.causal),
                                 lambda: _forward(q, k, v, lw, qp, kp, _unfused(plan)), "attend")
    if _triton_ok(plan, q, k, v, lw, qp, kp, _output_shaped(q, v)):
        from particles.device import run_triton

        return run_triton(_key("forward", q, v, lw, qp, plan),
                          lambda: _triton().forward(q, k, v, lw, qp, kp, plan.causal),
                          lambda: tiles.forward_tiles(q, k, v, lw, qp, kp, plan), "attend")
    if _flash_ok(q, plan, qp):
        return flash.forward(q, k, v, lw, plan.causal)
    return tiles.forward_tiles(q, k, v, lw, qp, kp, plan)


class StreamAttention(torch.autograd.Function):
    """(out, L) = streamed attention of (q, k, v, log a, t, s); see the module docstring.

    Inputs are 3-D (batch, rows, features) and share their batch size (positions and log-weights
    2-D); :func:`stream_attend` broadcasts and flattens them, and makes ``plan`` (the tiles and what the
    positions allow).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, lw, qp, kp, plan):
        return _forward(q, k, v, lw, qp, kp, plan)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, lw, qp, kp, plan = inputs
        out, lse = output
        ctx.plan = plan
        ctx.has_lw = lw is not None
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, lw, qp, kp, out, lse)
        ctx.save_for_forward(q, k, v, lw, qp, kp, out, lse)

    @staticmethod
    def backward(ctx, g_out, g_lse):
        q, k, v, lw, qp, kp, out, lse = ctx.saved_tensors
        need = tuple(ctx.needs_input_grad[:3]) + (ctx.has_lw and ctx.needs_input_grad[3],)
        if g_out is None:
            g_out = torch.zeros_like(out)
        plan = _retiled(ctx.plan, q, k, qp, kp, g_out, g_lse)
        with watched("VJP", q, k):
            if _plain(q, k, v, lw, out, lse, g_out, g_lse):
                dq, dk, dv, dlw = _fast_backward(q, k, v, lw, qp, kp, out, lse, g_out, g_lse, plan, need)
            elif _functional_only(q, k, v, lw, out, lse, g_out, g_lse):
                dq, dk, dv, dlw = tiles.backward_functional(q, k, v, lw, qp, kp, out, lse, g_out, g_lse, plan, need)
            else:
                # create_graph: the backward as a node of its own, whose derivative in the cotangent is the
                # streamed JVP (what reverse-over-reverse products need) and in the primal inputs the
                # derivative of the functional tiles, computed only when the engine asks for it
                dq, dk, dv, dlw = _StreamBackward.apply(q, k, v, lw, qp, kp, out, lse, g_out, g_lse, plan, need)
        return dq, dk, dv, dlw, None, None, None

    @staticmethod
    def jvp(ctx, tq, tk, tv, tlw, tqp, tkp, tplan):
        q, k, v, lw, qp, kp, out, lse = ctx.saved_tensors
        tlw = tlw if ctx.has_lw else None
        plan = _retiled(ctx.plan, q, k, qp, kp, tq, tk, tv, tlw)
        with watched("JVP", q, k):
            if _plain(q, k, v, lw, out, lse, tq, tk, tv, tlw):
                return _fast_jvp(q, k, v, lw, qp, kp, out, lse, tq, tk, tv, tlw, plan)
            return tiles.jvp_functional(q, k, v, lw, qp, kp, out, lse, tq, tk, tv, tlw, plan)


def _retiled(plan, q, k, qp, kp, *batched):
    """``plan``, tiled again where a backward or JVP runs under more ``torch.func.vmap`` levels than its forward
    (``jacrev``, ``jacfwd``, a vmap over cotangents or tangents): the temporaries that depend on ``batched``
    carry those levels' batch, which the forward's tiles (sized by the memory budget, ``plan.sized_for``) did
    not count. Fixed tiles (CPU, a given block size) stay as they are."""
    if not plan.sized_for or not transforms_active():
        return plan
    entries = q.shape[0] * _vmapped_size(q, k, *batched)
    if entries <= plan.sized_for:
        return plan
    m, n = q.shape[-2], k.shape[-2]
    again = tiles.tile_plan(qp, kp, m, n, *_budget_tiles(entries, m, n, q), plan.engine, plan.fused)
    return dataclasses.replace(again, efficient=plan.efficient, sized_for=entries)


def _budget_tiles(entries, m, n, q) -> tuple[int, int]:
    """(block_q, block_k) on an accelerator for ``entries`` batch entries (vmap levels included), sized by the
    memory budget of q's device (:func:`meanfield.accelerator_paths.tile_shape`)."""
    from particles.device import memory_budget

    from .accelerator_paths import tile_shape

    return tile_shape(entries, m, n, q.element_size(), memory_budget(q.device))


def _fold(q) -> bool:
    """Whether the tile loops regroup their products to pass over each tile fewer times
    (:func:`meanfield.attention_tiles.jvp_tiles`): on accelerators, where a tile is a block of rows against
    all keys in device memory, in float32 and float64; on CPU the cache-sized tiles keep their measured form,
    and the half types theirs (their L is float32: folded into a half product it would lose its digits)."""
    return fold_for(q.device.type, q.dtype)


def fold_for(device_type: str, dtype) -> bool:
    """:func:`_fold` as a function of the device type and dtype."""
    return device_type != "cpu" and dtype in (torch.float32, torch.float64)


def _fast_jvp(q, k, v, lw, qp, kp, out, lse, tq, tk, tv, tlw, plan, cache=None):
    if _triton_ok(plan, q, k, v, lw, qp, kp, out, tq, tk, tv, tlw):
        from particles.device import run_triton

        return run_triton(_key("jvp", q, v, lw, qp, plan),
                          lambda: _triton().jvp(q, k, v, lw, qp, kp, plan.causal, out, lse, tq, tk, tv, tlw),
                          lambda: tiles.jvp_tiles(q, k, v, lw, qp, kp, out, lse, tq, tk, tv, tlw, plan,
                                                  fold=_fold(q)), "attend (JVP)")
    return tiles.jvp_tiles(q, k, v, lw, qp, kp, out, lse, tq, tk, tv, tlw, plan, cache=cache, fold=_fold(q))


def _unfused(plan):
    """The plan without the memory-efficient kernel (after it refused a call); the engine stays chosen by
    device (``plan.fused``), so that the VJP of a wide head still avoids Triton."""
    return dataclasses.replace(plan, efficient=False)


def _fast_backward(q, k, v, lw, qp, kp, out, lse, g_out, g_lse, plan, need):
    if g_lse is None and _efficient_ok(q, k, plan, qp):
        return efficient.guarded(_efficient_key("backward", q, v, lw, plan, need[3]),
                                 lambda: efficient.backward(q, k, v, lw, out, lse, g_out, plan.causal, need),
                                 lambda: _fast_backward(q, k, v, lw, qp, kp, out, lse, g_out, g_lse,
                                                        _unfused(plan), need), "attend (VJP)")
    if _triton_vjp_ok(plan, q, v, k, lw, qp, kp, out, g_out, g_lse):
        from particles.device import run_triton

        return run_triton(_key("backward", q, v, lw, qp, plan),
                          lambda: _triton().backward(q, k, v, lw, qp, kp, plan.causal, out, lse, g_out, g_lse, need),
                          lambda: tiles.backward_tiles(q, k, v, lw, qp, kp, out, lse, g_out, g_lse, plan, need,
                                                       fold=_fold(q)),
                          "attend (VJP)")
    if g_lse is None and _flash_ok(q, plan, qp) and flash.BACKWARD is not None:
        return flash.backward(q, k, v, lw, out, lse, g_out, plan.causal, need)
    return tiles.backward_tiles(q, k, v, lw, qp, kp, out, lse, g_out, g_lse, plan, need, fold=_fold(q))


def _engine_node(t):
    """The autograd node that receives t's gradient (None for a tensor that does not require grad)."""
    if t is None or not t.requires_grad:
        return None
    try:
        from torch.autograd.graph import _get_grad_fn_or_grad_acc

        return _get_grad_fn_or_grad_acc(t)
    except (ImportError, AttributeError, RuntimeError):
        return True  # unknown: assume it is needed


def _will_run(node) -> bool:
    if node is None:
        return False
    if node is True:
        return True
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, RuntimeError):
        return True


class _StreamBackward(torch.autograd.Function):
    """(dq, dk, dv, dlw) = the streamed VJP of (out, L) with cotangents (g_out, g_lse), as a node of the
    graph recorded by ``create_graph=True``.

    The VJP is linear in the cotangents: <VJP(g), t> = <g_out, J_out t> + <g_lse, J_L t>, so its
    gradient in (g_out, g_lse) along (t_q, t_k, t_v, t_lw) is the streamed JVP (d out, d L). Its
    gradient in the primal inputs (q, k, v, log a, out, L) comes from differentiating the functional
    tiles, and only when the running backward pass needs it (reverse-over-reverse Jacobian products
    never do: they differentiate in the cotangent only).
    """

    @staticmethod
    def forward(q, k, v, lw, qp, kp, out, lse, g_out, g_lse, plan, need):
        # tensors of its own: the engines return views of their buffers (dk and d log a share one), which
        # autograd would forbid to update in place
        return tuple(None if t is None else efficient._own(t)
                     for t in _fast_backward(q, k, v, lw, qp, kp, out, lse, g_out, g_lse, plan, need))

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, lw, qp, kp, out, lse, g_out, g_lse, plan, need = inputs
        ctx.plan, ctx.need = plan, need
        ctx.has_lw, ctx.has_glse = lw is not None, g_lse is not None
        ctx.set_materialize_grads(False)
        ctx.nodes = [_engine_node(t) for t in (q, k, v, lw, out, lse)]
        ctx.save_for_backward(q, k, v, lw, qp, kp, out, lse, g_out, g_lse)

    @staticmethod
    def backward(ctx, gq, gk, gv, glw):
        saved = ctx.saved_tensors   # unpacked once (each unpack is a transfer under save_on_cpu-like hooks)
        with watched("VJP's derivative (a JVP)", saved[0], saved[1]):
            return _StreamBackward.derivatives(ctx, saved, gq, gk, gv, glw)

    @staticmethod
    def derivatives(ctx, saved, gq, gk, gv, glw):
        q, k, v, lw, qp, kp, out, lse, g_out, g_lse = saved
        plan, need = ctx.plan, ctx.need
        grads = [None] * 12
        tans = [g if (g is not None and flag) else None for g, flag in zip((gq, gk, gv, glw), need)]
        if (ctx.needs_input_grad[8] or ctx.needs_input_grad[9]) and any(t is not None for t in tans):
            if _plain(q, k, v, lw, out, lse, *tans):
                # repeated products at one point (reverse-over-reverse Jacobian products) reuse the
                # probability tiles while they fit in P_CACHE_BYTES
                if not hasattr(ctx, "p_cache"):
                    # (the half types' tiles are float32: attention_tiles.widen)
                    small = q.shape[0] * q.shape[1] * k.shape[1] * max(4, q.element_size()) <= P_CACHE_BYTES
                    ctx.p_cache = {} if small and plan.engine != "triton" else None
                d_out, d_lse = _fast_jvp(q, k, v, lw, qp, kp, out, lse, *tans, plan, cache=ctx.p_cache)
            else:
                d_out, d_lse = tiles.jvp_functional(q, k, v, lw, qp, kp, out, lse, *tans, plan)
            grads[8] = d_out if ctx.needs_input_grad[8] else None
            grads[9] = d_lse if ctx.needs_input_grad[9] and ctx.has_glse else None
        cot = [(b, g) for b, g in zip(range(4), (gq, gk, gv, glw)) if need[b] and g is not None]
        slots = (0, 1, 2, 3, 6, 7)
        run = [ctx.needs_input_grad[i] and _will_run(node) for i, node in zip(slots, ctx.nodes)]
        if cot and any(run):
            create = torch.is_grad_enabled()   # (create_graph of the running backward pass)
            with torch.enable_grad():
                # partial derivatives in q, k, v, log a, out and L at fixed cotangents: the functional VJP of
                # aliases of them (views: the inner derivative stops at each, and the engine carries it on along
                # that tensor's own path: out and L through this call's forward node, the cotangents through
                # slots 8 and 9 above). The cotangents stay attached, and so do the inputs not asked for:
                # the partials are functions of them too, which higher orders differentiate
                alias = [None if t is None else t.view_as(t) if t.requires_grad
                         else t.detach().requires_grad_(True) if run[i] else t
                         for i, t in enumerate((q, k, v, lw, out, lse))]
                wanted = [i for i in range(6) if run[i] and alias[i] is not None]
                B = tiles.backward_functional(*alias[:4], qp, kp, *alias[4:], g_out, g_lse, plan, need)
                # a derivative the tiles never touched (every tile skipped: no query sees a key) is a constant 0
                live = [(B[b], g) for b, g in cot if B[b].requires_grad]
                parts = (torch.autograd.grad([d for d, _ in live], [alias[i] for i in wanted], [g for _, g in live],
                                             allow_unused=True, create_graph=create, retain_graph=True)
                         if live else [None] * len(wanted))
            for i, part in zip(wanted, parts):
                grads[slots[i]] = part
        return tuple(grads)


def _check_block(block_size):
    if block_size is None:
        return None
    pair = (block_size, block_size) if isinstance(block_size, numbers.Integral) else tuple(block_size)
    if len(pair) != 2 or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) and b >= 1
                                 for b in pair):
        raise ValueError(f"block_size: expected a positive int or a pair (block_q, block_k), got {block_size!r}")
    return tuple(int(b) for b in pair)


def _broadcast(q, k, v, log_weights, q_pos, k_pos):
    """Check shapes and expand every tensor to the common leading (batch) shape (views, no copies)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise TypeError(f"{name}: expected a tensor of shape (..., rows, features), got {type(t).__name__}")
    m, e = q.shape[-2:]
    n = k.shape[-2]
    if k.shape[-1] != e:
        raise ValueError(f"k: feature size {k.shape[-1]} differs from q's {e}")
    if v.shape[-2] != n:
        raise ValueError(f"v: {v.shape[-2]} rows but k has {n}")
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos, k_pos: give both positions (masked attention) or neither")
    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    for name, t, size in (("log_weights", log_weights, n), ("q_pos", q_pos, m), ("k_pos", k_pos, n)):
        if t is not None:
            if t.dim() < 1 or t.shape[-1] != size:
                raise ValueError(f"{name}: last dimension must be {size}, got shape {tuple(t.shape)}")
            shapes.append(t.shape[:-1])
    batch = broadcast_shapes(*shapes)
    q, k, v = (t.expand(*batch, *t.shape[-2:]) for t in (q, k, v))
    log_weights, q_pos, k_pos = (
        None if t is None else t.expand(*batch, t.shape[-1]) for t in (log_weights, q_pos, k_pos)
    )
    return batch, q, k, v, log_weights, q_pos, k_pos


ENGINES = ("auto", "tiles", "triton")


def _resolve_engine(engine, q, v):
    from particles.device import triton_runs

    from .accelerator_paths import stream_engine

    dev = q.device.type
    if engine is None:
        # compute capabilities of NVIDIA GPUs (a ROCm build reports its own numbers there)
        capability = (torch.cuda.get_device_capability(q.device) if dev == "cuda" and torch.version.hip is None
                      else None)
        return stream_engine(dev, q.dtype, q.shape[-1], v.shape[-1], triton=dev != "cpu" and triton_runs(dev),
                             transforms=transforms_active(), capability=capability)
    if engine not in ENGINES:
        raise ValueError(f"engine: expected None or one of {ENGINES}, got {engine!r}")
    if engine == "triton" and not triton_runs(dev):
        raise ValueError(f"engine: 'triton' does not run on {dev} tensors here (Triton not installed, no CUDA, "
                         "or on CPU without TRITON_INTERPRET=1)")
    return engine


def shared_keys(q, k, v, log_weights, q_pos) -> bool:
    """Whether a batch of queries (more than one batch entry) meets keys, values and log-weights that no batch
    dimension of a size above 1 distinguishes, without positions: then the batch is one set of b x m queries
    (the same scores and outputs), and no path expands the keys over the batch (decided on shapes only: an
    expanded tensor may carry a forward-mode tangent that differs across the batch)."""
    if q_pos is not None or not isinstance(q, torch.Tensor) or q.dim() <= 2 or math.prod(q.shape[:-2]) <= 1:
        return False
    return all(t is None or (isinstance(t, torch.Tensor) and t.dim() >= rank and all(s == 1 for s in t.shape[:-rank]))
               for t, rank in ((k, 2), (v, 2), (log_weights, 1)))


def one_query_set(q, k, v, log_weights):
    """In the case of :func:`shared_keys`: ((q, k, v, log_weights) as one set of b x m queries against the keys
    without their size-1 batch dimensions, the leading (batch) shape of the output)."""
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2],
                            () if log_weights is None else log_weights.shape[:-1])
    return (q.reshape(-1, q.shape[-1]), k.reshape(k.shape[-2:]), v.reshape(v.shape[-2:]),
            None if log_weights is None else log_weights.reshape(-1)), lead


def stream_attend(q, k, v, log_weights=None, q_pos=None, k_pos=None, *, block_size=None, return_lse=False,
                  engine=None):
    """Weighted (causal) softmax attention in tiles of ``block_size`` (int or (block_q, block_k)).

    Same result as :func:`meanfield.kernels.attend`'s dense path (to rounding), memory
    O((m + n)(d + c) + block_q block_k); ``block_size`` None takes :data:`DEFAULT_BLOCK` on CPU and, on
    other devices, tiles sized by the memory budget (:func:`meanfield.accelerator_paths.tile_shape`).
    ``engine`` picks the fast engine of plain (not differentiated) passes: None by device
    (:func:`meanfield.accelerator_paths.stream_engine`: the measured CPU map on CPU, the Triton kernels
    on CUDA), "auto" (the CPU map), "tiles" (the in-place tile loops) or "triton"
    (:mod:`meanfield.triton_attention`; on CPU only under ``TRITON_INTERPRET=1``, for tests). With
    ``return_lse`` also returns the row log-sum-exp L.
    """
    pair = _check_block(block_size)
    if shared_keys(q, k, v, log_weights, q_pos):
        # one set of b x m queries (no copy of the keys per batch entry in any engine)
        args, lead = one_query_set(q, k, v, log_weights)
        out, lse = stream_attend(*args, block_size=block_size, return_lse=True, engine=engine)
        out, lse = out.reshape(*lead, q.shape[-2], out.shape[-1]), lse.reshape(*lead, q.shape[-2])
        return (out, lse) if return_lse else out
    batch, q, k, v, log_weights, q_pos, k_pos = _broadcast(q, k, v, log_weights, q_pos, k_pos)
    m, n, c = q.shape[-2], k.shape[-2], v.shape[-1]
    if m == 0 or n == 0:
        # nothing to stream (and torch's CPU flash kernel would divide by zero): the empty dense product,
        # differentiable (zero gradients)
        s = q @ k.transpose(-1, -2)
        out, lse = torch.softmax(s, -1) @ v, s.sum(-1) - math.inf
        return (out, lse) if return_lse else out
    auto = engine is None
    engine = _resolve_engine(engine, q, v)
    fused = auto and efficient_first(q.device.type, q.dtype, q.shape[-1], c, engine)
    sized_for = 0   # fixed tiles
    if pair is not None:
        bq, bk = pair
    elif q.device.type == "cpu":
        bq, bk = DEFAULT_BLOCK, DEFAULT_BLOCK
    else:
        # every batch entry the tile loops compute on, those of torch.func.vmap levels included: a vmapped
        # tile is B times the logical one
        sized_for = math.prod(batch) * (_vmapped_size(q, k, v, log_weights, q_pos, k_pos)
                                        if transforms_active() else 1)
        bq, bk = _budget_tiles(sized_for, m, n, q)
    flat = [_flat3(q), _flat3(k), _flat3(v), _flat3(log_weights, 1), _flat3(q_pos, 1), _flat3(k_pos, 1)]
    plan = tiles.tile_plan(flat[4], flat[5], m, n, bq, bk, engine, fused)
    if sized_for:
        plan = dataclasses.replace(plan, sized_for=sized_for)
    out, lse = StreamAttention.apply(*flat, plan)
    out, lse = out.reshape(*batch, m, c), lse.reshape(*batch, m)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------- public fused path
def sequence_mask(q_pos, k_pos) -> bool:
    """Whether the positions give the causal mask of a sequence (q_pos == k_pos, strictly increasing
    along the last dimension), which fused kernels apply as ``is_causal`` without an (m, n) mask.

    Reads the positions (one host sync on an accelerator); False when they cannot be read (inside a
    ``torch.func`` transform).
    """
    if q_pos is None or k_pos is None or q_pos.shape[-1] != k_pos.shape[-1]:
        return False
    try:
        qp, kp = torch.broadcast_tensors(q_pos, k_pos)
        return bool((qp == kp).all() & (kp[..., 1:] > kp[..., :-1]).all())
    except RuntimeError:
        return False


def fused_attend(q, k, v, log_weights=None, q_pos=None, k_pos=None, *, causal=None, align=1):
    """Attention through ``torch.nn.functional.scaled_dot_product_attention`` in its 4-D layout.

    Torch picks the kernel (on CPU the fused flash kernel for float32/float64; on CUDA flash or
    memory-efficient kernels for half/float32, its math backend for float64, which materializes the
    scores). Positions that form a sequence's causal mask (``causal``, or :func:`sequence_mask` when
    None) become ``is_causal``, in O(N) memory; other positions need an explicit boolean (m, n) mask,
    O(m n) memory (``attend(method="auto")`` streams those instead). Log-weights enter as a broadcast
    additive mask row, or with ``is_causal`` as an extra coordinate q' = [q, 1], k' = [k, log a];
    SDPA's own 1/sqrt(e) scale is replaced by 1. Rows with no visible key of positive weight give
    zeros, as in the dense kernel. ``align`` > 1 zero-pads q, k and v to a multiple of it (CUDA's fused
    kernels need heads of a multiple of 8; :func:`meanfield.accelerator_paths.fused_widths`), and then
    log-weights ride as the extra coordinate wherever it costs no width.
    """
    batch, q, k, v, log_weights, q_pos, k_pos = _broadcast(q, k, v, log_weights, q_pos, k_pos)
    m, n, c = q.shape[-2], k.shape[-2], v.shape[-1]
    if q_pos is not None and causal is None:
        causal = m == n and sequence_mask(q_pos, k_pos)
    causal = bool(causal) and q_pos is not None
    if math.prod(batch) > FUSED_BATCH_MAX:
        # CUDA's fused kernels put the batch and the heads on grid axes of at most 65535 programs: chunks
        flat = lambda t: None if t is None else t.reshape(-1, *t.shape[len(batch):])
        parts = [flat(t) for t in (q, k, v, log_weights, q_pos, k_pos)]
        out = [fused_attend(*(None if t is None else t[b0:b0 + FUSED_BATCH_MAX] for t in parts), causal=causal,
                            align=align) for b0 in range(0, parts[0].shape[0], FUSED_BATCH_MAX)]
        return torch.cat(out).reshape(*batch, m, c)
    # the 4-D layout (B, H, rows, features): the last batch dimension as heads, the others merged
    lead = (1, 1) if not batch else ((1,) + tuple(batch) if len(batch) == 1 else (-1, batch[-1]))
    to4 = lambda t: t.reshape(*lead, *t.shape[-2:])
    Q, K, V = to4(q), to4(k), to4(v)
    mask = None
    lw = None if log_weights is None else log_weights.reshape(*lead, n)
    fold = causal
    if align > 1:
        from .accelerator_paths import fused_widths

        fold = fused_widths(q.shape[-1], c, lw is not None, causal, q.dtype)[1]
    if lw is not None and fold:
        Q, K = flash.weight_coordinates(Q, K, lw)
    elif lw is not None:
        mask = lw.unsqueeze(-2)
    if q_pos is not None and not causal:
        visible = k_pos.reshape(*lead, n).unsqueeze(-2) <= q_pos.reshape(*lead, m).unsqueeze(-1)
        mask = visible if mask is None else mask.masked_fill(~visible, -math.inf)
    # the CPU kernels need one width for q, k and v; zero columns change no product
    width = align * -(-max(Q.shape[-1], c) // align)
    pad = lambda t: t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))
    out = torch.nn.functional.scaled_dot_product_attention(pad(Q), pad(K), pad(V), attn_mask=mask,
                                                           is_causal=causal, scale=1.0)[..., :c]
    if lw is not None or (q_pos is not None and not causal):
        # rows with no visible key of positive weight: SDPA leaves them nan, zero or a plain average
        dead = None if lw is None else lw == -math.inf        # (B, H, n)
        if causal:
            empty = torch.cummin(dead.to(torch.int32), dim=-1).values.bool()
        elif q_pos is not None:
            empty = ~(visible if dead is None else visible & ~dead.unsqueeze(-2)).any(-1)
        else:
            empty = dead.all(-1, keepdim=True)
        out = torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out)
    return out.reshape(*batch, m, c)
