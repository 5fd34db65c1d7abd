"""What every path of the attention kernel reads off its inputs before it computes.

* :func:`check_shapes`: type, dtype, device and shape errors that name the argument;
* :func:`needs_derivatives` (and :func:`transforms_active`): whether the result may be differentiated, which
  decides between a forward-only path and one with derivatives;
* the rows that see no key of positive weight (:func:`dead_rows`), and what they are set to: the guarded formula's
  0 @ v for a path (:func:`zero_blind_rows`), a layer's silent output for an operator (:func:`silence_blind_rows`),
  docs/math.md section 2;
* :func:`tf32_on`: whether float32 matrix products on a CUDA device may run in TF32;
* :func:`watched`: what one long pass runs under: its threads on a CPU (:func:`particles.threads.one_call`) and
  its progress lines (:func:`particles.progress.long_call`).

The paths (:mod:`meanfield.kernels`' dispatch, :mod:`meanfield.streamed_attention`,
:mod:`meanfield.series_attention`) and the operators import these from here, so that no path imports the dispatcher.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch
from torch.autograd import forward_ad as _forward_ad

from particles.progress import long_call
from particles.threads import active_policy, one_call
from particles.validation import broadcast_shapes

__all__ = ["check_shapes", "needs_derivatives", "transforms_active", "dead_rows", "zero_blind_rows",
           "silence_blind_rows", "seen_positions", "tf32_on", "watched", "WATCHED_ENTRIES", "POLICY_ENTRIES",
           "SECONDS_PER_SCORE"]

#: a pass over at least this many scores (batch entries included; 1024 queries x 1024 keys) logs its progress
#: (:func:`watched`): from about 2 ms on 2 idle CPU cores (a fused forward pass in d = 3) to minutes under load
#: (registering a pass with the process's watcher costs about 6 us; a pass shorter than 5 s logs nothing)
WATCHED_ENTRIES = 2**20
#: a pass on a CPU over at least this many scores (1024 x 1024) takes its threads from the free cores
#: (:func:`particles.threads.one_call`) unless a framework entry point around it decides them: on 2 cores with one
#: other job running, torch's 2 threads made a forward pass and VJP at N = 8000 take 2.0-3.6 s against 0.73 s on one
POLICY_ENTRIES = 2**20
#: one-thread seconds per score of a forward pass on a CPU, what :func:`particles.threads.one_call` is told
#: (the fused kernel in d = 3: 1.8e-9 in float32, 3.0e-9 in float64 on one core of a 2-core Xeon)
SECONDS_PER_SCORE = 2e-9

_log = logging.getLogger("meanfield.kernels")
_NOTHING = contextlib.nullcontext()   # (reusable: the context of every small pass)


def transforms_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, ...) is active around this call."""
    try:
        return torch._C._functorch.peek_interpreter_stack() is not None
    except AttributeError:  # private API gone: assume the worst, take the differentiable engine
        return True


