"""Mass splitting: the closed form of docs/math.md section 4.7, for any operator.

Splitting an atom (x_i, a_i) into parts at the same point leaves the measure unchanged but lets the
parts move apart. Perturbations of the parts that keep their mass-weighted mean fixed leave every
softmax's key side unchanged to first order, so only the *query* derivative

    Q_i = d/dx Gamma_mu(x) at x = x_i    (keys, weights and positions held fixed; d_out x d)

acts on them, and in the weighted inner product of Lemma C.5 they are orthogonal to the unsplit
perturbations. Hence, for any splitting of the atoms of a set I (any fractions),

    Lip(split) = max( Lip_mu(F), max_{i in I} ||Q_i||_2 ),

and splitting every atom once gives the supremum over splittings, a lower bound of the W2 local
constant at mu (section 4.7). For single-head attention Q_i = V Sigma_mu(x_i) A (section 4.1); the
argument uses only that Gamma_mu(x) is differentiable and depends on the keys through mu alone (two
parts of one atom act as the merged atom: true of every softmax head, so of multi-head layers, biases,
L2 heads and the Hugging Face layers, and of the USA field). It applies to every operator of the
protocol that evaluates queries against weighted keys (not to points-only callables, which are
refused). The query derivatives are forward-mode JVPs under torch's math attention backend, and
reverse-over-reverse products where an operator has no forward-mode rule (torch's fused attention
kernels: ``nn.MultiheadAttention``, Hugging Face layers on SDPA), through the same fallback as
:func:`meanfield.sigma_gradient.sigma_gradient` (:func:`~meanfield.sigma_gradient.with_jacobian_products`).

:func:`meanfield.bounds.query_term_norms` is the same ||Q_i||_2 written out for one head,
V Sigma_mu(x_i) A, in numpy; this module differentiates the operator instead, so the two check each
other (tests/meanfield/test_worst_case.py), and both combine through
:func:`meanfield.bounds.split_constant`.
"""

from __future__ import annotations

import math
import operator as _operator
from dataclasses import dataclass

import torch
from torch.func import grad

from particles import Measure

from .adapters import as_operator
from .bounds import split_constant
from .jacobian import Jacobian, make_problems, norms
from .lipschitz import LipschitzEstimate, local_lipschitz
from .operator import WRAP_POINTS
from .sigma_gradient import with_jacobian_products

__all__ = ["SplitConstant", "query_jacobians", "split_lipschitz", "split_measure", "query_term_gradient",
           "ESTIMATE_RTOL"]


def _setup(f, mu):
    op = as_operator(f)
    mu = op.check_measure(mu, "mu", tensors=f"splitting acts on measures: {WRAP_POINTS}")
    if op.points_only:
        raise TypeError(f"f: {op!r} is points-only; the query derivative needs an operator that evaluates "
                        "queries against keys (a meanfield operator or a Hugging Face layer)")
    pos = mu.positions if op.masked else None
    return op, mu, pos


#: relative agreement :func:`split_lipschitz` asks of a given estimate's value and its recomputed ``|J u|`` at mu, by
#: the measure's dtype (the value is that product, certified in float64 for a float32 measure, to rounding)
ESTIMATE_RTOL = {torch.float64: 1e-8, torch.float32: 1e-3}


def _check_estimate(estimate, op, mu) -> None:
    """``estimate`` is the unsplit estimate of ``op`` at ``mu``: a LipschitzEstimate of one input whose vector u has
    mu's shape and whose value is ``|J u|`` at mu (one Jacobian product); TypeError / ValueError naming it."""
    if not isinstance(estimate, LipschitzEstimate):
        raise TypeError(f"estimate: expected the LipschitzEstimate of local_lipschitz(f, mu), got "
                        f"{type(estimate).__name__}")
    if estimate.batched:
        raise ValueError(f"estimate: holds a batch of {len(estimate)} estimates; give the one of mu")
    u = estimate.vector
    if not isinstance(u, torch.Tensor) or tuple(u.shape) != tuple(mu.points.shape):
        shape = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
        raise ValueError(f"estimate: its vector has shape {shape} where mu's points have {tuple(mu.points.shape)}; "
                         "give the estimate of local_lipschitz(f, mu)")
    _, (problem,), _ = make_problems(op, mu)
    jac = Jacobian(problem.fn, problem.X, problem.s_in, problem.s_out)
    w = jac.J(u.detach().to(problem.X).unsqueeze(0))   # J u / c, c the power of two its first product sets
    got = float(norms(w).flatten()[0]) * float(jac.scale.flatten()[0])
    rtol = ESTIMATE_RTOL.get(mu.dtype, 1e-2)
    if not abs(got - estimate.value) <= rtol * max(abs(got), abs(estimate.value)):
        raise ValueError(f"estimate: its value {estimate.value:.6g} is not |J u| = {got:.6g} of f at mu for its vector "
                         "u: an estimate of another operator or measure; give the estimate of local_lipschitz(f, mu)")


