"""Attention of bounded scores as a truncated exponential series: O((m + n) M) time and memory O(m + n + M)
instead of O(m n), exact to a proved bound (docs/math.md section 2.5).

Softmax weights do not change when a constant is added to every score of a row, so keys may be centred:
<q_i, k_j> and <q_i, k_j - c> give the same attention. With ``r = max_i |q_i| max_j |k_j - c|`` every centred score
lies in [-r, r], and e^s is its Taylor polynomial T_K(s) = sum_{p <= K} s^p / p! up to the tail
tau_K(r) = sum_{p > K} r^p / p! <= r^(K+1) / (K+1)! / (1 - r / (K + 2)). The multinomial theorem splits each power
into features of the query and of the key::

    T_K(<q, k>) = sum_{|alpha| <= K} phi_alpha(q) phi_alpha(k),   phi_alpha(y) = y^alpha / sqrt(alpha!)

over the M = C(K + e, e) monomials of degree at most K in e features, so that

    out_i = sum_j a_j T_K(s_ij) v_j / sum_j a_j T_K(s_ij) = Phi(q_i) S_v / Phi(q_i) S_1,
    S = sum_j a_j phi(k_j - c) [v_j, 1]   (an M x (c + 1) matrix, one pass over the keys).

This is the expansion behind the fast Gauss transform (Greengard and Strain 1991; Yang, Duraiswami and Gumerov,
the improved FGT, 2003), here with one centre: it pays where r is small and the head is narrow, which is the
particle regime of the sphere models (d = 3, ``|x| = 1``, beta about 1: ``r <= beta max_j |x_j - c|``, about 1 for
uniform tokens and shrinking as they cluster), not for wide heads (M grows like K^e / e!) nor large radii (K grows
like e r).

**Bound** (:func:`error_bound`). With delta = e^r tau_K(r) < 1, every T_K(s_ij) is within delta e^{s_ij} of e^{s_ij}
(e^{s_ij} >= e^{-r}), so the denominator is within a factor (1 +- delta) of the exact one and
``||out_i - exact_i|| <= 2 delta / (1 - delta) max_j ||v_j||``. :func:`plan` picks the smallest K whose bound is at
most ``tol`` (default: the dtype's machine epsilon, so that the truncation is below the rounding of the dense
kernel). Rounding of the series itself: its terms are at most e^r in sum against a denominator at least e^{-r}
(relative to the weights' sum), so it can amplify the dtype's rounding by up to about e^{2 r}; :func:`plan`
refuses r above :data:`MAX_RADIUS` (e^{2 r} = 64).

The same denominators give the row log-sums log sum_j a_j e^{<q_i, k_j>} (``lse=True``), which the unnormalized
USA field of :class:`meanfield.IsotropicAttention` multiplies in.

``kernels.attend(..., method="series")`` computes it (weights, batches; no positions: a causal or positional
mask does not factor through features); ``auto`` takes it for forward passes without positions where it certifies
``tol`` with at most :data:`MAX_FEATURES` features and costs a fraction of the dense pass
(:func:`meanfield.kernels.choose`). Autograd, forward-mode AD and double backward differentiate it: the derivative
of the truncated series, one degree above the plan's where a derivative may be taken (so that the derivative's own
series keeps the plan's bound; ``auto`` never takes it for derivatives), with the keys' centre c and the balancing
scale held fixed (they are read off the inputs' values, not differentiated: at a low explicit or pinned degree,
where the series depends on c, the gradient misses how c moves with k). The same O(m + n) memory: every derivative
of :func:`kernel_sum` is a kernel sum, since T_K' = T_{K-1}, and only the inputs are saved.
:mod:`meanfield.series_jacobian` certifies local constants through it.
Float32 on CUDA with TF32 switched on (read, never set) runs its products in float64.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import numbers
from dataclasses import dataclass

import torch

from particles.validation import broadcast_shapes

from .kernel_inputs import check_shapes, needs_derivatives, tf32_on, zero_blind_rows

__all__ = ["SeriesPlan", "plan", "series_attend", "kernel_sum", "pinned", "box", "tail_bound", "error_bound",
           "feature_count", "features", "cost", "dense_cost", "MAX_RADIUS", "MAX_FEATURES", "MAX_DEGREE", "COST_RATIO"]

#: the largest ``r = max |q| max |k - c|`` a plan accepts: the series' rounding grows like e^{2 r} (64 here)
MAX_RADIUS = math.log(64.0) / 2
#: the most features (monomials of degree <= K) a plan accepts by default
MAX_FEATURES = 4096
#: the highest degree a plan considers
MAX_DEGREE = 60
#: ``auto`` takes the series where its cost, (m + n) M (c + 1) multiply-adds plus M per row for the features, is
#: at most this fraction of the dense pass's m n (e + c + 1) (plus the exponentials, counted as 8 multiply-adds)
COST_RATIO = 0.25


_PINNED = contextvars.ContextVar("meanfield_series_degree", default=None)


@contextlib.contextmanager
def pinned(degree: int):
    """Run :func:`series_attend` calls without an explicit ``degree`` at this one inside a ``with`` block (per thread
    / task), with no radius limit: for callers that prove their own bound at that degree (the certified local
    constant, :mod:`meanfield.series_jacobian`)."""
    if isinstance(degree, bool) or not isinstance(degree, numbers.Integral) or degree < 0:
        raise ValueError(f"degree: expected an int >= 0, got {degree!r}")
    token = _PINNED.set(int(degree))
    try:
        yield
    finally:
        _PINNED.reset(token)


@dataclass(frozen=True)
class SeriesPlan:
    """What :func:`plan` decided: the degree K, the feature count M = C(K + e, e), the radius r of the centred
    scores and the proved bound (:func:`error_bound`) on ``||out_i - exact_i|| / max_j ||v_j||``."""

    degree: int
    features: int
    radius: float
    bound: float


def tail_bound(r: float, K: int) -> float:
    """An upper bound on tau_K(r) = sum_{p > K} r^p / p!: r^(K+1) / (K+1)! / (1 - r / (K + 2)) (the tail's ratios
    r / (p + 1) are at most r / (K + 2)); inf where r >= K + 2."""
    if r < 0:
        raise ValueError(f"r: expected a radius >= 0, got {r!r}")
    if r == 0:
        return 0.0
    if r >= K + 2:
        return math.inf
    log_first = (K + 1) * math.log(r) - math.lgamma(K + 2)
    return math.exp(log_first) / (1.0 - r / (K + 2))


def error_bound(r: float, K: int) -> float:
    """The bound 2 delta / (1 - delta), delta = e^r tau_K(r), on ``||out_i - exact_i|| / max_j ||v_j||`` of the
    series of degree K at centred scores in [-r, r] (module docstring); inf where delta >= 1."""
    delta = math.exp(r) * tail_bound(r, K) if r > 0 else 0.0
    return 2 * delta / (1 - delta) if delta < 1 else math.inf


def feature_count(e: int, K: int) -> int:
    """M = C(K + e, e), the monomials of degree at most K in e variables."""
    return math.comb(K + e, e)


def cost(batch: int, m: int, n: int, e: int, c: int, K: int) -> int:
    """Multiply-adds of the series of degree K: per key and query one product per feature to build it, and c + 1
    per feature in the sums (S, then the numerators and denominators)."""
    return batch * (m + n) * feature_count(e, K) * (c + 2)


def dense_cost(entries: int, e: int, c: int) -> int:
    """Multiply-adds of a dense pass over ``entries`` scores: e for the score, c for the output, and the exponential
    and normalization counted as 8."""
    return entries * (e + c + 8)


def box(y, log_weights=None):
    """(centre (..., 1, e), radius (...)): the midpoint of the bounding box of the rows of y (..., n, e) per batch
    member and the largest distance of a row to it, rows of zero weight left out (a member whose every weight is zero
    keeps its rows in the box, but none counts in the radius: 0). The keys' centre of the series and the radii of
    its bound (:mod:`meanfield.series_jacobian`)."""
    if log_weights is None:
        live = None
        lo, hi = y.amin(dim=-2, keepdim=True), y.amax(dim=-2, keepdim=True)
    else:
        live = (log_weights != float("-inf")).unsqueeze(-1)
        inside = live | ~live.any(dim=-2, keepdim=True)
        far = torch.full((), math.inf, dtype=y.dtype, device=y.device)
        lo = torch.where(inside, y, far).amin(dim=-2, keepdim=True)
        hi = torch.where(inside, y, -far).amax(dim=-2, keepdim=True)
    centre = (lo + hi) / 2
    dist = (y - centre).norm(dim=-1)
    if live is not None:
        dist = torch.where(live.squeeze(-1), dist, 0)
    return centre, dist.amax(dim=-1)


def _radius(q, k, log_weights, *, scaled=True):
    """(r, centre, scale): ``r = max over batch members of max |q| max |k - c|``, c the midpoint of the keys'
    bounding box per batch member (keys of zero weight left out; a member whose every weight is zero, whose output
    is 0 @ v, counts as r = 0), and the scale s that balances the two factors (``|q / s|`` and ``|(k - c) s|`` at
    most sqrt(r); None with ``scaled=False``: :func:`plan` reads r alone, in every ``auto`` call that weighs the
    series). A NaN or infinite key anywhere (of zero weight too) makes r NaN, as it makes the dense kernel's
    output NaN. One host sync on an accelerator."""
    kd = k.detach()
    centre, rho = box(kd, None if log_weights is None else log_weights.detach())
    rho = rho.unsqueeze(-1)                                      # (..., 1)
    qmax = q.detach().norm(dim=-1).amax(dim=-1, keepdim=True)   # (..., 1)
    # r per member, their maximum; plus 0 x the sum of every key, NaN where one is NaN or infinite
    total = (qmax * rho).amax() + 0 * kd.sum()
    try:
        r = float(total)
    except RuntimeError as exc:   # torch.func.vmap: the degree cannot depend on the batched data
        raise NotImplementedError("method='series' inside torch.func.vmap: its degree depends on the data; use "
                                  "method='stream' or 'dense' there") from exc
    if not scaled:
        return r, centre, None
    scale = torch.where((qmax > 0) & (rho > 0), (qmax / rho.clamp(min=torch.finfo(kd.dtype).tiny)).sqrt(),
                        torch.ones_like(qmax))
    return r, centre, scale.unsqueeze(-1)


def plan(q, k, log_weights=None, *, tol=None, max_features=None, radius=None) -> SeriesPlan | None:
    """The degree of the series for these queries and keys: the smallest K whose proved bound
    (:func:`error_bound`) is at most ``tol`` (default: the machine epsilon of q's dtype), or None where no K up to
    :data:`MAX_DEGREE` with at most ``max_features`` features (default :data:`MAX_FEATURES`) reaches it, or where r
    exceeds :data:`MAX_RADIUS`. ``radius``: r when the caller has it (else one pass over q and k)."""
    if tol is None:
        tol = torch.finfo(q.dtype).eps
    if not (isinstance(tol, (int, float)) and 0 < tol < 1):
        raise ValueError(f"tol: expected a bound in (0, 1), got {tol!r}")
    max_features = MAX_FEATURES if max_features is None else int(max_features)
    r = _radius(q, k, log_weights, scaled=False)[0] if radius is None else float(radius)
    if not math.isfinite(r) or r > MAX_RADIUS:
        return None
    e = q.shape[-1]
    for K in range(MAX_DEGREE + 1):
        M = feature_count(e, K)
        if M > max_features:
            return None
        bound = error_bound(r, K)
        if bound <= tol:
            return SeriesPlan(K, M, r, bound)
    return None


@functools.lru_cache(maxsize=64)
def _exponents(e: int, K: int) -> tuple:
    """The multi-indices alpha of the monomials of degree at most K in e variables, in the order :func:`_powers`
    builds them: by degree, then by last variable (that of the largest index with alpha_j > 0), recursively."""
    blocks = [[(0,) * e]]
    for _ in range(K):
        previous, current = blocks[-1], []
        for j in range(e):
            # the previous degree's monomials whose last variable is at most j, times y_j (a prefix of them)
            for alpha in previous:
                if all(a == 0 for a in alpha[j + 1:]):
                    current.append(alpha[:j] + (alpha[j] + 1,) + alpha[j + 1:])
        blocks.append(current)
    return tuple(alpha for block in blocks for alpha in block)


@functools.lru_cache(maxsize=64)
def _inverse_factorials(e: int, K: int, device, dtype) -> torch.Tensor:
    """1 / alpha! per monomial (M,), in :func:`_exponents`' order (a normal tensor even when first asked for under
    ``torch.inference_mode``: it is cached, and later graphs save it for backward)."""
    with torch.inference_mode(False):
        return torch.tensor([1.0 / math.prod(math.factorial(a) for a in alpha) for alpha in _exponents(e, K)],
                            dtype=dtype, device=device)


def _powers(y: torch.Tensor, K: int, inplace: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The monomials y^alpha of degree at most K, as (..., M, rows) for y (..., rows, e), in :func:`_exponents`'
    order. Degree p from degree p - 1: the monomials whose last variable is y_j are those of degree p - 1 whose last
    variable is at most j (a prefix, in this order) times y_j, so each degree is e products of contiguous blocks
    (no gather). Written in place where no derivative is taken (``inplace``; None: where no derivative may be taken
    of y), concatenated otherwise (autograd, forward mode). ``out``: where to write them in place, a buffer
    (..., M, >= rows) reused from block to block (its first ``rows`` columns)."""
    e, rows = y.shape[-1], y.shape[-2]
    yt = y.transpose(-1, -2).unsqueeze(-2)        # (..., e, 1, rows)
    M = feature_count(e, K)
    counts = [1] * e                               # monomials of the previous degree whose last variable is <= j
    if inplace is None:
        inplace = not needs_derivatives(y)
    if inplace:
        if out is None:
            out = torch.empty(*y.shape[:-2], M, rows, dtype=y.dtype, device=y.device)
        else:
            out = out[..., :M, :rows]
        # each variable's row contiguous (a multiplier read with y's stride of e made every product about 3.5 times
        # slower on the CPU), sliced once
        ys = yt.contiguous().unbind(-3)
        out[..., 0, :] = 1
        start, end = 0, 1                          # the previous degree's rows of out
        for _ in range(K):
            at = end
            for j in range(e):
                torch.mul(out[..., start:start + counts[j], :], ys[j], out=out[..., at:at + counts[j], :])
                at += counts[j]
            start, end = end, at
            counts = [sum(counts[:j + 1]) for j in range(e)]
        return out
    blocks = [torch.ones(*y.shape[:-2], 1, rows, dtype=y.dtype, device=y.device)]
    for _ in range(K):
        previous = blocks[-1]
        blocks.append(torch.cat([previous[..., :counts[j], :] * yt[..., j, :, :] for j in range(e)], dim=-2))
        counts = [sum(counts[:j + 1]) for j in range(e)]
    return torch.cat(blocks, dim=-2)


