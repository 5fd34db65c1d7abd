"""The best upper bound the framework knows for a whole operator, read from its parameters.

:func:`operator_upper` asks an operator for its record (``op.parameters()``, :mod:`meanfield.parameters`)
and combines the formulas of :mod:`meanfield.bounds` head by head (docs/math.md section 5):
Theorems 3.3 / 3.5 per dot-product head (Theorem 4.3 when masked, on sequences only: the stated
masked mean-field bound, Theorem 4.4, fails; docs/math.md section 5.2), a key bias absorbed by lifting
the tokens (:func:`~meanfield.bounds.absorb_key_bias`), Lemma 3.8 over the heads, and Kim et al.'s
Theorem 3.2 for L2 heads. It never looks at the operator's class: a new operator that returns a
record gets its bound with no change here.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from particles.validation import check_positive_int, check_radius

from .bounds import absorb_key_bias, l2_attention_upper, mean_field_upper, sqrt_n_upper
from .bounds.numerics import BoundOverflowWarning, _exp_or_inf, _matrix

__all__ = ["UpperBound", "operator_upper"]


@dataclass(frozen=True)
class UpperBound:
    """The best upper bound the framework knows for one operator (see :func:`operator_upper`).

    ``log_value`` is the natural logarithm of the bound (``math.inf`` when no bound is known, ``-inf``
    for the zero map); ``value`` is its exponential (``math.inf`` beyond float64). ``source`` names
    the results used; ``heads`` holds, for multi-head layers, each head's ``(log_value, source)``
    before Lemma 3.8.
    """

    log_value: float
    source: str
    heads: tuple = ()

    @property
    def value(self) -> float:
        return math.inf if self.log_value == math.inf else _exp_or_inf(self.log_value)

    @property
    def known(self) -> bool:
        """False when the framework knows no bound for this operator (``value`` is then inf)."""
        return self.log_value < math.inf

    def __float__(self) -> float:
        """``value`` (``math.inf`` beyond float64 or when no bound is known), as ``float(estimate)`` gives a
        :class:`~meanfield.lipschitz.LipschitzEstimate`'s value."""
        return self.value

    def __repr__(self) -> str:
        """The value first, then its logarithm, the source and how many heads were combined (not their records)."""
        heads = f", heads=<{len(self.heads)} heads>" if self.heads else ""
        return f"UpperBound(value={self.value:.6g}, log_value={self.log_value:.6g}, source={self.source!r}{heads})"


#: why a masked head gets no bound on measures (the paper's Theorem 4.4 states Theorem 3.5's bound for it)
MASKED_MEASURES = ("none: no bound is known for masked attention on measures (Theorem 4.4's stated bound, that "
                   "of Theorem 3.5, fails: at A = 0 the masked map is the running mean, of constant up to "
                   "2 ||V||; docs/math.md section 5.2)")


def _head_upper(A, c, V, R, n, masked=False) -> tuple[float, str]:
    """log of min(Theorem 3.3, Theorem 3.5) for one head (Theorem 3.5 alone when n is None); masked: Theorem
    4.3 on sequences, none on measures (Theorem 4.4's stated bound fails, docs/math.md section 5.2)."""
    a, Rl, t = absorb_key_bias(A, c, R)
    v = _matrix(V, "V")
    if a.shape[0] != v.shape[1]:
        v = np.pad(v, ((0, 0), (0, a.shape[0] - v.shape[1])))
    lifted = f" (key bias absorbed: tokens lifted to (x, {t:.3g}), radius {Rl:.6g})" if t > 0 else ""
    if masked:
        if n is None:
            return math.inf, MASKED_MEASURES
        return sqrt_n_upper(a, v, Rl, n, log=True), "Theorem 4.3" + lifted
    log_sq = None if n is None else sqrt_n_upper(a, v, Rl, n, log=True)
    with warnings.catch_warnings():
        if log_sq is not None and log_sq < math.inf:   # an overflowing Theorem 3.5 cannot beat a finite Theorem 3.3
            warnings.simplefilter("ignore", BoundOverflowWarning)
        mf = mean_field_upper(a, v, Rl, log=True)
    if n is None:
        return mf, "Theorem 3.5" + lifted
    if log_sq < math.inf and log_sq <= mf:
        return log_sq, "Theorem 3.3" + lifted
    return mf, "Theorem 3.5" + lifted


def _logsumexp(xs) -> float:
    top = max(xs)
    if top in (math.inf, -math.inf):
        return top
    return top + math.log(sum(math.exp(x - top) for x in xs))


def _np(t):
    return None if t is None else t.detach().to(torch.float64).cpu().numpy()