def _atom(atom, n: int, name: str = "atom") -> int:
    """An atom index: an integer (not a bool, not a float) in [0, n)."""
    is_bool = isinstance(atom, bool) or (isinstance(atom, torch.Tensor) and atom.dtype == torch.bool) \
        or type(atom).__name__ == "bool_"
    try:
        if is_bool:
            raise TypeError
        i = _operator.index(atom)
    except TypeError:
        raise TypeError(f"{name}: expected an atom index (an integer), got {type(atom).__name__} {atom!r}") from None
    if not 0 <= i < n:
        raise IndexError(f"{name}: expected an atom index in [0, {n}) (the measure has {n} atoms), got {i}")
    return i


def _query_block(op, x, keys, lw, q_pos, k_pos, jv):
    """(m, d_out, d) derivatives of the outputs at queries x (m, d) in x alone, by d Jacobian-vector
    products ``jv`` (one per input coordinate, all queries at once: query i's output depends on query
    i only)."""
    d = x.shape[-1]
    fn = lambda q: op.evaluate(q, keys, lw, q_pos, k_pos)
    cols = []
    for k in range(d):
        e = torch.zeros_like(x)
        e[:, k] = 1.0
        cols.append(jv(fn, x, e))
    return torch.stack(cols, dim=-1)


def query_jacobians(f, mu) -> torch.Tensor:
    """Q_i = d/dx Gamma_mu(x) at x = x_i for every atom, shape (N, d_out, d) (keys held fixed;
    masked operators: the query at the atom's own position). docs/math.md section 4.7."""
    op, mu, pos = _setup(f, mu)
    X = mu.points.detach()
    lw = mu.log_weights.detach()
    return with_jacobian_products(lambda jv: _query_block(op, X, X, lw, pos, pos, jv)).detach()


def split_measure(mu: Measure, atoms) -> Measure:
    """The same measure with each atom in ``atoms`` split into two halves at the same point (and
    position): the representation whose constant :func:`split_lipschitz` gives."""
    if not isinstance(mu, Measure):
        raise TypeError(f"mu: expected a particles.Measure, got {type(mu).__name__}")
    if isinstance(atoms, (str, bytes)) or not hasattr(atoms, "__iter__"):
        raise TypeError(f"atoms: expected an iterable of atom indices, got {type(atoms).__name__}")
    chosen = {_atom(a, mu.n, "atoms") for a in atoms}
    out = mu
    for i in sorted(chosen, reverse=True):  # from the end: indices stay valid
        out = out.split(i, 0.5)
    return out


@dataclass(frozen=True)
class SplitConstant:
    """max(Lip_mu(F), max_i ||Q_i||_2): the local constant with every atom split (section 4.7).

    ``unsplit`` is the certified estimate without splitting, ``query_norms`` (N,) the ||Q_i||_2 (dense,
    exact to rounding), ``atom`` the atom of largest query norm, ``helps`` whether splitting it raises
    the constant (its query norm exceeds ``unsplit.value``).
    """

    value: float
    unsplit: LipschitzEstimate
    query_norms: torch.Tensor
    atom: int
    helps: bool