def features(y: torch.Tensor, K: int) -> torch.Tensor:
    """phi(y) (..., rows, M): the monomials y^alpha / sqrt(alpha!) of degree at most K, so that
    <phi(x), phi(y)> = sum_{p <= K} <x, y>^p / p! (the multinomial theorem)."""
    scale = _inverse_factorials(y.shape[-1], K, y.device, y.dtype).sqrt()
    return (_powers(y, K) * scale.unsqueeze(-1)).transpose(-1, -2)


#: bytes of features one block of rows holds at once: on the CPU within a core's cache, on an accelerator enough
#: rows to fill it
BLOCK_BYTES = {"cpu": 2**23}
BLOCK_BYTES_ACCELERATOR = 2**28


def _block_rows(rows: int, batch: int, M: int, t: torch.Tensor) -> int:
    budget = BLOCK_BYTES.get(t.device.type, BLOCK_BYTES_ACCELERATOR)
    return max(1, min(rows, budget // max(1, batch * M * t.element_size())))


def series_attend(q, k, v, log_weights=None, *, tol=None, degree=None, max_features=None, lse=False):
    """sum_j P_ij v_j as the truncated series of the module docstring, shape (..., m, c); leading (batch) dimensions
    broadcast. ``degree``: K (else the degree :func:`pinned` sets, else :func:`plan` with ``tol`` and
    ``max_features``; a ValueError where no degree reaches ``tol``). Rows whose every weight is zero give 0 @ v, as
    :func:`meanfield.kernels.attention_probs`. Queries and keys are read in blocks of rows (``BLOCK_BYTES`` of
    features at once).

    With ``lse``, (out, L): also the row log-sums L_i = log sum_j a_j e^{<q_i, k_j>} (..., m) from the same
    denominators (L_i = log of the series' denominator + <q_i, c> + the largest log-weight; its error at most
    -log(1 - delta), about the bound; -inf for rows whose every weight is zero)."""
    check_shapes(q, k, v, log_weights, None, None)
    if tol is None:
        tol = torch.finfo(q.dtype).eps
    if q.dtype in (torch.float16, torch.bfloat16) or (q.dtype == torch.float32 and tf32_on(q)):
        # the half types in float32 (products of up to K factors would lose their digits in them); float32 on CUDA
        # with TF32 switched on (its 10-bit products would undo the series' digits) in float64, to the same tol
        wide = torch.float32 if q.dtype != torch.float32 else torch.float64
        res = series_attend(q.to(wide), k.to(wide), v.to(wide), None if log_weights is None else log_weights.to(wide),
                            tol=tol, degree=degree, max_features=max_features, lse=lse)
        return (res[0].to(q.dtype), res[1].to(q.dtype)) if lse else res.to(q.dtype)
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2],
                            () if log_weights is None else log_weights.shape[:-1])
    q = q.expand(*lead, *q.shape[-2:])
    k = k.expand(*lead, *k.shape[-2:])
    v = v.expand(*lead, *v.shape[-2:])
    lw = None if log_weights is None else log_weights.expand(*lead, log_weights.shape[-1])
    m, c = q.shape[-2], v.shape[-1]
    if m == 0:
        return (q.new_zeros(*lead, 0, c), q.new_zeros(*lead, 0)) if lse else q.new_zeros(*lead, 0, c)
    r, centre, scale = _radius(q, k, lw)
    if not math.isfinite(r):
        for name, t in (("q", q), ("k", k)):
            if not bool(torch.isfinite(t.detach()).all()):
                raise FloatingPointError(f"{name}: contains NaN or infinite entries (the series needs a finite "
                                         "max |q| max |k - c|)")
        raise FloatingPointError(f"q, k: max |q| max |k - c| overflows {q.dtype}; use float64 or smaller inputs")
    if degree is None:
        degree = _PINNED.get()
    if degree is None:
        p = plan(q, k, lw, tol=tol, max_features=max_features, radius=r)
        if p is None:
            cap = MAX_FEATURES if max_features is None else max_features
            why = (f"r = {r:.3g} (max |q| max |k - c|) is above {MAX_RADIUS:.3g}, where the series' rounding could "
                   "grow beyond 64 times the dtype's" if r > MAX_RADIUS else
                   f"at r = {r:.3g} (max |q| max |k - c|) a head of {q.shape[-1]} features needs more than "
                   f"max_features = {cap} features")
            raise ValueError(f"series: no degree up to {MAX_DEGREE} reaches tol = {tol:.3g}: {why}; use "
                             "method='auto', 'stream' or 'dense'")
        degree = p.degree
        if needs_derivatives(q, k, v, lw):
            # the derivative of the degree-K series is the degree-(K - 1) series of the derivative: one degree more
            # keeps it within the same bound (at r = 0, degree 0 would not depend on q and k at all)
            degree += 1
    elif isinstance(degree, bool) or not isinstance(degree, numbers.Integral) or degree < 0:
        raise ValueError(f"degree: expected an int >= 0, got {degree!r}")
    out, den, top = _series(q, k, v, lw, int(degree), centre, scale)
    if not lse:
        return out
    # log sum_j a_j e^{<q_i, k_j>} = log(den_i) + <q_i, c> + max log a (den_i: the series of sum_j (a_j / max a)
    # e^{<q_i, k_j - c>}); rows of zero weights: -inf
    rows = torch.log(den) + (q * centre).sum(dim=-1) + top
    if lw is not None:
        rows = torch.where(torch.isneginf(top).expand_as(rows), float("-inf"), rows)
    return out, rows


