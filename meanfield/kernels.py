"""The attention kernel: weighted, optionally causal softmax attention in log-sum-exp form.

    out_i = sum_j softmax_j(<q_i, k_j> + log a_j + mask_ij) v_j,   mask_ij = -inf if s_j > t_i

with queries q (..., m, e), keys k (..., n, e), values v (..., n, c), log-weights log a (..., n)
(Measure.log_weights; None for uniform), query positions t (..., m) and key positions s (..., n)
for masked attention (docs/math.md section 2). For self-attention q = X A^T, k = X, v = X V^T, so
that <q_i, k_j> = <A x_i, x_j> = s_ij.

Every operator of the framework calls :func:`attend`. Three paths compute the same map:

* ``"dense"`` materializes the (m, n) score matrix; plain autograd; the ground truth.
* ``"stream"`` (:mod:`meanfield.streamed_attention`) works in tiles with an online softmax, memory
  O((m + n)(d + c) + block^2), with analytic streamed JVP / VJP (torch.func compatible); on CPU its
  forward pass and VJP run in torch's fused flash kernel where the mask allows.
* ``"fused"``: torch's ``scaled_dot_product_attention`` in its 4-D layout, positions of a sequence as
  ``is_causal``, log-weights as a broadcast mask row (forward passes; no forward-mode AD on CPU).
* ``"series"`` (:mod:`meanfield.series_attention`): the exponential of the centred scores as a truncated
  series of M monomial features, O((m + n) M) time, its truncation proved below the dtype's machine epsilon
  (relative to ``max |v_j|``); for narrow heads and bounded scores (the sphere models' tokens), no positions.

``method="auto"`` (the default) picks by regime (the map measured in benchmarks/README.md):

* derivatives needed (an input requires grad, a ``torch.func`` transform or a forward-AD level is
  active): dense up to :data:`STREAM_THRESHOLD` score entries (all batch entries; inside torch.func
  transforms :data:`TRANSFORM_STREAM_THRESHOLD`), streamed above;
* forward pass the fused kernel applies to (no positions, or the causal mask of a sequence; a dtype
  and device with a fused kernel): dense up to :data:`FUSED_THRESHOLD` entries, fused above;
* forward pass with other positions (arbitrary masks): dense, then fused with an explicit boolean
  (m, n) mask while that mask is small (:data:`MASKED_FUSED_RANGE`), streamed above (O(N) memory);
* forward pass without positions above :data:`SERIES_THRESHOLD` entries (:data:`SERIES_THRESHOLD_ACCELERATOR`
  on other devices, :data:`SERIES_THRESHOLD_SMALL_HEADS` for heads that run in the small-head Triton kernels there,
  :func:`small_kernels`) whose series certifies the dtype's machine epsilon with few enough features to cost at most
  :data:`meanfield.series_attention.COST_RATIO` of the dense pass (:func:`series_first`; one O(m + n) pass over q
  and k, a host sync on an accelerator): the series, before every rule above.

Force a path per call (``attend(..., method="stream", block_size=256)``) or for a block of code::

    with meanfield.kernels.use("stream", block_size=512):
        ...

``use(threshold=t)`` replaces both thresholds by t (dense up to t entries in every regime).

On other devices (CUDA) ``auto`` follows :mod:`meanfield.accelerator_paths` instead: dense while the
scores are small and fit the device's memory budget; above that, heads of at most 3 features in float32 or a half
type take the streamed kernel in the small-head Triton kernels for every pass (:func:`small_kernels`: 2.6-9x
faster than the alternatives on an H200); other heads take dense row blocks (:func:`rows_attend`) for float32
forward passes without a causal mask up to N of about 1e4, the fused kernel with the head zero-padded to a
multiple of 8 (never SDPA's math kernel, which would materialize the scores), and the streamed kernel
(Triton kernels, or tiles sized by the memory budget) for derivatives, arbitrary positions and float64.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import numbers
import warnings

import torch
from torch.autograd import forward_ad as _forward_ad

from particles import device as _device
from particles.validation import (
    broadcast_shapes,
    check_allocation,
    check_log_weight_floor,
    log_weight_clamp_matters,
    memory_limit,
    output_checks_are_deferred,
)

from . import accelerator_paths as _paths
from .kernel_inputs import check_shapes, needs_derivatives, tf32_on, transforms_active, watched, zero_blind_rows
from .streamed_attention import _vmapped_size, one_query_set, sequence_mask, shared_keys

__all__ = ["attend", "attention_probs", "additive_mask", "use", "choose", "record_paths", "fused_or_stream",
           "rows_attend", "STREAM_THRESHOLD",
           "TRANSFORM_STREAM_THRESHOLD", "FUSED_THRESHOLD", "MASKED_FUSED_RANGE", "METHODS", "SERIES_THRESHOLD",
           "SERIES_THRESHOLD_ACCELERATOR", "SERIES_THRESHOLD_SMALL_HEADS", "series_first", "series_by_default",
           "series_checked", "small_kernels", "default_path", "stream_checked"]

#: With ``method="auto"``, passes that need derivatives, or masks the fused kernel cannot take, stream above this many
#: score entries (all batch entries) and stay dense below
STREAM_THRESHOLD = 2**15
#: With ``method="auto"``, the same inside torch.func transforms, where the streamed derivatives take their
#: differentiable (slower) engine
TRANSFORM_STREAM_THRESHOLD = 2**16
#: With ``method="auto"``, forward passes the fused kernel applies to go fused above this many score entries
FUSED_THRESHOLD = 2**14
#: With ``method="auto"``, forward passes with arbitrary positions are dense up to the first bound, fused (with an
#: explicit boolean mask of at most 4 MiB) up to the second, streamed above
MASKED_FUSED_RANGE = (2**16, 2**22)
#: With ``method="auto"``, forward passes without positions consider the series above this many score entries on the
#: CPU (N of about 2048), where its cost model (:data:`~meanfield.series_attention.COST_RATIO`) then takes float32
#: sphere tokens (d = 3, M = 364) from there and float64 (M = 1330) from about 3800. Measured on 2 CPU cores since
#: the kernel sums' faster products (benchmarks/README.md): float32 2.1x faster than the fused kernel at 2000 and 3.9x
#: at 4000; float64 about even at 2000, 1.3x at 3000, 1.8x at 4000, 3.9x at 8000 (the floor was N of about 8200)
SERIES_THRESHOLD = 2**22
#: the same on other devices (N of about 32768). Measured on an H200 (2026-11-29, benchmarks/README.md, sphere tokens,
#: d = 3): the series took 2.8 ms at N = 1e4 and 1e5 and 12 ms at 1e6 in float32 (its launches: level up to 1e5),
#: against 1.1 ms, 64 ms and 6.1 s for the paths before it; 2.6, 10 and 90 ms in float64 against the streamed
#: kernel's 1.6 ms, 76 ms and 7.3 s
SERIES_THRESHOLD_ACCELERATOR = 2**30
#: the same for heads that run in the small-head Triton kernels (:func:`meanfield.accelerator_paths.small_kernels`),
#: N of about 38700. Measured on an H200 (2026-11-30, ``bench_series.py --device cuda --sizes 3e4 4e4 5e4 6e4
#: --dtypes float32``, sphere tokens, d = 3): auto's stream in those kernels against the series, 1.72 / 1.97 ms at
#: N = 3e4 (0.87x; 0.59x in a first run), 1.87 / 1.72 ms at 4e4 (1.09x), 2.26 / 1.68 ms at 5e4 (1.35x), 3.6 / 1.7 ms
#: at 6e4 (2.1x): the crossover lies between 3e4 and 4e4 (2^32, set from the 1e5 figure alone on 2026-11-29, kept
#: the slower path up to N = 65536)
SERIES_THRESHOLD_SMALL_HEADS = 1_500_000_000
#: heads wider than this never take the series in ``auto`` (their features outnumber the keys)
SERIES_MAX_HEAD = 6
log = logging.getLogger(__name__)
_LOGGED: set = set()


def _log_path(method, q, k, log_weights, q_pos) -> None:
    """The path auto took, once per kind of call (shapes, dtype, device, mask): what -v shows."""
    key = (method, tuple(q.shape), tuple(k.shape), q.dtype, q.device.type, log_weights is not None, q_pos is not None,
           torch.is_grad_enabled())
    if key in _LOGGED or len(_LOGGED) > 10_000:
        return
    _LOGGED.add(key)
    log.debug("attention kernel: auto takes the %s path for %d queries x %d keys, head size %d, %s on %s%s%s",
              method, q.shape[-2], k.shape[-2], q.shape[-1], str(q.dtype).replace("torch.", ""), q.device.type,
              ", weighted" if log_weights is not None else "", ", masked" if q_pos is not None else "")


METHODS = ("auto", "dense", "stream", "fused", "series")

_DEFAULTS = contextvars.ContextVar("meanfield_kernel_defaults", default=("auto", None, None))


def attention_probs(q, k, log_weights=None, q_pos=None, k_pos=None) -> torch.Tensor:
    """The row-stochastic matrix P_ij of weighted (causal) attention, shape (..., m, n).

    Rows whose every key is masked (a query placed before every key) are all zeros.
    """
    if (q_pos is None) != (k_pos is None):
        raise ValueError("q_pos, k_pos: give both positions (masked attention) or neither")
    scores = _scores(q, k, log_weights)
    # torch's softmax is the log-sum-exp softmax (it subtracts each row's maximum): one kernel, where
    # spelling it out took about ten, most of the cost of a call on a GPU at N = 1e3
    if q_pos is None and log_weights is None:
        return torch.softmax(scores, dim=-1)
    # keys a row can see: visible (positions) and of positive weight (a NaN log-weight counts, so that it
    # surfaces as NaN). A row that sees none (a query placed before every key, or only zero weights) would be
    # 0/0 in softmax, and so would its derivatives: its scores are replaced by zeros before, its
    # probabilities by zeros after. Decided from the mask and the weights, not from the scores: a row whose
    # scores all overflow to -inf stays NaN, and attend reports the overflow
    seen = None if log_weights is None else (log_weights != float("-inf")).unsqueeze(-2)
    if q_pos is not None:
        visible = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
        scores = scores.masked_fill(~visible, float("-inf"))
        seen = visible if seen is None else visible & seen
    dead = ~seen.any(dim=-1, keepdim=True)
    return torch.where(dead, 0.0, torch.softmax(torch.where(dead, 0.0, scores), dim=-1))


def _check_method(method):
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")


_RECORD = contextvars.ContextVar("meanfield_kernel_paths_run", default=None)


@contextlib.contextmanager
def record_paths():
    """The path every :func:`attend` call runs inside this context, in order: yields a list that receives
    "dense", "rows", "fused", "stream" or "series" per call (on an accelerator, "fused" only where SDPA found a fused
    kernel, "stream" where the call fell back). What ran, not what :func:`choose` predicts: a study that
    checks a path against the dense kernel can tell that the path was taken. Nested contexts each record
    their own calls (the innermost one)."""
    paths: list[str] = []
    token = _RECORD.set(paths)
    try:
        yield paths
    finally:
        _RECORD.reset(token)


def _ran(path: str) -> None:
    paths = _RECORD.get()
    if paths is not None:
        paths.append(path)


@contextlib.contextmanager
def use(method="auto", *, block_size=None, threshold=None):
    """Set the default path of :func:`attend` inside a ``with`` block (per thread / task).

    ``method`` is "auto", "dense", "stream", "fused" or "series"; ``block_size`` the tile edge of the
    streaming path (int or (block_q, block_k)); ``threshold`` the size (entries of the score
    matrix) up to which auto stays dense in every regime (None: :data:`FUSED_THRESHOLD` for fused
    forward passes, :data:`STREAM_THRESHOLD` otherwise). An explicit ``method=`` / ``block_size=``
    given to :func:`attend` wins.
    """
    _check_method(method)
    if threshold is not None:
        if not isinstance(threshold, numbers.Integral) or isinstance(threshold, bool) or threshold < 0:
            raise ValueError(f"threshold: expected a non-negative int, got {threshold!r}")
        threshold = int(threshold)
    if block_size is not None:
        from .streamed_attention import _check_block

        block_size = _check_block(_check_block_size(block_size))
    token = _DEFAULTS.set((method, block_size, threshold))
    try:
        yield
    finally:
        _DEFAULTS.reset(token)


def _score_entries(q, k, log_weights, q_pos, k_pos) -> int:
    """Entries of the (..., m, n) score matrix over all batch entries, those of ``torch.func.vmap`` included
    (``meanfield.streamed_attention._vmapped_size``): what the dense path allocates and the path choice weighs."""
    lead = q.shape[:-2]
    others = [k.shape[:-2]] + [t.shape[:-1] for t in (log_weights, q_pos, k_pos) if t is not None]
    if all(s == lead for s in others):  # the common case, without broadcast_shapes' cost
        entries = math.prod(lead) * q.shape[-2] * k.shape[-2]
    else:
        entries = broadcast_shapes(lead, *others).numel() * q.shape[-2] * k.shape[-2]
    if transforms_active():
        entries *= _vmapped_size(q, k, log_weights, q_pos, k_pos)
    return entries


def _check_block_size(block_size):
    """None, a positive int or a pair of them (the streamed tiles' edges); TypeError / ValueError naming it."""
    if block_size is None:
        return None
    pair = (block_size, block_size) if not isinstance(block_size, (tuple, list)) else tuple(block_size)
    if len(pair) != 2 or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in pair):
        raise TypeError(f"block_size: expected a positive int or a pair (block_q, block_k) of them, "
                        f"got {block_size!r}")
    if not all(b >= 1 for b in pair):
        raise ValueError(f"block_size: expected positive tile edges, got {block_size!r}")
    return block_size