def _l2_upper(p, n) -> UpperBound:
    if p.masked:
        return UpperBound(math.inf, "none: Kim et al.'s bound is stated for unmasked L2 attention")
    if n is None:
        return UpperBound(math.inf, "none: Kim et al.'s bound depends on the number of tokens N")
    for h, head in enumerate(p.heads):
        if head.key_bias is not None and bool((head.key_bias != 0).any()):
            return UpperBound(math.inf, f"none: L2 head {h} has a key bias (a score term <c, y>), which Kim et al.'s "
                                        "bound does not cover")
        if head.scale < 0:
            return UpperBound(math.inf, f"none: L2 head {h} has scale {head.scale} < 0 (scores +|scale| "
                                        "|Q x - Q y|^2), which Kim et al.'s bound does not cover")
    # Kim et al.'s layout: W_Q^h (D, k), W_V^h = V_h^T (D, k_v), W_O (H k_v, D_out), with the scale 1/sqrt(k) built
    # in. The record's head (scores -s |Q x - Q y|^2, values V (s Q^T Q) y, any s >= 0) is Kim et al.'s head with
    # W_Q^h = sqrt(s sqrt(k)) Q_h^T: its scores are -(s sqrt(k)) |Q (x - y)|^2 / sqrt(k) and its value map
    # W_Q^h W_Q^h^T / sqrt(k) = s Q^T Q (docs/math.md section 5.8). A value bias or an output bias is a constant.
    W_Q = [_np(h.Q.T) * math.sqrt(h.scale * math.sqrt(h.Q.shape[0])) for h in p.heads]
    value = l2_attention_upper(W_Q, [_np(h.V.T) for h in p.heads], None if p.W_O is None else _np(p.W_O.T), N=n)
    return UpperBound(math.log(value) if value > 0 else -math.inf, "Kim et al. Theorem 3.2 (2-norm form)")


def operator_upper(op, R, n=None, *, d=None) -> UpperBound:
    """The best upper bound the framework knows on the Lipschitz constant of an attention operator.

    On sequences (``n`` given): a bound on Lip(f on B_R^n) = sup over X in B_R^n of Lip_X(f). On
    measures (``n=None``): a bound on the W2 Lipschitz constant of F on measures supported in B_R,
    which by Lemma 3.2 also bounds Lip_X(f) for every n. Read from ``op.parameters()``
    (:mod:`meanfield.parameters`):

    * one dot-product head: min(Theorem 3.3, Theorem 3.5) (docs/math.md sections 5.1, 5.2); on measures
      Theorem 3.5 alone;
    * masked heads: Theorem 4.3 on sequences; on measures no bound (``known=False``): the paper's Theorem
      4.4 states Theorem 3.5's bound for them, which fails (at A = 0 the masked map is the running mean,
      whose constant tends to 2 ||V||, :func:`~meanfield.bounds.cesaro_norm`; docs/math.md section 5.2);
    * several heads: Lemma 3.8 over the heads' bounds with ||W_O||_2 (1 for a plain concatenation)
      (docs/math.md section 5.6);
    * biases: a value bias or an output bias adds a constant and changes no Lipschitz constant; a
      key bias (from b_Q) is absorbed head by head with :func:`~meanfield.bounds.absorb_key_bias`;
    * L2 heads (unmasked, sequences): :func:`~meanfield.bounds.l2_attention_upper` with N = n
      (Kim et al., docs/math.md section 5.8), for the head's own scale s >= 0 (its W_Q is
      sqrt(s sqrt(k)) Q^T in Kim et al.'s layout, which builds in 1/sqrt(k)); an L2 head with a key bias
      or a negative scale gets no bound (``known=False``).

    Operators without a record (bare callables), records with a caveat (whole Hugging Face blocks,
    the unnormalized USA model) and masked L2 attention get an :class:`UpperBound` with
    ``known=False`` and ``value = inf``, its ``source`` saying why. ``d`` is the token dimension of
    an operator that acts in every dimension (the sphere models).

    Examples
    --------
    >>> import numpy as np
    >>> from meanfield import SelfAttention, operator_upper
    >>> b = operator_upper(SelfAttention(np.eye(2), np.eye(2)), R=1.0, n=8)
    >>> round(b.value, 4), b.source
    (11.0905, 'Theorem 3.3')
    """
    from .adapters import as_operator

    op = as_operator(op)
    R = check_radius(R, "R")
    if n is not None:
        n = check_positive_int(n, "n")
    if d is not None:
        d = check_positive_int(d, "d")
    if op.d_in is None and d is None and not op.points_only:
        return UpperBound(math.inf, f"none: {op!r} acts in every dimension; give d= for its parameters")
    p = op.parameters(op.d_in if op.d_in is not None else d)
    if p is None:
        return UpperBound(math.inf, f"none: {op!r} does not declare its parameters (a points-only callable): "
                                    "no bound is known for it")
    if p.caveat is not None:
        return UpperBound(math.inf, "none: " + p.caveat)
    if p.kind == "l2":
        return _l2_upper(p, n)
    if p.kind != "dot":
        return UpperBound(math.inf, "none: the heads mix dot-product and L2 attention")
    per = tuple(_head_upper(_np(h.A), _np(h.key_bias), _np(h.value_map), R, n, p.masked) for h in p.heads)
    if p.masked and n is None:
        return UpperBound(math.inf, MASKED_MEASURES)
    if p.W_O is None and len(per) == 1:
        return UpperBound(per[0][0], per[0][1])
    nw = 1.0 if p.W_O is None else float(np.linalg.norm(_np(p.W_O), 2))
    log_w = math.log(nw) if nw > 0 else -math.inf
    log_value = log_w + 0.5 * _logsumexp([2.0 * lv for lv, _ in per])
    kinds = sorted({s.split(" (")[0] for _, s in per})
    return UpperBound(log_value, f"Lemma 3.8 over {len(per)} heads ({', '.join(kinds)})", per)