def _series(q, k, v, lw, K, centre, scale):
    """The series of degree K with the keys centred at ``centre`` and the queries and keys balanced by ``scale``."""
    c = v.shape[-1]
    # weights relative to the largest (the shift cancels in the normalization)
    if lw is None:
        top = torch.zeros((), dtype=q.dtype, device=q.device)
        wv = torch.cat([v, torch.ones(*v.shape[:-1], 1, dtype=v.dtype, device=v.device)], dim=-1)
    else:
        top = lw.amax(dim=-1, keepdim=True)
        a = torch.exp(lw - torch.where(torch.isfinite(top), top, 0))
        wv = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1) * a.unsqueeze(-1)
    ks = (k - centre) * scale
    if lw is not None:
        # keys of zero weight lie outside the box the scale was set from: zeros instead (their weight is 0)
        ks = torch.where((lw == float("-inf")).unsqueeze(-1), 0, ks)
    # num_i = sum_j a_j T_K(<q_i, k_j - c>) [v_j, 1] (the scale cancels in the products)
    num = kernel_sum(q / scale, ks, wv, K)
    den = num[..., c]
    if lw is not None:
        # rows whose every weight is zero have 0 / 0 here (set to 0 @ v below): divide them by 1, so that no NaN
        # reaches a derivative through the where
        den = torch.where(torch.isneginf(top), torch.ones_like(den), den)
    out = num[..., :c] / den.unsqueeze(-1)
    if lw is not None:
        out = zero_blind_rows(out, v, lw, None, None)
    return out, den, top