def needs_derivatives(*tensors) -> bool:
    """Whether the result may be differentiated: an input requires grad (reverse mode), a
    forward-AD level is open, or a torch.func transform is active (they wrap their inputs)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return True
    if _forward_ad._current_level >= 0:
        return True
    return transforms_active()


def check_shapes(q, k, v, log_weights, q_pos, k_pos) -> None:
    """Type, dtype, device and shape errors that name the argument (cheap: no data is read; the common
    case, three floating tensors on one device, costs a few attribute reads)."""
    if (log_weights is None and q_pos is None and k_pos is None and type(q) is type(k) is type(v) is torch.Tensor
            and q.dtype == k.dtype == v.dtype and q.dtype.is_floating_point and q.dim() == k.dim() == v.dim() == 2
            and q.shape[1] == k.shape[1] and k.shape[0] == v.shape[0] and k.shape[0] > 0
            and q.device == k.device == v.device):
        return   # the commonest call (unbatched, no weights or positions): everything below holds
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__} (convert with torch.as_tensor)")
        if t.dim() < 2:
            raise ValueError(f"{name}: expected a tensor of shape (..., rows, features), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating tensor (torch.float64, float32, ...), got {t.dtype}; "
                            "convert with .to(torch.float64)")
    others = [(name, t) for name, t in (("log_weights", log_weights), ("q_pos", q_pos), ("k_pos", k_pos))
              if t is not None]
    for name, t in others:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__} (convert with torch.as_tensor)")
        if name != "log_weights" and (t.is_complex() or t.dtype == torch.bool):
            raise TypeError(f"{name}: expected real positions, got {t.dtype}")
    if k.device != q.device or v.device != q.device or any(t.device != q.device for _, t in others):
        devices = sorted({str(t.device) for t in (q, k, v, log_weights, q_pos, k_pos) if t is not None})
        raise ValueError(f"q, k, v, log_weights, q_pos, k_pos: tensors on several devices {devices}; move them to "
                         "one device")
    if k.shape[-2] == 0:
        raise ValueError(f"k: no keys (shape {tuple(k.shape)}): attention needs at least one key")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k: queries have {q.shape[-1]} features and keys {k.shape[-1]}; they must agree")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v: expected one value per key ({k.shape[-2]}), got shape {tuple(v.shape)}")
    if log_weights is not None and log_weights.shape[-1] != k.shape[-2]:
        raise ValueError(f"log_weights: expected one entry per key ({k.shape[-2]}), "
                         f"got shape {tuple(log_weights.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}; convert with "
                        ".to(dtype) (a Measure: mu.to(dtype=...); an operator: SelfAttention(..., dtype=...))")
    if log_weights is not None and log_weights.dtype != q.dtype:
        raise TypeError(f"log_weights: expected dtype {q.dtype} like q, k, v, got {log_weights.dtype}")
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos, k_pos: give both positions (masked attention) or neither")
    if q_pos is not None:
        if q_pos.shape[-1] != q.shape[-2]:
            raise ValueError(f"q_pos: expected one position per query ({q.shape[-2]}), got shape {tuple(q_pos.shape)}")
        if k_pos.shape[-1] != k.shape[-2]:
            raise ValueError(f"k_pos: expected one position per key ({k.shape[-2]}), got shape {tuple(k_pos.shape)}")
    lead = q.shape[:-2]
    if k.shape[:-2] == lead and v.shape[:-2] == lead and all(t.shape[:-1] == lead for _, t in others):
        return
    leads = {"q": lead, "k": k.shape[:-2], "v": v.shape[:-2], **{name: t.shape[:-1] for name, t in others}}
    try:
        broadcast_shapes(*leads.values())
    except RuntimeError:
        raise ValueError("q, k, v, log_weights, q_pos, k_pos: batch dimensions do not broadcast ("
                         + ", ".join(f"{n} {tuple(s)}" for n, s in leads.items()) + ")") from None


def zero_blind_rows(out, v, log_weights, q_pos, k_pos) -> torch.Tensor:
    """``out`` with the rows that see no key of positive weight (:func:`dead_rows`) set to what the guarded formula
    of :func:`meanfield.kernels.attention_probs` gives them, 0 @ v: zeros, NaN in the columns where v holds a NaN or
    an infinity."""
    return torch.where(dead_rows(log_weights, q_pos, k_pos).unsqueeze(-1), (v * 0).sum(dim=-2, keepdim=True), out)


def silence_blind_rows(out, log_weights, q_pos, k_pos, bias=None) -> torch.Tensor:
    """``out`` (..., m, c), a layer's output, with the rows of queries that see no key of positive weight set to
    what zero heads give (docs/math.md section 2): the output projection's ``bias``, zeros for None. For
    adapters whose module has no such rule (an additive mask of finite values makes such a row the average of
    every key, later ones included)."""
    if log_weights is None and q_pos is None:
        return out
    silent = out.new_zeros(out.shape[-1]) if bias is None else bias.detach().to(out.dtype)
    return torch.where(dead_rows(log_weights, q_pos, k_pos).unsqueeze(-1), silent, out)


def dead_rows(log_weights, q_pos, k_pos) -> torch.Tensor:
    """Rows that see no key of positive weight, (..., m) or (..., 1), as :func:`meanfield.kernels.attention_probs`
    decides them, from O(m + n) reductions: q_pos_i below the first position of a key of positive weight. A NaN
    position or weight makes no row dead here (the guarded formula then decides: a NaN weight gives a NaN output,
    and a NaN position is reported by the output check of :func:`meanfield.kernels.attend`; with checks deferred, a
    NaN key position makes every row that sees no key NaN, where the guarded formula drops that key silently)."""
    seen = None if log_weights is None else log_weights != float("-inf")
    if q_pos is None:
        return ~seen.any(dim=-1, keepdim=True)
    # compared in the dtype torch compares q_pos and k_pos in (integer key positions against float queries:
    # float64 keeps integers above 2^24 that the default float32 would round)
    common = torch.promote_types(q_pos.dtype, k_pos.dtype)
    first = seen_positions(k_pos.to(common), seen)
    dead = q_pos.to(common) < first.amin(dim=-1, keepdim=True)
    # every weight zero: every row is dead, also a query at +inf (or the integer maximum), which no moved key is past
    return dead if seen is None else dead | ~seen.any(dim=-1, keepdim=True)


def seen_positions(k_pos, seen) -> torch.Tensor:
    """The key positions with those of keys of zero weight (``seen`` False) moved past every other (to the
    dtype's largest value): their minimum is the first position of a key of positive weight. ``seen`` None:
    ``k_pos`` as it is."""
    if seen is None:
        return k_pos
    last = math.inf if k_pos.is_floating_point() else torch.iinfo(k_pos.dtype).max
    return torch.where(seen, k_pos, torch.full((), last, dtype=k_pos.dtype, device=k_pos.device))


def tf32_on(t) -> bool:
    """Whether float32 matrix products on t's CUDA device may run in TF32 (read, never set: a process-wide switch)."""
    if t.device.type != "cuda":
        return False
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)   # the new interface (it reads either interface's setting)
    if precision is not None:
        return precision == "tf32"
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return True