def split_lipschitz(f, mu, *, method="lanczos", tol=None, max_iter=None, seed=0, on_failure="warn",
                    estimate: LipschitzEstimate | None = None) -> SplitConstant:
    """The local W2 constant of F at mu with atoms allowed to split (docs/math.md section 4.7).

    Parameters
    ----------
    f : anything :func:`meanfield.as_operator` accepts, except bare callables
    mu : Measure
        Weights and, for masked operators, positions held fixed.
    method, tol, max_iter, seed : passed to :func:`meanfield.local_lipschitz` for the unsplit constant (``tol=None``:
        its default for the measure's dtype, 1e-6 in float64 and 1e-3 in float32)
    on_failure : str
        What an unsplit estimate that misses ``tol`` does: "warn" (the default: a RuntimeWarning, and the estimate
        kept with ``converged=False`` in ``unsplit``; a Rayleigh quotient, so still a lower bound) or "raise" (its
        :class:`~particles.validation.ConvergenceError`).
    estimate : LipschitzEstimate or None
        The unsplit estimate, when already computed (the four arguments above are then not used): that of
        ``local_lipschitz(f, mu)``. Checked with one Jacobian product: its vector must be shaped like mu's points
        and give its value, ``|J u|``, at mu (to :data:`ESTIMATE_RTOL` of the dtype), else a ValueError naming it.

    Returns
    -------
    SplitConstant, whose ``value`` is max(unsplit value, max_i ||Q_i||_2). Its unsplit part is a
    certified lower bound (a Rayleigh quotient) and the query norms are dense, so ``value`` is a
    lower bound of the split constant; :func:`split_measure` gives the representation to certify
    with :func:`meanfield.local_lipschitz` directly.

    Examples
    --------
    >>> import torch
    >>> from particles import Measure
    >>> from meanfield import SelfAttention
    >>> from meanfield.splitting import split_lipschitz
    >>> op = SelfAttention(torch.tensor([[-0.5612]]), torch.tensor([[-0.8676]]))
    >>> mu = Measure(torch.tensor([[9.198], [-0.232]]), torch.tensor([0.25, 0.75]))
    >>> s = split_lipschitz(op, mu)
    >>> s.helps, s.atom
    (True, 1)
    """
    op, mu, pos = _setup(f, mu)
    if estimate is None:
        estimate = local_lipschitz(op, mu, method, tol=tol, max_iter=max_iter, seed=seed, on_failure=on_failure)
    else:
        _check_estimate(estimate, op, mu)
    Q = query_jacobians(op, mu)
    present = torch.isfinite(mu.log_weights)
    Q = torch.where(present[:, None, None], Q, torch.zeros_like(Q))   # atoms of mass 0 cannot split
    norms = torch.linalg.matrix_norm(Q, ord=2) if bool(torch.isfinite(Q).all()) else None
    if norms is None or not bool(torch.isfinite(norms).all()):
        # not passed on: the SVD fails on a NaN, and the max of split_constant would drop one
        raise OverflowError(f"mu: the query derivative Q_i is not finite at some atom (beyond the range of "
                            f"{mu.points.dtype}); use float64 or a smaller radius")
    atom = int(norms.argmax())
    top = float(norms[atom])
    value = split_constant(estimate.value, norms.cpu().numpy(), [atom])
    return SplitConstant(value, estimate, norms, atom, top > estimate.value)


def query_term_gradient(f, mu, atom: int):
    """||Q_atom||_2 and its gradient in the points and in the logits of the weights.

    At a simple top singular pair (u, v) of Q_atom, d||Q|| = <u, dQ v>, with Q_atom a function of
    all the atoms (as keys) and of x_atom (also as the query). Returns (value, grad_points (N, d),
    grad_logits (N,)).
    """
    op, mu, pos = _setup(f, mu)
    X0 = mu.points.detach()
    z0 = mu.log_weights.detach()
    if not bool(torch.isfinite(z0).all()):
        raise ValueError("mu: the measure has atoms of zero mass; drop them")
    i = _atom(atom, mu.n)
    q_pos = None if pos is None else pos[i:i + 1]

    def run(jv):
        def Q(Y, z):
            lw = z - torch.logsumexp(z, 0)
            return _query_block(op, Y[i:i + 1], Y, lw, q_pos, pos, jv)[0]

        with torch.no_grad():
            U, S, Vh = torch.linalg.svd(Q(X0, z0))
        u, v = U[:, 0], Vh[0]
        return S, grad(lambda Y, z: u @ Q(Y, z) @ v, argnums=(0, 1))(X0, z0)

    S, (gX, gz) = with_jacobian_products(run)
    value = float(S[0])
    if not math.isfinite(value):
        raise OverflowError("mu: the query derivative overflows at this measure")
    return value, gX, gz