def _kernel_sum(x, y, w, K):
    """sum_j T_K(<x_i, y_j>) w_j (..., m, c) for x (..., m, e), y (..., n, e), w (..., n, c) of one batch shape, no
    derivative taken (:func:`_kernel_sums` of one sum)."""
    return _kernel_sums(x, y, [(w, K)])[0]


def _kernel_sums(x, y, sums):
    """[sum_j T_K(<x_i, y_j>) w_j for (w, K) in sums], no derivative taken, sharing the features: those of degree
    at most max K are built once per block of rows on each side, and a sum of lower degree reads their prefix (the
    monomials are ordered by degree). S_K = sum_j phi(y_j) w_j^T (M_K x c) over blocks of y, then phi(x_i)^T S over
    blocks of x (features in place, ``BLOCK_BYTES`` of them at once); zeros for K < 0 (the derivative of T_0).

    The features are (M, rows), rows contiguous, so both products are written with the long dimension (rows) as the
    inner one of a row-major operand: S^T += w^T P^T on the keys' side and out^T = S^T P on the queries' side
    (on 2 CPU cores at N = 1e5, d = 2, degree 36: 3x and 8x faster than P w and P^T S, which read P across its
    rows; a kernel sum 1.6-2x faster in all)."""
    lead, (m, e), n = x.shape[:-2], x.shape[-2:], y.shape[-2]
    outs = [x.new_zeros(*lead, m, w.shape[-1]) for w, _ in sums]
    live = [i for i, (w, K) in enumerate(sums) if K >= 0 and w.shape[-1] > 0]
    if not live or m == 0 or n == 0:
        return outs
    with torch.no_grad():
        top = max(sums[i][1] for i in live)
        M, batch = feature_count(e, top), math.prod(lead)
        sizes = {i: feature_count(e, sums[i][1]) for i in live}
        # the values as (..., c, n), rows contiguous (one O(n c) copy each)
        values = {i: sums[i][0].transpose(-1, -2).contiguous() for i in live}
        ST = {}
        step_y, step_x = _block_rows(n, batch, M, y), _block_rows(m, batch, M, x)
        # one buffer of features for every block of rows, on both sides (no allocation per block)
        buffer = torch.empty(*lead, M, max(step_y, step_x), dtype=x.dtype, device=x.device)
        for j in range(0, n, step_y):
            PT = _powers(y[..., j:j + step_y, :], top, inplace=True, out=buffer).transpose(-1, -2)
            for i in live:
                part = values[i][..., j:j + step_y] @ PT[..., :sizes[i]]
                ST[i] = part if i not in ST else ST[i] + part
        # the factorials on this side only; the sums of lower degree padded with zero columns, so that every output
        # is one product with the query side's features
        scale = _inverse_factorials(e, top, x.device, x.dtype)
        blocks = []
        for i in live:
            Si = ST[i] * scale[:sizes[i]]
            if sizes[i] < M:
                Si = torch.cat([Si, Si.new_zeros(*Si.shape[:-1], M - sizes[i])], dim=-1)
            blocks.append(Si)
        S_all = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-2)
        outT = torch.empty(*lead, S_all.shape[-2], m, dtype=x.dtype, device=x.device)
        for i in range(0, m, step_x):
            P = _powers(x[..., i:i + step_x, :], top, inplace=True, out=buffer)
            outT[..., i:i + step_x] = S_all @ P
        out = outT.transpose(-1, -2)
        at = 0
        for i in live:
            c = sums[i][0].shape[-1]
            outs[i] = out[..., at:at + c].contiguous()
            at += c
        return outs


