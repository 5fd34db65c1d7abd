"""The gradient of a local Lipschitz constant with respect to the input (docs/math.md section 4).

Lip_X(f) = sigma(X) is the top singular value of the Jacobian J(X) = D_X f (section 4.1), or, for a
measure, of the weighted Jacobian M = D^{1/2} J D^{-1/2} of Lemma C.5 (section 4.5). Where the top
singular value is simple, with unit right and left singular vectors v and u = J v / sigma,

    d sigma = <u, (dJ) v>,

because sigma = ``|J v|`` and the variation of v does not contribute to first order (v maximizes
``|J v|`` over unit vectors). So the gradient in X is that of the scalar X -> <u, J(X) v> with u and v
held fixed: one Jacobian-vector product J(X) v and one reverse pass through it (a VJP of the JVP),
given the certified pair (sigma, v) that :func:`meanfield.local_lipschitz` returns. Operators
without forward-mode derivatives are differentiated reverse-over-reverse instead
(J v = d/dw <J^T w, v>), with the same result.

For a measure the weights are variables too: the gradient is also returned with respect to the
log-weights, taken as logits (a = softmax(z), so that the weights stay on the simplex and an
added constant changes nothing).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch.func import jvp, vjp

from particles import Measure

from . import forward_mode
from .adapters import as_operator
from .operator import sequence_positions

__all__ = ["SigmaGradient", "sigma_gradient", "with_jacobian_products"]


class SigmaGradient(NamedTuple):
    """sigma = ``|J v|`` (a lower bound of the top singular value, equal to it at a singular vector), the
    gradient of sigma with respect to the points (shaped like them) and, for a measure, with
    respect to the log-weights taken as logits (None for sequences)."""

    sigma: torch.Tensor
    points: torch.Tensor
    log_weights: torch.Tensor | None


def _math_sdpa():
    # torch's fused attention kernels have no forward-mode derivative on CPU; the math backend is
    # made of ordinary differentiable operations
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - older torch
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.MATH])


def _jv_forward(fn, Y, v):
    # the tangent output [1], not the primal [0] (docs/math.md section 4.2)
    forward_mode.ready()
    return jvp(fn, (Y,), (v,))[1]


def _jv_reverse(fn, Y, v):
    """J(Y) v without forward mode: w -> J^T w is linear, and J v is the gradient of <J^T w, v> in w."""
    out, back = vjp(fn, Y)
    _, back2 = vjp(lambda w: back(w)[0], torch.zeros_like(out))
    return back2(v)[0]


def _per_member_norm(t):
    return t.flatten(1).norm(dim=1).reshape(-1, *([1] * (t.dim() - 1)))


def with_jacobian_products(run):
    """``run(jv)``, where ``jv(fn, Y, v)`` is the Jacobian-vector product J(Y) v of ``fn`` at ``Y``, under torch's
    math attention backend (its fused CPU kernels have no forward-mode rule): forward mode first, and where an
    operator still has none (or it fails inside another transform), ``run`` again with reverse-over-reverse
    (``_jv_reverse``). The one fallback of the framework's derivatives of Jacobian products: the gradient
    of sigma here and the query derivatives of :mod:`meanfield.splitting`."""
    errors = []
    for jv in (_jv_forward, _jv_reverse):
        try:
            with _math_sdpa():
                return run(jv)
        except (NotImplementedError, RuntimeError) as err:  # no forward-mode rule: reverse-over-reverse
            errors.append(err)
    raise errors[-1]


def _vjp_of_jvp(build, args):
    """Run ``build(jv)`` (a function of ``args`` returning J v, weighted) under a VJP and pull back u."""
    def run(jv):
        Jv, back = vjp(build(jv), *args)
        norm = _per_member_norm(Jv)
        u = Jv / torch.where(norm > 0, norm, torch.ones_like(norm))
        return norm.flatten(), back(u)

    return with_jacobian_products(run)


def sigma_gradient(f, X, vector) -> SigmaGradient:
    """Gradient of the local Lipschitz constant at a simple top singular pair: d sigma = <u, dJ v>.

    Parameters
    ----------
    f : anything :func:`meanfield.as_operator` accepts
    X : tensor (n, d), batch (b, n, d), or :class:`~particles.Measure`
        The input, as given to :func:`meanfield.local_lipschitz` (sequences: Euclidean norm, positions
        i/n when masked; a measure: the W2 sense of Lemma C.5, positions held fixed).
    vector : torch.Tensor
        The top right singular vector v, of the shape of the points, (n, d), (b, n, d) or (N, d)
        (:attr:`LipschitzEstimate.vector <meanfield.lipschitz.LipschitzEstimate.vector>`; for a batch, the
        vectors stacked); another shape, a transposed one included, is an error. It is normalized here
        (per batch member).

    Returns
    -------
    SigmaGradient
        ``sigma`` (b,) = ``|J v|``, ``points`` the gradient in X (docs/math.md section 4.1 differentiated
        once more), ``log_weights`` the gradient in the logits of the weights (measures only).

    Notes
    -----
    The formula needs a simple top singular value; at a multiple one, sigma is not differentiable
    and this is the gradient along the given v (a one-sided directional slope). The cost is one
    JVP and one VJP through it (counted as two Jacobian products by :mod:`meanfield.worst_case`).

    Examples
    --------
    >>> import torch
    >>> from meanfield import SelfAttention, local_lipschitz
    >>> from meanfield.sigma_gradient import sigma_gradient
    >>> op = SelfAttention(torch.eye(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64))
    >>> X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)
    >>> est = local_lipschitz(op, X, tol=1e-10)
    >>> g = sigma_gradient(op, X, est.vector)
    >>> abs(float(g.sigma) - est.value) < 1e-8, tuple(g.points.shape)
    (True, (3, 2))
    """
    op = as_operator(f)
    if isinstance(X, Measure):
        return _measure_gradient(op, X, vector)
    Xt = op.check_points(X, "X")
    if Xt.dim() not in (2, 3):
        raise ValueError(f"X: expected a sequence (n, d) or a batch (b, n, d), got shape {tuple(Xt.shape)}")
    Xb = (Xt if Xt.dim() == 3 else Xt.unsqueeze(0)).detach()
    v = _vector(vector, Xb, Xt.shape)
    pos = sequence_positions(Xb.shape[1], Xb) if op.masked else None
    fn = lambda Y: op.points_map(Y, None, pos)
    sigma, (g,) = _vjp_of_jvp(lambda jv: (lambda Y: jv(fn, Y, v)), (Xb,))
    if Xt.dim() == 2:
        return SigmaGradient(sigma, g[0], None)
    return SigmaGradient(sigma, g, None)


def _vector(vector, like, shape):
    if not isinstance(vector, torch.Tensor):
        raise TypeError(f"vector: expected a tensor (the singular vector), got {type(vector).__name__}")
    if tuple(vector.shape) != tuple(shape):
        # the shape, not only the number of entries: a transposed (d, n) vector has n d entries too, and read
        # row by row it is another direction (its sigma is not the estimate's)
        raise ValueError(f"vector: expected shape {tuple(shape)}, that of the points X (the singular vector "
                         f"LipschitzEstimate.vector), got shape {tuple(vector.shape)}")
    v = vector.detach().to(dtype=like.dtype, device=like.device).reshape(like.shape)
    norm = _per_member_norm(v)
    if bool((norm == 0).any()) or not bool(torch.isfinite(v).all()):
        raise ValueError("vector: expected a finite non-zero vector per member")
    return v / norm


def _measure_gradient(op, mu, vector) -> SigmaGradient:
    mu = op.check_measure(mu, "X")
    if op.points_only:  # pragma: no cover - check_measure refuses weighted measures for these
        raise TypeError("f: a points-only operator cannot weigh keys; give the sequence instead")
    lw0 = mu.log_weights.detach()
    if not bool(torch.isfinite(lw0).all()):
        raise ValueError("X: the measure has atoms of zero mass; drop them (they are not in the measure)")
    P = mu.points.detach().unsqueeze(0)
    v = _vector(vector, P, mu.points.shape)
    pos = mu.positions if op.masked else None

    def build(jv):
        def h(Y, z):
            lw = z - torch.logsumexp(z, 0)
            # Lemma C.5 scalings sqrt(a_j / a_max) and sqrt(a_max / a_j): their products are those
            # of D^{1/2} and D^{-1/2}, and they stay in range for tiny masses
            half = ((lw - lw.max().detach()) / 2)[:, None]
            out = jv(lambda Q: op.points_map(Q, lw, pos), Y, v * torch.exp(-half))
            return out * torch.exp(half)
        return h

    sigma, (gP, gz) = _vjp_of_jvp(build, (P, lw0))
    return SigmaGradient(sigma, gP[0], gz)