def watched(kind: str, q: torch.Tensor, k: torch.Tensor):
    """What one pass of the kernel (``kind``: "attention", "VJP", "JVP") over ``q`` and ``k`` runs under:

    * from :data:`POLICY_ENTRIES` scores, its threads (:func:`particles.threads.one_call`, which leaves them to a
      framework entry point running around the pass);
    * from :data:`WATCHED_ENTRIES` scores, INFO lines of the logger ``meanfield.kernels`` while it runs, every 5 s
      (:func:`particles.progress.long_call`; a pass inside a watched one adds none).

    On a CPU only: an accelerator's pass returns once it is queued.
    """
    shape = q.shape   # (called on every pass: about 0.4 us in all for a small one)
    entries = shape[-2] * k.shape[-2]
    if len(shape) > 2:
        entries *= math.prod(shape[:-2])
    if entries < min(POLICY_ENTRIES, WATCHED_ENTRIES) or q.device.type != "cpu":
        # small passes, and an accelerator's, which returns once queued (its time is spent at the next sync):
        # neither CPU threads nor progress lines apply
        return _NOTHING
    threads = entries >= POLICY_ENTRIES and active_policy() is None
    watch = entries >= WATCHED_ENTRIES and _log.isEnabledFor(logging.INFO)
    if not (threads or watch):
        return _NOTHING
    return _pass(kind, q, k, entries if threads else None, watch)


@contextlib.contextmanager
def _pass(kind, q, k, entries, watch):
    with contextlib.ExitStack() as stack:
        if entries is not None:
            stack.enter_context(one_call(entries * SECONDS_PER_SCORE))
        if watch:
            m, n, batch = q.shape[-2], k.shape[-2], math.prod(q.shape[:-2])
            what = (f"{kind} of {m:,} queries x {n:,} keys{f' (x {batch} batch entries)' if batch > 1 else ''}, "
                    f"head size {q.shape[-1]}, {str(q.dtype).replace('torch.', '')} on {q.device.type}")
            stack.enter_context(long_call(_log, what))
        yield