def _outer(a, b):
    """(..., rows, e * c): the products a_f b_g per row, f major."""
    return (a.unsqueeze(-1) * b.unsqueeze(-2)).flatten(-2)


class _KernelSum(torch.autograd.Function):
    """:func:`kernel_sum` with its derivatives in O(rows) memory: only x, y and w are saved, and every derivative is
    itself a kernel sum, since T_K' = T_{K-1}:

    * d/dw_j: sum_i T_K(<x_i, y_j>) g_i, the kernel sum with the sides exchanged;
    * d/dx_i: sum_j T_{K-1}(<x_i, y_j>) (g_i . w_j) y_j, a kernel sum of degree K - 1 with values y_j (x) w_j;
    * d/dy_j: sum_i T_{K-1}(<x_i, y_j>) (g_i . w_j) x_i, the same with the sides exchanged and values x_i (x) g_i;
    * the tangent: F_K(x, y, dw) + sum_f dx_f F_{K-1}(x, y, y_f w) + sum_f x_f F_{K-1}(x, y, dy_f w).

    The backward calls :func:`kernel_sum` again, so it can itself be differentiated (double backward, forward over
    reverse)."""

    @staticmethod
    def forward(x, y, w, K):
        return _kernel_sum(x, y, w, K)

    @staticmethod
    def vmap(info, in_dims, x, y, w, K):
        raise NotImplementedError("method='series' inside torch.func.vmap (jacfwd, jacrev): not supported; use "
                                  "method='stream' or 'dense' there, or torch.autograd's own forward and backward "
                                  "modes")

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, y, w, K = inputs
        ctx.K = K
        ctx.save_for_backward(x, y, w)
        ctx.save_for_forward(x, y, w)

    @staticmethod
    def backward(ctx, g):
        x, y, w = ctx.saved_tensors
        K, e, c = ctx.K, x.shape[-1], w.shape[-1]
        need_x, need_y, need_w = ctx.needs_input_grad[:3]
        gx = gy = gw = None
        if need_w or need_y:   # one pass over the features of x, then of y, for both
            sums = ([(g, K)] if need_w else []) + ([(_outer(x, g), K - 1)] if need_y else [])
            res = kernel_sums(y, x, sums)
            if need_w:
                gw = res[0]
            if need_y:
                gy = (res[-1].unflatten(-1, (e, c)) * w.unsqueeze(-2)).sum(-1)
        if need_x:
            H = kernel_sums(x, y, [(_outer(y, w), K - 1)])[0].unflatten(-1, (e, c))
            gx = (H * g.unsqueeze(-2)).sum(-1)
        return gx, gy, gw, None

    @staticmethod
    def jvp(ctx, dx, dy, dw, _):
        x, y, w = ctx.saved_tensors
        K, e, c = ctx.K, x.shape[-1], w.shape[-1]
        sums, factors = [], []
        if dw is not None:
            sums.append((dw, K))
        values = []
        if dx is not None:   # sum_f dx_if F_{K-1}(x, y, y_f w)_i
            values.append(_outer(y, w))
            factors.append(dx)
        if dy is not None:   # sum_f x_if F_{K-1}(x, y, dy_f w)_i
            values.append(_outer(dy, w))
            factors.append(x)
        if values:
            sums.append((torch.cat(values, dim=-1), K - 1))
        if not sums:
            return x.new_zeros(*x.shape[:-1], c)
        res = kernel_sums(x, y, sums)
        out = res[0] if dw is not None else x.new_zeros(*x.shape[:-1], c)
        if values:
            H = res[-1].unflatten(-1, (len(values), e, c))
            for t, f in enumerate(factors):
                out = out + (H[..., t, :, :] * f.unsqueeze(-1)).sum(-2)
        return out