#: dense allocations below this many bytes are never refused (the guard then costs one multiplication)
DENSE_ALWAYS_ALLOWED = 2**20


def _check_dense_memory(q, k, log_weights, q_pos, k_pos, entries=None) -> None:
    """The memory guard of the dense path: its (..., m, n) matrices, before they are allocated (``entries``:
    :func:`_score_entries` when the caller has it)."""
    if entries is None:
        entries = _score_entries(q, k, log_weights, q_pos, k_pos)
    nbytes = _paths.dense_bytes(entries, q.dtype.itemsize)   # its peak, forward and backward
    if nbytes <= DENSE_ALWAYS_ALLOWED:
        return
    if nbytes > memory_limit():   # the message is built only when it is needed
        check_allocation(nbytes, f"attend(method='dense'): {entries} score entries (m = {q.shape[-2]} queries, "
                         f"n = {k.shape[-2]} keys)", "use method='stream' (tiles, O(m + n) memory) or 'auto' "
                         "(with kernels.use(threshold=...) no larger than the memory allows)")


#: dtypes whose weighted scores take one ``addmm`` (:func:`_scores`): in the half types its single rounding differs
#: from the product-and-sum of batched inputs by an ulp or two, which would break the agreement of a batch with its
#: members (a review of 2026-11-30)
_ADDMM_DTYPES = (torch.float32, torch.float64)