def kernel_sums(x, y, sums):
    """[sum_j T_K(<x_i, y_j>) w_j for (w, K) in sums] sharing their features (:func:`_kernel_sums`), differentiable
    (each through :class:`_KernelSum` where a derivative may be taken, so that a backward pass built from them can
    itself be differentiated)."""
    if not needs_derivatives(x, y, *(w for w, _ in sums)):
        return _kernel_sums(x, y, sums)
    return [kernel_sum(x, y, w, K) for w, K in sums]


def kernel_sum(x, y, w, K: int):
    """sum_j T_K(<x_i, y_j>) w_j, (..., m, c), with T_K the Taylor polynomial of degree K of the exponential: the
    series' core (x (..., m, e), y (..., n, e) and w (..., n, c); leading dimensions broadcast). O((m + n) M) time,
    O(m + n + M) memory, with its derivatives (autograd, forward mode, double backward) in the same memory
    (``_KernelSum``)."""
    for name, t in (("x", x), ("y", y), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating tensor of shape (..., rows, features), got "
                             f"{type(t).__name__} {tuple(getattr(t, 'shape', ()))}")
    if y.shape[-1] != x.shape[-1] or w.shape[-2] != y.shape[-2] or not x.dtype == y.dtype == w.dtype:
        raise ValueError(f"x, y, w: expected (..., m, e), (..., n, e), (..., n, c) of one dtype, got "
                         f"{tuple(x.shape)}, {tuple(y.shape)}, {tuple(w.shape)} ({x.dtype}, {y.dtype}, {w.dtype})")
    if isinstance(K, bool) or not isinstance(K, numbers.Integral):
        raise ValueError(f"K: expected an int, got {K!r}")
    K = int(K)
    lead = broadcast_shapes(x.shape[:-2], y.shape[:-2], w.shape[:-2])
    x, y, w = (t.expand(*lead, *t.shape[-2:]) for t in (x, y, w))
    if K < 0 or not needs_derivatives(x, y, w):
        return _kernel_sum(x, y, w, K)
    return _KernelSum.apply(x, y, w, K)