def _autocast_on(device_type: str) -> bool:
    """Whether torch.autocast is on for ``device_type`` (True where torch cannot say: the meta device)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return True


def _scores(q, k, log_weights) -> torch.Tensor:
    """The (..., m, n) scores <q_i, k_j> + log a_j. One sequence with its weights in float32 or float64 in one ``addmm``
    (the weights as the product's bias: one kernel and one (m, n) pass less than the product and a sum; on one CPU
    thread 5.5 against 11 us at N = 8 and 0.36 against 0.45 ms at N = 1e3, d = 3); every other case as a product and
    a sum, autocast included (it would run the addmm, bias and all, in a half type: log-weights of -1e5 overflow
    float16, where the sum kept them in float32)."""
    if log_weights is None:
        return q @ k.transpose(-1, -2)
    if (q.dim() == 2 and k.dim() == 2 and log_weights.dim() == 1 and q.dtype in _ADDMM_DTYPES
            and log_weights.dtype == q.dtype == k.dtype and not _autocast_on(q.device.type)):
        return torch.addmm(log_weights, q, k.transpose(-1, -2))
    return q @ k.transpose(-1, -2) + log_weights.unsqueeze(-2)


def _plain_probs(q, k, log_weights, q_pos, k_pos) -> torch.Tensor:
    """softmax_j(<q_i, k_j> + log a_j, masked where s_j > t_i): :func:`attention_probs` without its guard of rows
    that see no key of positive weight (NaN here, zeros there); equal to it on every other row."""
    scores = _scores(q, k, log_weights)
    if q_pos is not None:
        scores = torch.where(k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1), scores, float("-inf"))
    return torch.softmax(scores, dim=-1)


def _checks_skipped() -> bool:
    """Whether :func:`_check_output` checks nothing here (torch.func transforms, forward-mode AD, or a caller
    that checks its own results)."""
    return transforms_active() or _forward_ad._current_level >= 0 or output_checks_are_deferred()


def _position_sum(q_pos, k_pos):
    """The sum of the floating positions (a 0-dim tensor; None without floating positions), folded into the finite
    check of the output (:func:`_check_output`, :func:`_plain_first`): NaN when a position is NaN, which the
    mask s_j > t_i would otherwise take silently (a NaN compares false: a query at a NaN position sees no key
    and gets a zero row, a key at a NaN position is dropped). Two O(m + n) reductions, no host sync of their own.
    Integer positions cannot be NaN; one tensor given as both (self-attention's positions) is summed once. An
    infinite position (allowed) or a sum that overflows makes the sum infinite: the check then looks entry by
    entry (:func:`_check_positions`) and lets it pass."""
    total = None
    for t in (q_pos, None if k_pos is q_pos else k_pos):
        if t is not None and t.is_floating_point():
            part = t.detach().sum()
            total = part if total is None else total + part
    return total


def _check_positions(q_pos, k_pos) -> None:
    """FloatingPointError naming the position argument that holds a NaN (:func:`_position_sum`)."""
    for name, t, fate in (("q_pos", q_pos, "a query at a NaN position sees no key (its row would silently be 0)"),
                          ("k_pos", k_pos, "a key at a NaN position is visible to no query (it would silently be "
                                           "dropped)")):
        if t is not None and t.is_floating_point() and bool(torch.isnan(t.detach()).any()):
            raise FloatingPointError(f"{name}: contains NaN entries; {fate}. Give every position a number")


def _nan_when_deferred(out, q_pos, k_pos):
    """``out``, or NaN everywhere where a position is NaN, inside :func:`particles.validation.output_checks_deferred`
    (outside torch.func transforms), for the streamed kernel: its tiles skip the key ranges a block's positions cannot
    see, over every batch entry at once, and a NaN position makes every such comparison false, so the whole output,
    every batch entry's, came back wrong (zeros) without a NaN for a caller that checks its own results (a review of
    2026-11-29). Two O(m + n) reductions, only for floating positions; the check outside the mode names the argument
    (:func:`_check_positions`)."""
    if not output_checks_are_deferred() or transforms_active():
        return out
    bad = None
    for t in (q_pos, None if k_pos is q_pos else k_pos):
        if t is not None and t.is_floating_point():
            part = torch.isnan(t.detach()).any()
            bad = part if bad is None else bad | part
    return out if bad is None else torch.where(bad, math.nan, out)


def _clamp_matters(log_weights):
    """A 0-d bool tensor, whether clamping the log-weights at the kernels' zero-mass value would change a result
    (:func:`particles.validation.log_weight_clamp_matters`: a Measure refuses such weights, a direct call is checked
    here): it makes the output check's one sum NaN (:func:`_sum_is_finite`; no host sync of its own); None without
    weights or in float16."""
    return None if log_weights is None else log_weight_clamp_matters(log_weights.detach())


def _sum_is_finite(total, clamp, log_weights, first=None) -> bool:
    """Whether an output check's one sum ``total``, made NaN where ``clamp`` holds (:func:`_clamp_matters`, or
    None), is finite: one host sync. Where it is not, ``first()`` (the caller's diagnosis that comes first) runs,
    then the ValueError naming log-weights the kernels would clamp, if that is the cause; False otherwise."""
    if clamp is not None:
        total = total.masked_fill(clamp, math.nan)   # one operation (a where and a sum before)
    if math.isfinite(float(total)):
        return True
    if first is not None:
        first()
    if clamp is not None:
        check_log_weight_floor(log_weights.detach())
    return False


def _check_output(out, q, k, v, log_weights, *, queries: bool = False, q_pos=None, k_pos=None) -> torch.Tensor:
    """A NaN or infinite output, or a NaN position, names its cause instead of being returned. One reduction, the
    sum of the output (NaN or infinite when an entry is; plus the sum of the queries with ``queries=True``: the
    streamed and fused paths turn a NaN query's row into zeros; plus the sums of floating positions,
    :func:`_position_sum`), one host sync; the entry-wise check only when that sum is not finite. None inside
    torch.func transforms, whose callers check their own results."""
    if _checks_skipped():
        return out
    total = out.detach().sum()
    if queries:
        total = total + q.detach().sum()
    positions = _position_sum(q_pos, k_pos)
    if positions is not None:
        total = total + positions
    if _sum_is_finite(total, _clamp_matters(log_weights), log_weights, lambda: _check_positions(q_pos, k_pos)):
        return out
    if bool(torch.isfinite(out.detach()).all()) and not (queries and not bool(torch.isfinite(q.detach()).all())):
        return out   # finite entries whose sum overflows
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not bool(torch.isfinite(t.detach()).all()):
            raise FloatingPointError(f"{name}: contains NaN or infinite entries, so the attention output is not finite "
                                     f"(an input that holds them, or a product computing {name} that overflows "
                                     f"{t.dtype})")
    if log_weights is not None and bool((torch.isnan(log_weights) | (log_weights == math.inf)).any()):
        raise FloatingPointError("log_weights: contains NaN or +inf (-inf, a zero weight, is the only infinity "
                                 "allowed), so the attention output is not finite")
    fix = "smaller inputs" if q.dtype == torch.float64 else "float64 or smaller inputs"
    raise FloatingPointError(f"attend: the output is not finite: the scores <q_i, k_j> (or the sums of the values v) "
                             f"overflow {q.dtype} at these inputs (beyond the dtype's range); use {fix}")


#: (device type, dtypes) where scaled_dot_product_attention has a fused kernel (CUDA float64 runs the
#: math backend, which materializes the scores)
_FUSED_DTYPES = {
    "cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
    "cuda": (torch.float32, torch.bfloat16, torch.float16),
}


def choose(q, k, v, log_weights=None, q_pos=None, k_pos=None, *, threshold=None) -> str:
    """The path "auto" takes for these inputs: "dense", "fused", "stream" or "series" (module docstring); on an
    accelerator also "rows" (:func:`rows_attend`).

    Reads the positions once to recognise a sequence's causal mask (a host sync on an accelerator).
    """
    if threshold is None:
        threshold = _DEFAULTS.get()[2]
    if shared_keys(q, k, v, log_weights, q_pos):
        # as attend: keys shared by the whole batch are one set of b x m queries
        q, k, v, log_weights = one_query_set(q, k, v, log_weights)[0]
    return _choose(q, k, v, log_weights, q_pos, k_pos, threshold)[0]


def _choose(q, k, v, log_weights, q_pos, k_pos, threshold, entries=None):
    """(path, causal): causal is True when the positions were read and form a sequence's causal mask,
    None when they were not read. ``entries``: :func:`_score_entries` when the caller has it."""
    if entries is None:
        entries = _score_entries(q, k, log_weights, q_pos, k_pos)
    if series_first(q, k, v, log_weights, q_pos, threshold, entries):
        return "series", None
    if q.device.type != "cpu":
        return _choose_accelerator(q, k, v, log_weights, q_pos, k_pos, threshold, entries)
    if threshold is not None:
        fused_at = stream_at = threshold
    else:
        fused_at, stream_at = FUSED_THRESHOLD, STREAM_THRESHOLD
    if entries <= min(fused_at, stream_at):
        return "dense", None
    if needs_derivatives(q, k, v, log_weights):
        if threshold is None and transforms_active():
            stream_at = TRANSFORM_STREAM_THRESHOLD
        return ("dense" if entries <= stream_at else "stream"), None
    if q.dtype not in _FUSED_DTYPES.get(q.device.type, ()):
        return ("dense" if entries <= stream_at else "stream"), None
    if q_pos is not None and not (q.shape[-2] == k.shape[-2] and sequence_mask(q_pos, k_pos)):
        # other positions: the fused kernel needs an explicit (m, n) boolean mask; worth it only in a
        # window where that mask is small (at most MASKED_FUSED_RANGE[1] bytes)
        if threshold is None and MASKED_FUSED_RANGE[0] < entries <= MASKED_FUSED_RANGE[1]:
            return "fused", False
        return ("dense" if entries <= (MASKED_FUSED_RANGE[0] if threshold is None else threshold) else "stream"), False
    return ("dense" if entries <= fused_at else "fused"), q_pos is not None


def series_first(q, k, v, log_weights=None, q_pos=None, threshold=None, entries=None) -> bool:
    """Whether ``auto`` takes the series (:mod:`meanfield.series_attention`): a forward pass (no derivatives) without
    positions, above :data:`SERIES_THRESHOLD` score entries (:data:`SERIES_THRESHOLD_ACCELERATOR` off the CPU,
    :data:`SERIES_THRESHOLD_SMALL_HEADS` for heads in the small-head Triton kernels there; and above ``threshold``,
    :func:`use`'s), a head of at most ``SERIES_MAX_HEAD`` features, whose
    :func:`~meanfield.series_attention.plan` certifies the dtype's machine epsilon at a cost (its multiply-adds,
    :func:`~meanfield.series_attention.cost`) of at most :data:`~meanfield.series_attention.COST_RATIO` of the dense
    pass's. The plan reads ``max |q|`` and ``max |k - c|`` (one O(m + n) pass; a host sync on an accelerator), only once
    every other condition holds."""
    if q_pos is not None or q.shape[-1] > SERIES_MAX_HEAD:
        return False
    if entries is None:
        entries = _score_entries(q, k, log_weights, q_pos, None)
    if q.device.type == "cpu":
        floor = SERIES_THRESHOLD
    elif entries <= min(SERIES_THRESHOLD_SMALL_HEADS, SERIES_THRESHOLD_ACCELERATOR):
        return False   # below both floors: whether the head is small is not asked (most of a small call's routing)
    else:
        floor = SERIES_THRESHOLD_SMALL_HEADS if small_kernels(q, v) else SERIES_THRESHOLD_ACCELERATOR
    if entries <= max(floor, threshold or 0) or needs_derivatives(q, k, v, log_weights):
        return False
    from . import series_attention as series

    m, n = q.shape[-2], k.shape[-2]
    batch = entries // max(1, m * n)
    dense = series.dense_cost(entries, q.shape[-1], v.shape[-1])
    if series.cost(batch, m, n, q.shape[-1], v.shape[-1], 0) > series.COST_RATIO * dense:
        return False   # not even the constant term pays
    plan = series.plan(q, k, log_weights)
    return plan is not None and series.cost(batch, m, n, q.shape[-1], v.shape[-1], plan.degree) <= \
        series.COST_RATIO * dense


def series_by_default(q, k, v, log_weights=None, q_pos=None) -> bool:
    """Whether :func:`attend` called without ``method`` takes the series here: the default path (:func:`use`) is
    "auto" and :func:`series_first` holds with its threshold. :func:`default_path` gives the whole choice (the
    unnormalized field of :class:`meanfield.IsotropicAttention` asks it, for the row log-sums of the series or of the
    streamed kernel)."""
    method, _, threshold = _DEFAULTS.get()
    return method == "auto" and series_first(q, k, v, log_weights, q_pos, threshold)


def default_path(q, k, v, log_weights=None, q_pos=None, k_pos=None) -> str:
    """The method :func:`attend` called without ``method`` takes here: :func:`use`'s default, or with "auto" the path
    it chooses (:func:`choose`). For callers that need the row log-sums too, which the series
    (:func:`series_checked`) and the streamed kernel (:func:`stream_checked`) give with the average: the unnormalized
    field of :class:`meanfield.IsotropicAttention` then costs one pass instead of two, and one choice (the series'
    plan, a host sync on an accelerator, is read once). Such a caller records "stream" where :func:`choose` says
    "fused" (on a CPU the same flash kernel; under ``use("fused")`` it no longer goes through SDPA, so forward-mode
    derivatives work there too)."""
    method = _DEFAULTS.get()[0]
    return method if method != "auto" else choose(q, k, v, log_weights, q_pos, k_pos)


def _streamed(q, k, v, log_weights, q_pos, k_pos, block_size):
    """(out, the row log-sums) of the streamed kernel as :func:`attend`'s stream path runs it: recorded by
    :func:`record_paths`, a NaN position made visible inside output checks deferred (:func:`_nan_when_deferred`), the
    output checked."""
    from . import streamed_attention as streaming

    _ran("stream")
    out, lse = streaming.stream_attend(q, k, v, log_weights, q_pos, k_pos, block_size=block_size, return_lse=True)
    out = _nan_when_deferred(out, q_pos, k_pos)
    return _check_output(out, q, k, v, log_weights, queries=True, q_pos=q_pos, k_pos=k_pos), lse


def stream_checked(q, k, v, log_weights=None, q_pos=None, k_pos=None):
    """(out, the row log-sums L_i = log sum_j exp(<q_i, k_j> + log a_j) over visible keys, -inf for a row that sees
    none) from one pass of the streamed kernel (:func:`meanfield.streamed_attention.stream_attend`; on a CPU its flash
    kernel where the mask allows, the kernel of the fused path), as :func:`attend` runs its stream path, under its
    thread policy. Differentiable in both outputs."""
    check_shapes(q, k, v, log_weights, q_pos, k_pos)
    with watched("attention", q, k):
        return _streamed(q, k, v, log_weights, q_pos, k_pos, _DEFAULTS.get()[1])


def series_checked(q, k, v, log_weights=None, *, lse=False):
    """The series path as :func:`attend` runs it (recorded by :func:`record_paths`, its output checked); with
    ``lse``, (out, the row log-sums) of :func:`meanfield.series_attention.series_attend`."""
    from .series_attention import series_attend

    _ran("series")
    res = series_attend(q, k, v, log_weights, lse=lse)
    out = _check_output(res[0] if lse else res, q, k, v, log_weights, queries=True)
    return (out, res[1]) if lse else out


def small_kernels(q, v) -> bool:
    """Whether an ``auto`` call of these queries and values runs in the small-head Triton kernels on their device
    (:func:`meanfield.accelerator_paths.small_kernels`: an accelerator where Triton runs, a head of at most 3
    features in float32 or a half type, no ``torch.func`` transform)."""
    if q.device.type == "cpu":
        return False
    return _paths.small_kernels(q.device.type, q.dtype, q.shape[-1], v.shape[-1],
                                triton=_device.triton_runs(q.device.type), transforms=transforms_active())


def _choose_accelerator(q, k, v, log_weights, q_pos, k_pos, threshold, entries=None):
    """(path, causal) on a device other than the CPU: :func:`meanfield.accelerator_paths.choose` with the
    device's memory budget; reads the positions once (a host sync) to recognise a sequence's causal mask, where
    the path depends on it (not for the dense path, nor for derivatives: then causal is None)."""
    if entries is None:
        entries = _score_entries(q, k, log_weights, q_pos, k_pos)
    transforms = transforms_active()
    derivatives = needs_derivatives(q, k, v, log_weights)
    device_type, m, n = q.device.type, q.shape[-2], k.shape[-2]
    # each read once, and only where the choice needs it: the budget where a dense path is considered, whether the
    # head runs in the small-head kernels above the dense path
    need = _paths.dense_bytes(entries, q.dtype.itemsize)
    budget = functools.cache(lambda: _device.memory_budget(q.device, need=need))
    small = functools.cache(lambda: small_kernels(q, v))

    def choose(positions):
        return _paths.choose(device_type, q.dtype, entries // max(1, m * n), m, n, q.shape[-1], v.shape[-1],
                             weighted=log_weights is not None, positions=positions, derivatives=derivatives,
                             transforms=transforms, budget=budget, threshold=threshold, small_kernels=small)

    if q_pos is None:
        return choose("none"), None
    path = choose("other")
    if q.shape[-2] != k.shape[-2] or path == choose("causal"):
        # the path does not depend on the kind of mask (the dense path, derivatives): the positions are not
        # read (one host sync less on a small call)
        return path, None
    causal = sequence_mask(q_pos, k_pos)
    return (choose("causal") if causal else path), causal


def rows_attend(q, k, v, log_weights=None, q_pos=None, k_pos=None, *, rows=None) -> torch.Tensor:
    """The "rows" path of ``auto`` on an accelerator: the dense kernel on blocks of ``rows`` queries against all
    keys (:func:`meanfield.accelerator_paths.row_block` by default), torch's softmax on each block; memory
    O(block x n). The plain softmax first, :func:`attention_probs`'s guard of rows without a visible key of
    positive weight only where the output is not finite (as the dense path). Results equal the dense path's."""
    from .accelerator_paths import row_block

    m = q.shape[-2]
    batch = _score_entries(q, k, log_weights, q_pos, k_pos) // max(1, m * k.shape[-2])
    step = row_block(batch, k.shape[-2]) if rows is None else max(1, int(rows))

    def blocks(probs):
        out = []
        for i in range(0, m, step) or (0,):   # one (empty) block when there are no queries
            qp = None if q_pos is None else q_pos[..., i:i + step]
            out.append(probs(q[..., i:i + step, :], k, log_weights, qp, k_pos) @ v)
        return out[0] if len(out) == 1 else torch.cat(out, dim=-2)

    return _plain_first(blocks, q, k, v, log_weights, q_pos, k_pos)


def _plain_first(compute, q, k, v, log_weights, q_pos, k_pos) -> torch.Tensor:
    """``compute(probs)``, the output of the dense kernel with the probabilities ``probs`` gives, checked.

    With weights or positions the plain softmax first (as naive attention: about half the kernels of
    :func:`attention_probs`, which is most of a small call's cost on a GPU): it differs from attention_probs
    only on rows with no visible key of positive weight, which it leaves NaN, so a finite output (the sum the
    output check computes anyway) is the exact result; attention_probs's guarded formula otherwise. Inside
    :func:`particles.validation.output_checks_deferred` a forward pass sets those rows from
    :func:`~meanfield.kernel_inputs.dead_rows` at once (no sum, no host sync; a NaN query position then gives a NaN
    row, which the caller's check meets, where
    the guarded formula would give a silent zero row), after reading the plain output's sum where that costs less
    (:func:`_sum_first`: on the CPU, and for small calls on an accelerator); and so does a checked forward pass
    whose queries have positions of their own (``q_pos`` not ``k_pos``: about half of random queries see no key),
    checked once."""
    if log_weights is None and q_pos is None:
        return _check_output(compute(attention_probs), q, k, v, log_weights, q_pos=q_pos, k_pos=k_pos)
    forward = not needs_derivatives(q, k, v, log_weights)
    deferred = output_checks_are_deferred()
    if forward and deferred:
        # for a caller that checks its own results (simulate): the rows that see no key of positive weight set at
        # once, from O(m + n) reductions, to what the guarded formula gives them, 0 @ v (zeros; NaN in the columns
        # where v holds a NaN or an infinity): about half the (m, n) passes of attention_probs, no host sync. Where
        # reading one sum costs less than those reductions' launches (:func:`_sum_first`), a finite plain output is
        # returned as it is
        out = compute(_plain_probs)
        if _sum_first(q, k, q_pos, k_pos) and math.isfinite(float(out.detach().sum())):
            return out
        return zero_blind_rows(out, v, log_weights, q_pos, k_pos)
    # a NaN key position is masked for every query (dropped, the output finite): its sum rides in the output's
    # check (:func:`_position_sum`; not needed when the keys' positions are the queries': their NaN also makes a
    # query's row NaN). A NaN query position masks every key of its row, which the plain softmax makes NaN
    positions = None if k_pos is q_pos or deferred else _position_sum(None, k_pos)
    # log-weights the fused and streamed paths would clamp to one value: refused on every path alike (same sum)
    clamp = None if deferred or _checks_skipped() else _clamp_matters(log_weights)
    if forward and positions is not None:
        # queries with positions of their own (half of random queries see no key): their rows set as above, then
        # one sum and one host sync
        out = zero_blind_rows(compute(_plain_probs), v, log_weights, q_pos, k_pos)
        if _sum_is_finite(out.detach().sum() + positions, clamp, log_weights):
            return out
    elif not _checks_skipped():
        # the plain softmax first: a finite output (the sum the output check computes anyway) is the exact result
        out = compute(_plain_probs)
        total = out.detach().sum()
        if positions is not None:
            total = total + positions
        if _sum_is_finite(total, clamp, log_weights):
            return out
        if forward:
            # the rows that see no key of positive weight (a query before every key) are attention_probs's zero
            # rows; set them, instead of computing every row again. One more sum and host sync (the rows are 0 @ v
            # in the guarded formula: NaN where v holds a NaN or an infinity, reported below)
            # (no key positions of their own here: those take the branch above)
            out = zero_blind_rows(out, v, log_weights, q_pos, k_pos)
            if math.isfinite(float(out.detach().sum())):
                return out
    # the plain pass released before the guarded one: with derivatives its graph holds score-sized tensors
    # (a peak of 4.5-5 score matrices instead of 3.5)
    out = total = None
    return _check_output(compute(attention_probs), q, k, v, log_weights, q_pos=q_pos, k_pos=k_pos)


#: score entries up to which a deferred dense pass on an accelerator reads one sum first (one host sync) instead of
#: launching the reductions that set the rows that see no key (5 kernels): measured on an H200 at N = 1e3, d = 3,
#: weighted, a checked call (the sum read) took 210 us, a deferred one (the reductions) 311 us; naive dense 90 us
SUM_FIRST_ENTRIES = 2**21


def _sum_first(q, k, q_pos, k_pos) -> bool:
    """Whether a deferred forward pass reads the sum of its plain output first (returned as it is when finite): on
    the CPU always (reading a sum is no host sync there); on an accelerator for a call bound by its launches (at
    most :data:`SUM_FIRST_ENTRIES` score entries) whose queries see their own keys (no positions, or the keys'
    positions given as the queries', where a row that sees no key needs every weight before it zero), not for
    queries with positions of their own, about half of which see no key (the sum would be NaN)."""
    if q.device.type == "cpu":
        return True
    if k_pos is not q_pos:
        return False
    batch = math.prod(broadcast_shapes(q.shape[:-2], k.shape[:-2]))   # (a batch may sit on the keys alone)
    return batch * q.shape[-2] * k.shape[-2] <= SUM_FIRST_ENTRIES


_TF32_WARNED = []


def _warn_tf32(q) -> None:
    """Warn once per process where float32 matrix products on q's CUDA device may run in TF32 (the process-wide
    switch, read and never set). The Triton kernels and the series path keep IEEE products whatever it says; the
    dense, row-block, tile and SDPA paths follow it, and their scores <q_i, k_j> then carry a relative error of
    about 5e-4: an error of about 5 in the exponent at |s| = 1e4 (radius 100)."""
    if _TF32_WARNED:
        return
    if tf32_on(q):
        _TF32_WARNED.append(True)
        warnings.warn("attend: float32 matrix products on CUDA run in TF32 (torch.backends.cuda.matmul is set so): "
                      "attention scores carry a relative error of about 5e-4, which large radii turn into large "
                      "errors of the probabilities and of certified constants; use float64, or switch TF32 off "
                      "(torch.backends.cuda.matmul.fp32_precision = 'ieee')", RuntimeWarning, stacklevel=3)


def attend(q, k, v, log_weights=None, q_pos=None, k_pos=None, *, method=None, block_size=None) -> torch.Tensor:
    """sum_j P_ij v_j with P from :func:`attention_probs`; shape (..., m, c).

    ``method``: "dense" (materialize P), "stream" (tiles of ``block_size``, O(N) memory), "series" (the truncated
    exponential series of :mod:`meanfield.series_attention`: no positions; a ValueError where its bound cannot
    reach the dtype's machine epsilon, ``r = max |q| max |k - c|`` above about 2), "fused"
    (torch's scaled_dot_product_attention, for forward passes: its derivatives are SDPA's, whose fused CPU
    kernels have neither forward mode nor a double backward; "auto" never takes it where derivatives are
    needed), or "auto" (:func:`choose`: the fastest path for the size,
    mask, dtype, device and whether derivatives are needed); None takes the default set by :func:`use`.

    On a CPU, a pass over 1024 x 1024 scores or more (:data:`meanfield.kernel_inputs.POLICY_ENTRIES`), and its VJP
    and JVP where the streamed kernel computes them, take their threads from the free cores unless a framework
    entry point around them decides, and log what they are and the seconds spent while they run, every 5 s at
    INFO on the logger ``meanfield.kernels`` (:func:`meanfield.kernel_inputs.watched`; minutes at 1e5 tokens).
    """
    check_shapes(q, k, v, log_weights, q_pos, k_pos)
    _check_block_size(block_size)
    if q.dtype == torch.float32 and q.device.type == "cuda":
        _warn_tf32(q)
    if shared_keys(q, k, v, log_weights, q_pos):
        # keys, values and weights shared by the whole batch, no positions: one set of b x m queries (the same
        # scores and outputs; the paths then never expand the keys over the batch, which copied them b times)
        args, lead = one_query_set(q, k, v, log_weights)
        out = attend(*args, method=method, block_size=block_size)
        return out.reshape(*lead, q.shape[-2], out.shape[-1])
    with watched("attention", q, k):   # a pass of minutes (1e5 tokens on CPU) logs while it runs
        return _attend(q, k, v, log_weights, q_pos, k_pos, method, block_size)


def _attend(q, k, v, log_weights, q_pos, k_pos, method, block_size) -> torch.Tensor:
    """:func:`attend` on checked inputs whose keys are not shared by a batch of queries: the path's choice and call."""
    default_method, default_block, threshold = _DEFAULTS.get()
    method = default_method if method is None else method
    causal = entries = None
    if method == "auto":
        entries = _score_entries(q, k, log_weights, q_pos, k_pos)
        method, causal = _choose(q, k, v, log_weights, q_pos, k_pos, threshold, entries)
        if log.isEnabledFor(logging.DEBUG):
            _log_path(method, q, k, log_weights, q_pos)
        if method == "fused" and q.device.type != "cpu":
            # checked as every other path (one sum, one host sync: about 10 us against the 1.4 ms of a fused
            # call at N = 1e4 on an H200): a NaN input or position would otherwise come back silently
            return _check_output(fused_or_stream(q, k, v, log_weights, q_pos, k_pos, causal=causal), q, k, v,
                                 log_weights, queries=True, q_pos=q_pos, k_pos=k_pos)
        if method == "rows":
            _ran("rows")
            return rows_attend(q, k, v, log_weights, q_pos, k_pos)
    elif method not in METHODS:
        _check_method(method)
    if method == "series":
        if q_pos is not None:
            raise ValueError("method: 'series' takes no positions (a mask does not factor through the series' "
                             "features); use 'auto', 'stream' or 'dense'")
        return series_checked(q, k, v, log_weights)
    if method != "stream":   # the stream path records below, fused_or_stream where it ran
        _ran(method)
    if method == "dense":
        _check_dense_memory(q, k, log_weights, q_pos, k_pos, entries)
        return _plain_first(lambda probs: probs(q, k, log_weights, q_pos, k_pos) @ v, q, k, v, log_weights, q_pos,
                           k_pos)
    from . import streamed_attention as streaming

    if method == "fused":
        # CUDA's fused kernels take heads of a multiple of 8 (zero-padded; scores and outputs unchanged)
        return _check_output(streaming.fused_attend(q, k, v, log_weights, q_pos, k_pos, causal=causal,
                                                    align=8 if q.device.type == "cuda" else 1),
                             q, k, v, log_weights, queries=True, q_pos=q_pos, k_pos=k_pos)
    return _streamed(q, k, v, log_weights, q_pos, k_pos, default_block if block_size is None else block_size)[0]


def additive_mask(m, n, log_weights, q_pos, k_pos, dtype, device):
    """The (..., m, n) additive score mask log a_j (+ a very negative number where s_j > t_i), or None.

    Masked entries get the dtype's most negative finite value, as Hugging Face's eager attention
    does, so that no softmax row is all -inf (every query sees at least one key in a valid measure).
    """
    if log_weights is None and q_pos is None:
        return None
    low = torch.finfo(dtype).min
    mask = torch.zeros(m, n, dtype=dtype, device=device)
    if log_weights is not None:
        lw = log_weights.to(dtype)
        mask = mask + torch.where(torch.isfinite(lw), lw, torch.full_like(lw, low)).unsqueeze(-2)
    if q_pos is not None:
        visible = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
        mask = torch.where(visible, mask, torch.full_like(mask, low))
    return mask


def fused_or_stream(q, k, v, log_weights=None, q_pos=None, k_pos=None, *, causal=None):
    """SDPA on an accelerator with its math kernel excluded; streamed where no fused kernel takes the call.

    ``auto`` chose SDPA because a fused kernel should take these inputs
    (:func:`meanfield.accelerator_paths.choose`); torch decides
    at run time (architecture, alignment, its own limits), and a math fallback would materialize the
    scores, so it is excluded here and the call streams instead (O(N) memory) if torch finds no kernel.
    """
    import warnings

    from . import accelerator_paths
    from . import streamed_attention as streaming

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3: no way to exclude the math kernel
        _ran("stream")
        return streaming.stream_attend(q, k, v, log_weights, q_pos, k_pos)
    backends = [b for b in (getattr(SDPBackend, name, None) for name in
                            ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")) if b is not None]
    try:
        with warnings.catch_warnings(), sdpa_kernel(backends):
            # torch warns once per backend that does not apply before raising: the fallback below says it all
            warnings.simplefilter("ignore", UserWarning)
            out = streaming.fused_attend(q, k, v, log_weights, q_pos, k_pos, causal=causal,
                                         align=accelerator_paths.FUSED_ALIGN)
        _ran("fused")
        return out
    except RuntimeError as exc:
        if "No available kernel" not in str(exc):
            raise
    _ran("stream")
    return streaming.stream_attend(q, k, v, log_weights, q_pos, k_pos)
