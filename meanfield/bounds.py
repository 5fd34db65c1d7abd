"""The Lipschitz bounds of *How Smooth Is Attention?* (Castin, Ablin, Peyre, ICML 2024) as plain functions.

Every function takes matrices as numpy arrays or torch tensors and returns a Python float
(docs/math.md section 5). Spectral norms ``||.||_2`` throughout. Conventions: scores
``s_ij = <A x_i, x_j>``, values ``V x_j`` with ``V`` of shape (d_out, d), tokens in the ball B_R.

* upper bounds: :func:`sqrt_n_upper` (Thm 3.3 / 4.3), :func:`mean_field_upper` (Thm 3.5; unmasked only:
  Theorem 4.4's stated masked version fails, see :func:`cesaro_norm`), :func:`multihead_upper`
  (Lemma 3.8), :func:`l2_attention_upper` (Kim et al. Thm 3.2);
* lower bounds: :func:`sqrt_n_lower` (Prop 3.4), :func:`two_dirac_lower` (Prop 3.6, asymptotic);
* large radius: :func:`large_radius_limit` (Thm 3.7 / 4.5), :func:`argmax_indices`;
* eigen-structure of A: :func:`gamma`, :func:`gamma_info`.
* biases: :func:`absorb_key_bias` (a key bias as one more coordinate); the best bound known for a
  whole operator, from its parameters, is :func:`meanfield.upper.operator_upper`.
* lower-bound corrections: :func:`two_dirac_ratio` (Prop 3.6's factor 1 + 1/(gamma R^2));
* mass splitting: :func:`query_term_norms`, :func:`split_constant` (docs/math.md section 4.7).

Bounds containing ``exp(c R^2)`` accept ``log=True`` and then return the natural logarithm of the
bound, finite while its exponent is (c R^2 below about 1.8e308: R up to about 1e153 for c = 2). Their plain
value is ``math.inf`` only when the true number exceeds the float64 range (about 1.8e308), and then with a
:class:`BoundOverflowWarning` that gives the logarithm; so is a logarithm that overflows; never NaN.
"""

from __future__ import annotations

import importlib
import math
import numbers
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from particles.linkage import linked_components
from particles.validation import (
    as_tensor,
    check_allocation,
    check_bool,
    check_positive_float,
    check_positive_int,
    check_radius,
    scalar,
)

__all__ = [
    "BoundOverflowWarning",
    "GammaInfo",
    "absorb_key_bias",
    "argmax_indices",
    "augmented_head_norms",
    "biased_multihead_upper",
    "cesaro_norm",
    "gamma",
    "gamma_info",
    "eigen_cases",
    "gamma_info_factored",
    "l2_attention_upper",
    "large_radius_limit",
    "large_radius_sup",
    "lambert_phi_inverse",
    "mean_field_upper",
    "multihead_upper",
    "query_term_norms",
    "score_gap",
    "spectral_norm",
    "split_constant",
    "sqrt_n_lower",
    "sqrt_n_lower_from_gamma",
    "sqrt_n_regime_length",
    "sqrt_n_regime_radius",
    "sqrt_n_upper",
    "two_dirac_lower",
    "two_dirac_lower_from_gamma",
    "two_dirac_ratio",
    "two_dirac_ratio_from_gamma",
]


# ---------------------------------------------------------------------------- helpers
def _matrix(M, name: str) -> np.ndarray:
    t = as_tensor(M, name, dtype=torch.float64)
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a matrix (2-D), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty matrix, got shape {tuple(t.shape)}")
    return t.detach().cpu().numpy()


def _check_scores_memory(n: int, what: str) -> None:
    """The (n, n) float64 score matrix of every token against every other, and the two copies the
    argmax and the runner-up take: checked against the memory limit before they are allocated."""
    check_allocation(3 * 8 * n * n, f"{what}: the ({n}, {n}) score matrix of X", "give fewer tokens (rows of X)")


def _square(A, name: str = "A") -> np.ndarray:
    a = _matrix(A, name)
    if a.shape[0] != a.shape[1]:
        raise ValueError(f"{name}: expected a square (d, d) matrix, got shape {a.shape}")
    return a


def _A_V(A, V) -> tuple[np.ndarray, np.ndarray]:
    a = _square(A)
    v = _matrix(V, "V")
    if v.shape[1] != a.shape[0]:
        raise ValueError(f"V: expected {a.shape[0]} columns to match A of shape {a.shape}, got shape {v.shape}")
    return a, v


def spectral_norm(M, name: str = "M") -> float:
    """||M||_2, the largest singular value of a matrix (numpy or torch)."""
    return float(np.linalg.norm(_matrix(M, name), 2))


def _check_log(log) -> bool:
    return check_bool(log, "log")


class BoundOverflowWarning(RuntimeWarning):
    """A bound whose value exceeds float64's range (about exp(709.78)) was returned as ``math.inf``: its
    logarithm (``log=True`` where the function has it) is the number to use."""


def _log_or_inf(log_value: float, what: str, stacklevel: int = 3) -> float:
    """``log_value`` for a ``log=True`` caller, with a :class:`BoundOverflowWarning` where it is inf (the exponent
    itself beyond float64's range, R above about 1e153: math.exp(inf) raises nothing, so it is warned here)."""
    if log_value == math.inf:
        warnings.warn(f"{what}: the bound's logarithm exceeds float64's range (the exponent overflows); returned "
                      "inf", BoundOverflowWarning, stacklevel=stacklevel)
    return log_value


def _exp_or_inf(log_value: float, what: str | None = None, log_option: bool = False) -> float:
    """exp(log_value), math.inf only when the number itself exceeds the float64 range; then, for a public
    bound (``what`` names it), a :class:`BoundOverflowWarning` that gives the logarithm and how to get it."""
    if log_value == -math.inf:
        return 0.0
    if log_value == math.inf:
        return math.inf if what is None else _log_or_inf(log_value, what, stacklevel=4)
    try:
        return math.exp(log_value)
    except OverflowError:
        if what is not None:
            warnings.warn(f"{what}: the bound is exp({log_value:.6g}), beyond float64's range; returned inf"
                          + ("; log=True returns its logarithm" if log_option else ""),
                          BoundOverflowWarning, stacklevel=3)
        return math.inf


# ---------------------------------------------------------------------------- upper bounds
def sqrt_n_upper(A, V, R, n) -> float:
    """Theorem 3.3 (unmasked) and Theorem 4.3 (masked): the Lipschitz constant of self-attention
    on B_R^n is at most ``sqrt(3) ||V||_2 (||A||_2^2 R^4 (4n + 1) + n)^{1/2}``, roughly R^2 sqrt(n).

    The same number bounds masked (causal) self-attention (Theorem 4.3).
    """
    a, v = _A_V(A, V)
    R = check_radius(R, "R")
    n = check_positive_int(n, "n")
    na, nv = float(np.linalg.norm(a, 2)), float(np.linalg.norm(v, 2))
    # in logarithms: n may be an integer beyond float range (10**400), and R^4 may overflow
    log_terms = [math.log(n)]
    if na > 0 and R > 0:
        log_terms.append(2 * math.log(na) + 4 * math.log(R) + math.log(4 * n + 1))
    if nv == 0:
        return 0.0
    top = max(log_terms)
    log_root = 0.5 * (top + math.log(sum(math.exp(t - top) for t in log_terms)))
    return _exp_or_inf(0.5 * math.log(3.0) + math.log(nv) + log_root, "sqrt_n_upper")


def mean_field_upper(A, V, R, *, log: bool = False) -> float:
    """Theorem 3.5 (mean-field, Geshkovski et al. 2023): the W2 Lipschitz constant of unmasked mean-field
    attention on P(B_R) is at most ``||V||_2 (1 + 3 ||A||_2 R^2) exp(2 ||A||_2 R^2)``.

    By Lemma 3.2 it also bounds Lip_X(f) for unmasked sequences X in B_R^n of every length n.
    ``log=True`` returns the natural logarithm of the bound (``-inf`` when V = 0).

    Not for masked attention: the paper's Theorem 4.4 states this same bound for the masked map in the
    conditional W2, and it fails where ||A|| R^2 is small: at A = 0 the masked map is the running mean,
    whose constant is :func:`cesaro_norm` (n) ||V|| on sequences of length n, above ||V|| for n >= 2 and
    tending to 2 ||V|| (docs/math.md section 5.2).
    """
    a, v = _A_V(A, V)
    R = check_radius(R, "R")
    _check_log(log)
    na, nv = float(np.linalg.norm(a, 2)), float(np.linalg.norm(v, 2))
    if nv == 0.0:
        value = -math.inf
    else:
        t = na * R * R
        value = math.log(nv) + math.log1p(3.0 * t) + 2.0 * t
    return _log_or_inf(value, "mean_field_upper") if log else _exp_or_inf(value, "mean_field_upper", log_option=True)


def cesaro_norm(n) -> float:
    """||C_n||_2 of the running-mean matrix (C_n)_ij = 1/i for j <= i: the Lipschitz constant of masked
    attention with A = 0 and V = I on sequences of length n (then f^m(X)_i = (1/i) sum_{j<=i} x_j), in the
    Euclidean sense and, for the sequence's masked measure, in the conditional W2 sense (docs/math.md
    section 5.2). Increases with n to 2 (Hardy's inequality): the counterexample to Theorem 4.4's stated bound.
    Computed as the square root of the largest eigenvalue of C_n^T C_n (n up to a few thousand)."""
    n = check_positive_int(n, "n")
    if n > 20_000:
        raise ValueError(f"n: {n} is too large for a dense n x n matrix here (at most 20000); the limit is 2")
    C = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]
    return float(np.sqrt(np.linalg.eigvalsh(C.T @ C)[-1]))


def multihead_upper(head_lips, W_O) -> float:
    """Lemma 3.8: ``Lip(f_MH) <= ||W_O||_2 (sum_h Lip(f^h)^2)^{1/2}`` for f_MH = W_O concat_h f^h.

    ``head_lips`` are per-head Lipschitz constants (local values at one X or bounds on a set; the
    result is then of the same kind). An output bias does not change the constant.
    """
    lips = as_tensor(head_lips, "head_lips", dtype=torch.float64).detach().cpu()
    if lips.dim() != 1:
        raise ValueError(f"head_lips: expected a list of per-head constants (1-D), got shape {tuple(lips.shape)}")
    lips = lips.numpy()
    if lips.size == 0:
        raise ValueError("head_lips: expected at least one per-head constant")
    if (lips < 0).any():
        raise ValueError(f"head_lips: Lipschitz constants must be non-negative (min is {lips.min():.3g})")
    w = _matrix(W_O, "W_O")
    if w.shape[1] < lips.size:
        # W_O maps the concatenated head outputs, at least one column per head
        raise ValueError(f"W_O: has {w.shape[1]} column(s), fewer than the {lips.size} heads of head_lips (W_O maps "
                         "the concatenation of the heads' outputs: one column per output feature of every head)")
    return float(np.linalg.norm(w, 2) * math.sqrt(float(np.sum(lips * lips))))


# ---------------------------------------------------------------------------- lower bounds
@dataclass(frozen=True)
class GammaInfo:
    """The exponent of Proposition 3.4: gamma = max(lambda_max / 8, -lambda_min).

    ``case`` is ``"max"`` when lambda_max / 8 >= -lambda_min (witness (Ru, Ru/2, ..., Ru/2)) and
    ``"min"`` otherwise (witness (-Ru, Ru, ..., Ru)); ``eigenvalue`` and the unit ``eigenvector``
    u (A u = eigenvalue u) are those of the chosen case. ``transpose_image`` is A^T u: it equals
    ``eigenvalue * u`` only when u is also an eigenvector of A^T (A normal, e.g. symmetric); the
    witness's exact constant (:func:`meanfield.adversarial.sqrt_n_witness_constant`) depends on it.
    None when there is no witness (gamma = 0) or when the record was built without it.
    """

    gamma: float
    case: str
    eigenvalue: float
    eigenvector: np.ndarray
    lambda_max: float
    lambda_min: float
    transpose_image: np.ndarray | None = None


def _case_order(l_max: float, l_min: float) -> list[tuple[str, float]]:
    """Proposition 3.4's two eigen-cases with their exponents, the case of gamma first: ("max",
    lambda_max / 8) counts if lambda_max > 0, ("min", -lambda_min) if lambda_min < 0 (else 0); ties go
    to "max". The one place the framework decides the case (docs/math.md section 5.3)."""
    t_max = l_max / 8.0 if l_max > 0 else 0.0
    t_min = -l_min if l_min < 0 else 0.0
    cases = [("max", t_max), ("min", t_min)]
    return cases if t_max >= t_min else cases[::-1]


def _check_tol(tol):
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not (math.isfinite(tol) and tol >= 0):
        raise ValueError(f"tol: expected a finite tolerance >= 0, got {tol!r}")


#: an eigenvalue of A of modulus at most _ZERO_EIGENVALUE d eps ||A||_2 is 0 up to rounding (eig's backward error)
_ZERO_EIGENVALUE = 64


def _zero_cut(d: int, norm: float) -> float:
    """The modulus below which an eigenvalue of a d x d matrix of spectral norm ``norm`` is rounding noise
    of 0: _ZERO_EIGENVALUE d eps ||A||_2 (the same for A and for its factored form, :func:`gamma_info_factored`)."""
    return _ZERO_EIGENVALUE * d * float(np.finfo(np.float64).eps) * norm


#: eigenvalues closer than this power of eps times ||A||_2 may be one defective eigenvalue that eig split: one of
#: multiplicity k comes out of LAPACK as k values about eps^(1/k) ||A|| apart, a real pair or a complex one (k = 2:
#: 1.5e-8 relative; 90 of 200 rotated 2 x 2 Jordan blocks came out complex in a review); 1/4 covers k up to 4
_SPLIT_POWER = 0.25


def _split_clusters(evals: np.ndarray, radius: float) -> list[np.ndarray]:
    """Groups of at least two eigenvalues linked by distances of at most ``radius`` (single linkage in the complex
    plane, :func:`particles.linkage.linked_components`)."""
    labels = linked_components(np.stack([evals.real, evals.imag], axis=1), radius, what="gamma_info")
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    return [np.flatnonzero(inverse == k) for k in np.flatnonzero(counts > 1)]


def _real_eigen(a: np.ndarray, tol: float, norm: float | None = None, dim: int | None = None):
    """(real eigenvalues, their eigenvectors as columns) of a.

    An eigenvalue counts as real when |Im| <= tol (1 + |lambda|). A defective eigenvalue comes out of eig split
    into k values about eps^(1/k) ||a|| apart (real or complex: far above tol); a group of eigenvalues within
    eps^(1/4) ||a||_2 of each other, further than :func:`_zero_cut` from their mean r, with r real (to tol) and
    a - r I singular to rounding (sigma_min <= :func:`_zero_cut`) is therefore one real eigenvalue r (the mean: the
    trace is exact to rounding), with the singular vector of sigma_min, real, as eigenvector. Eigenvalues within
    :func:`_zero_cut` of 0 are set to exactly 0 (LAPACK returns the zero eigenvalues of a singular a as rounding noise
    of either sign, which would otherwise count as a nonzero gamma). ``norm`` (||a||_2 when None) and ``dim`` (a's
    size when None) set the cut: a factored head passes those of its d x d matrix."""
    evals, evecs = np.linalg.eig(a)
    norm = float(np.linalg.norm(a, 2)) if norm is None else norm
    cut = _zero_cut(a.shape[0] if dim is None else dim, norm)
    single = np.ones(evals.size, dtype=bool)
    lam, vecs = [], []
    for group in _split_clusters(evals, np.finfo(np.float64).eps ** _SPLIT_POWER * norm):
        mean = complex(evals[group].mean())
        if abs(mean.imag) > tol * (1.0 + abs(mean)) or np.abs(evals[group] - mean).max() <= cut:
            # not real, or not split (a semisimple multiple eigenvalue, A = I: eig's own eigenvectors are kept)
            continue
        _, sv, vt = np.linalg.svd(a - mean.real * np.eye(a.shape[0]))
        if sv[-1] <= cut:
            single[group] = False
            lam.append(mean.real)
            vecs.append(vt[-1].astype(evecs.dtype)[:, None])
    real = single & (np.abs(evals.imag) <= tol * (1.0 + np.abs(evals)))
    lam = np.concatenate([evals.real[real], np.asarray(lam, dtype=np.float64)])
    lam = np.where(np.abs(lam) <= cut, 0.0, lam)
    return lam, np.concatenate([evecs[:, real], *vecs], axis=1)


def _eigenvalue_list(evals) -> str:
    """Eigenvalues for a message, with enough digits that a small imaginary part shows."""
    return "[" + ", ".join(f"{z.real:.6g}{z.imag:+.3g}i" for z in np.asarray(evals, dtype=complex)) + "]"


def eigen_cases(A, *, tol: float = 1e-10) -> list[GammaInfo]:
    """Both eigen-cases of Proposition 3.4 that exist (exponent > 0), the case of gamma(A) first:
    case "max" (gamma_case = lambda_max / 8, witness (R u, R u/2, ..., R u/2)) and case "min"
    (gamma_case = -lambda_min, witness (-R u, R u, ..., R u)), each as a :class:`GammaInfo` whose
    ``gamma`` is that case's exponent. Empty when A has no real eigenvalue or gamma(A) = 0. Feed one
    to :func:`meanfield.adversarial.sqrt_n_sequence_from_info` for its witness."""
    a = _square(A)
    _check_tol(tol)
    lam, vecs = _real_eigen(a, tol)
    if lam.size == 0:
        return []
    i_max, i_min = int(np.argmax(lam)), int(np.argmin(lam))
    l_max, l_min = float(lam[i_max]), float(lam[i_min])
    index = {"max": i_max, "min": i_min}
    out = []
    for case, g in _case_order(l_max, l_min):
        if g > 0:
            u = _real_unit_eigenvector(a, float(lam[index[case]]), vecs[:, index[case]])
            out.append(GammaInfo(g, case, float(lam[index[case]]), u, l_max, l_min, a.T @ u))
    return out


def gamma_info(A, *, tol: float = 1e-10) -> GammaInfo:
    """Real eigen-structure of A used by Propositions 3.4 and 3.6 (see :class:`GammaInfo`).

    An eigenvalue counts as real when ``|Im| <= tol (1 + |lambda|)``. A defective one (a Jordan block) comes out of
    eig split into values about eps^(1/k) ||A||_2 apart (k its size; sqrt(eps) for a block of 2), real or complex:
    eigenvalues within eps^(1/4) ||A||_2 of each other whose mean r is real and where ``A - r I`` is singular to
    rounding (smallest singular value at most ``64 d eps ||A||_2``) count as the one real eigenvalue r. An
    eigenvalue counts as 0 when its modulus is at most ``64 d eps ||A||_2`` (rounding noise: a singular A's zero
    eigenvalues come out of LAPACK as numbers of either sign near 1e-17 ||A||). lambda_max / 8 counts only if
    lambda_max > 0 and -lambda_min only if lambda_min < 0; when every real eigenvalue is 0, gamma = 0 (case "max"). A
    matrix with no real eigenvalue raises a ValueError. The case of gamma is the first of
    :func:`eigen_cases`.
    """
    a = _square(A)
    _check_tol(tol)
    lam, vecs = _real_eigen(a, tol)
    if lam.size == 0:
        evals = np.linalg.eigvals(a)
        raise ValueError(f"A: has no real eigenvalue (eigenvalues {_eigenvalue_list(evals)}); "
                         "Proposition 3.4 needs one (a real A of odd dimension always has one)")
    cases = eigen_cases(a, tol=tol)
    if cases:
        return cases[0]
    # every real eigenvalue is 0: gamma = 0, case "max", the eigenvector of lambda_max = 0
    i_max = int(np.argmax(lam))
    u = _real_unit_eigenvector(a, float(lam[i_max]), vecs[:, i_max])
    return GammaInfo(0.0, "max", float(lam[i_max]), u, float(lam.max()), float(lam.min()), a.T @ u)


def _real_unit_eigenvector(a: np.ndarray, lam: float, v: np.ndarray) -> np.ndarray:
    # a real eigenvalue's complex eigenvector is a complex multiple of a real one: take the
    # larger of the real and imaginary parts; fall back to the null space of A - lam I
    u = v.real if np.linalg.norm(v.real) >= np.linalg.norm(v.imag) else v.imag
    if np.linalg.norm(a @ u - lam * u) > 1e-8 * (1 + abs(lam)) * np.linalg.norm(u):
        _, _, vt = np.linalg.svd(a - lam * np.eye(a.shape[0]))
        u = vt[-1]
    u = u / np.linalg.norm(u)
    # a fixed sign makes witnesses reproducible across LAPACK builds
    k = int(np.argmax(np.abs(u)))
    return u if u[k] > 0 else -u


def gamma(A) -> float:
    """gamma(A) = max(lambda_max / 8, -lambda_min) of Proposition 3.4 (see :func:`gamma_info`)."""
    return gamma_info(A).gamma


def sqrt_n_lower(A, R, n) -> float:
    """Proposition 3.4 (V = I_d): the Lipschitz constant of self-attention on B_R^n is at least
    ``sqrt(n - 1) / (1 + (n - 1) exp(-2 gamma R^2))``, gamma from :func:`gamma`.

    Reached or exceeded at the witness :func:`meanfield.adversarial.sqrt_n_sequence` (in case "min"
    the witness's constant matches it to about 1e-4 while (n - 1) exp(-2 gamma R^2) is small, and is above
    it beyond: 5x at n = 1024 with gamma R^2 = 3.1; in case "max" it is above it, at n = 2 by a
    factor that tends to sqrt(2) as exp(-2 gamma R^2) gets small: 2.0, 1.69, 1.415 at gamma R^2 = 0.125, 1.125,
    4.5 for A = I); it grows like sqrt(n) while n << exp(2 gamma R^2).
    """
    g = gamma(A)
    return sqrt_n_lower_from_gamma(g, R, check_positive_int(n, "n"))


def two_dirac_lower(A, R, *, log: bool = False) -> float:
    """Proposition 3.6 (V = I_d): the asymptotic value ``(gamma / 2) R^2 exp(gamma R^2)`` of the
    mean-field Lipschitz constant at the two-Dirac witness
    :func:`meanfield.adversarial.two_dirac` as R grows.

    It is an asymptotic equivalent, not an inequality at every R. ``log=True`` returns its natural
    logarithm (``-inf`` when gamma = 0 or R = 0).
    """
    g = gamma(A)
    R = check_radius(R, "R")
    _check_log(log)
    value = -math.inf if g == 0.0 or R == 0.0 else math.log(g / 2.0) + 2.0 * math.log(R) + g * R * R
    return _log_or_inf(value, "two_dirac_lower") if log else _exp_or_inf(value, "two_dirac_lower", log_option=True)


# ---------------------------------------------------------------------------- large radius
def argmax_indices(A, X, *, masked: bool = False, rtol: float = 1e-9) -> np.ndarray:
    """m_i = argmax_j <A x_i, x_j> (over j <= i when ``masked``), as an int array of length n.

    Raises a ValueError when some row's maximum is not unique: the runner-up score lies within
    ``rtol (1 + |max|)`` of the maximum (Theorems 3.7 / 4.5 need unique maximizers). ``rtol`` is a
    finite number >= 0 (0: only exact ties); NaN or a negative value, which would switch the test
    off, is a ValueError.
    """
    a = _square(A)
    x = _matrix(X, "X")
    if x.shape[1] != a.shape[0]:
        raise ValueError(f"X: expected tokens of dimension {a.shape[0]} to match A, got shape {x.shape}")
    masked = check_bool(masked, "masked")
    rtol = check_positive_float(rtol, "rtol", allow_zero=True)
    _check_scores_memory(x.shape[0], "argmax_indices")
    S = (x @ a.T) @ x.T
    n = S.shape[0]
    if masked:
        S = np.where(np.tril(np.ones((n, n), dtype=bool)), S, -np.inf)
    m = np.argmax(S, axis=1)
    top = S[np.arange(n), m]
    rest = S.copy()
    rest[np.arange(n), m] = -np.inf
    second = rest.max(axis=1)
    ties = np.nonzero(top - second <= rtol * (1.0 + np.abs(top)))[0]
    if ties.size:
        i = int(ties[0])
        raise ValueError(f"X: the maximizer of <A x_i, x_j> over j is not unique for {ties.size} row(s) "
                         f"(first: row {i}, gap {top[i] - second[i]:.3g}); Theorem "
                         f"{'4.5' if masked else '3.7'} needs a unique argmax in every row")
    return m


def large_radius_limit(A, V, X, *, masked: bool = False, rtol: float = 1e-9) -> float:
    """The norm of the Jacobian's limit of Theorem 3.7 (unmasked) / Theorem 4.5 (masked): ``lim_{R -> inf}
    Lip_{RX}(f) = ||V||_2 sqrt(max_j #{i : m_i = j})`` with m_i from :func:`argmax_indices` (j <= i if masked). The
    theorems give the limit D_{RX} f and the bound ||V||_2 sqrt(n); its norm is this framework's step
    (docs/math.md section 5.5).

    The convergence is exponentially fast in R^2; X is the direction (n, d). Raises when some
    argmax is not unique.
    """
    a, v = _A_V(A, V)
    m = argmax_indices(a, X, masked=masked, rtol=rtol)
    mult = int(np.bincount(m).max())
    return float(np.linalg.norm(v, 2) * math.sqrt(mult))


# ---------------------------------------------------------------------------- Kim et al. (L2 attention)
def lambert_phi_inverse(x) -> float:
    """phi^{-1}(x) for phi(t) = t exp(t + 1), t >= 0: W_0(x / e) (principal Lambert W), O(log x)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or x < 0 or (
            not isinstance(x, numbers.Integral) and not math.isfinite(x)):
        raise ValueError(f"x: expected a finite non-negative number, got {x!r}")
    if isinstance(x, numbers.Integral) and x > 1e300:
        # an integer beyond float range (a length of 10^400): W_0(y) solves w + log w = log y, by Newton's method from
        # log y (math.log takes integers of any size); W_0(y) is about log y - log log y there, near 690 and beyond
        L = math.log(x) - 1.0
        w = L - math.log(L)
        for _ in range(50):
            step = (w + math.log(w) - L) / (1.0 + 1.0 / w)
            w -= step
            if abs(step) <= 4 * math.ulp(w):
                break
        return w
    from scipy.special import lambertw

    return float(lambertw(float(x) / math.e, 0).real)


def _heads(W, name: str) -> list[np.ndarray]:
    """Per-head matrices from a list of (D, k) matrices, one (D, k) matrix or an (H, D, k) array."""
    if isinstance(W, (list, tuple)):
        mats = [_matrix(w, f"{name}[{h}]") for h, w in enumerate(W)]
    else:
        t = as_tensor(W, name, dtype=torch.float64).detach().cpu()
        if t.dim() not in (2, 3):
            raise ValueError(f"{name}: expected (D, k), (H, D, k) or a list of (D, k) matrices, "
                             f"got shape {tuple(t.shape)}")
        mats = [m.numpy() for m in (t[None] if t.dim() == 2 else t)]
    if not mats or any(m.size == 0 for m in mats):
        raise ValueError(f"{name}: expected at least one non-empty head")
    for h, w in enumerate(mats):
        if w.shape[0] != mats[0].shape[0]:
            raise ValueError(f"{name}[{h}]: expected {mats[0].shape[0]} rows (the model dimension), "
                             f"got shape {w.shape}")
    return mats


def l2_attention_upper(W_Q, W_V=None, W_O=None, N=None, *, norm: str = "2") -> float:
    """Kim, Papamakarios, Mnih (ICML 2021), Theorem 3.2: Lipschitz bounds of L2 multi-head attention.

    Layout (row tokens, X of shape (N, D)): head h has tied query/key weights ``W_Q[h]`` (D, k),
    scores ``P_ij = softmax_j(-|W_Q^T x_i - W_Q^T x_j|^2 / sqrt(k))``, output
    ``P X A_h W_V[h]`` with ``A_h = W_Q W_Q^T / sqrt(k)`` and ``W_V[h]`` (D, k_v); heads are
    concatenated and multiplied by ``W_O`` (H k_v, D_out). A single head may be given as plain
    matrices. k = D/H in Kim et al.; here k is read from each W_Q[h].

    ``norm="inf"`` (as recalled; it held on every case tried): ``(4 phi^{-1}(N-1) + 1/sqrt(k)) ||W_O^T||_inf
    max_h ||W_Q^h||_inf ||W_Q^h^T||_inf max_h ||W_V^h^T||_inf``.

    ``norm="2"``: ``(sqrt(N)/sqrt(k)) (4 phi^{-1}(N-1) + 1) (sum_h ||W_Q^h||_2^4 ||W_V^h||_2^2)^{1/2}
    ||W_O||_2``. The form as commonly recalled, with ``||W_Q^h||_2^2`` inside the sum, is false
    (docs/math.md section 5): it scales linearly in W_Q while L2 attention scales quadratically (at
    N = 1 the map is x -> x A W_V W_O, of constant ||W_Q W_Q^T W_V W_O||_2 / sqrt(k)); the tests
    check a counterexample and the fourth-power form on random and adversarial inputs. Both forms, and the
    theorem's number, are as recalled (the published PDF was not consulted); the fourth power is what a per-head
    factor ||W_Q||_2 ||W_Q^T||_2, as the infinity-norm form has, gives.

    phi^{-1}(N-1) = W_0((N-1)/e) (:func:`lambert_phi_inverse`). Different heads may have
    different k; the factor 1/sqrt(k) is then taken per head (largest value for ``"inf"``).

    ``W_Q`` may be a list of (D, k) matrices, an (H, D, k) array or a (D, k) matrix; ``W_V``
    likewise; ``W_O=None`` is the identity (plain concatenation). For an operator, use
    :func:`meanfield.upper.operator_upper` (passing it as the first argument still works, with a
    DeprecationWarning). The theorem is stated for unmasked attention.
    """
    if callable(getattr(W_Q, "parameters", None)):
        # an operator in the W_Q argument (the previous release's spelling): read its parameter record
        warnings.warn("l2_attention_upper(op, N=...): passing an operator is deprecated; use "
                      "meanfield.operator_upper(op, R, n) or pass its matrices", DeprecationWarning, stacklevel=2)
        if W_V is not None or W_O is not None:
            raise ValueError("W_V, W_O: give them only with matrices, not with an L2SelfAttention operator")
        p = W_Q.parameters()
        if p is None or p.kind != "l2":
            raise ValueError("W_Q: expected matrices, or an operator made of L2 heads")
        for h, head in enumerate(p.heads):
            if (head.key_bias is not None and bool((head.key_bias != 0).any())) or head.scale < 0:
                raise ValueError(f"W_Q: L2 head {h} has a key bias or a negative scale, which Kim et al.'s bound "
                                 "does not cover (meanfield.operator_upper says so)")
        # the record's scale s in Kim et al.'s layout, which builds in 1/sqrt(k): W_Q = sqrt(s sqrt(k)) Q^T
        # (meanfield.upper, docs/math.md section 5.8)
        W_Q = [h.Q.T * math.sqrt(h.scale * math.sqrt(h.Q.shape[0])) for h in p.heads]
        W_V, W_O = [h.V.T for h in p.heads], None if p.W_O is None else p.W_O.T
    if W_V is None:
        raise ValueError("W_V: the value weights are required")
    if N is None:
        raise ValueError("N: the sequence length is required")
    N = check_positive_int(N, "N")
    if norm not in ("2", "inf"):
        raise ValueError(f"norm: expected '2' or 'inf', got {norm!r}")
    WQ = _heads(W_Q, "W_Q")
    D = WQ[0].shape[0]
    WV = _heads(W_V, "W_V")
    if WV[0].shape[0] != D:
        raise ValueError(f"W_V: expected {D} rows to match W_Q, got shape {WV[0].shape}")
    if len(WV) != len(WQ):
        raise ValueError(f"W_V: expected one value matrix per head ({len(WQ)}), got {len(WV)}")
    kv = sum(w.shape[1] for w in WV)
    wo = np.eye(kv) if W_O is None else _matrix(W_O, "W_O")
    if wo.shape[0] != kv:
        raise ValueError(f"W_O: expected {kv} rows (concatenated head outputs), got shape {wo.shape}")
    c = lambert_phi_inverse(N - 1)
    ks = [w.shape[1] for w in WQ]
    if norm == "2":
        terms = [(4.0 * c + 1.0) ** 2 * np.linalg.norm(q, 2) ** 4 * np.linalg.norm(v, 2) ** 2 / k
                 for q, v, k in zip(WQ, WV, ks)]
        if N > 1e300:
            # sqrt(N) in logarithms: N an integer beyond float range (10^400), as the other bounds take it
            if sum(terms) == 0 or np.linalg.norm(wo, 2) == 0:
                return 0.0
            return _exp_or_inf(0.5 * math.log(N) + 0.5 * math.log(sum(terms)) + math.log(np.linalg.norm(wo, 2)),
                               "l2_attention_upper")
        return float(math.sqrt(N) * math.sqrt(sum(terms)) * np.linalg.norm(wo, 2))
    inf = np.inf
    q_term = max((4.0 * c + 1.0 / math.sqrt(k)) * np.linalg.norm(q, inf) * np.linalg.norm(q.T, inf)
                 for q, k in zip(WQ, ks))
    v_term = max(np.linalg.norm(v.T, inf) for v in WV)
    return float(np.linalg.norm(wo.T, inf) * q_term * v_term)


# ---------------------------------------------------------------------------- from what a study already has
# The entry points below take gamma, norms or factored heads instead of the matrix A, for callers that
# computed those once (a real layer's heads, a sweep of many radii) or cannot form A at all (n beyond
# the integers). They evaluate the same formulas as the functions above (docs/math.md section 5).
def _gamma_value(gamma) -> float:
    gamma = scalar(gamma, "gamma")
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Real):
        raise TypeError(f"gamma: expected a real number, got {type(gamma).__name__}")
    g = float(gamma)
    if not math.isfinite(g) or g < 0:
        raise ValueError(f"gamma: expected a finite number >= 0, got {g}")
    return g


def _length(n, name: str = "n"):
    """A length n >= 1: a float, or a Python int kept exact when it exceeds the float range."""
    n = scalar(n, name)
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(n).__name__}")
    if isinstance(n, numbers.Integral) and int(n) >= 1:
        return int(n) if int(n) > 2**1000 else float(n)
    x = float(n)
    if not math.isfinite(x) or x < 1:
        raise ValueError(f"{name}: expected a finite number >= 1, got {n!r}")
    return x


def sqrt_n_lower_from_gamma(gamma, R, n) -> float:
    """Proposition 3.4 from gamma: ``sqrt(n - 1) / (1 + (n - 1) exp(-2 gamma R^2))``.

    The value :func:`sqrt_n_lower` gives for a matrix A with ``gamma(A) = gamma``. ``n`` may be any
    real >= 1: the proposition is about sequences (integer n); at other n this is the same formula
    evaluated on the two-atom family (1/n, (n-1)/n) of :func:`meanfield.adversarial.sqrt_n_measure`,
    and n may exceed the range of integers a caller can form (10^15 and beyond).
    """
    g = _gamma_value(gamma)
    R = check_radius(R, "R")
    n = _length(n)
    if isinstance(n, float):
        return float(math.sqrt(n - 1) / (1.0 + (n - 1) * math.exp(-2.0 * g * R * R)))
    # n beyond the float range (10**400): in logarithms
    log_m = math.log(n - 1)
    t = log_m - 2.0 * g * R * R                      # log((n-1) e^{-2 gamma R^2}), of either sign (large R)
    log1p_et = max(t, 0.0) + math.log1p(math.exp(-abs(t)))   # log(1 + e^t) without overflow
    return _exp_or_inf(0.5 * log_m - log1p_et, "sqrt_n_lower_from_gamma")


def two_dirac_lower_from_gamma(gamma, R, *, log: bool = False) -> float:
    """Proposition 3.6 from gamma: the asymptotic value ``(gamma / 2) R^2 exp(gamma R^2)``
    (as :func:`two_dirac_lower`); ``log=True`` returns its natural logarithm (``-inf`` when gamma = 0
    or R = 0)."""
    g = _gamma_value(gamma)
    R = check_radius(R, "R")
    _check_log(log)
    value = -math.inf if g == 0.0 or R == 0.0 else math.log(g / 2.0) + 2.0 * math.log(R) + g * R * R
    what = "two_dirac_lower_from_gamma"
    return _log_or_inf(value, what) if log else _exp_or_inf(value, what, log_option=True)


def sqrt_n_regime_radius(gamma, n) -> float:
    """The radius R at which ``exp(2 gamma R^2) = n``: ``sqrt(log(n) / (2 gamma))``.

    Proposition 3.4's bound grows like sqrt(m) for lengths m << exp(2 gamma R^2) and saturates
    beyond; a study that wants a whole grid of lengths in the sqrt(n) regime takes R at least this
    radius for n well above its largest length (say 1000 times).
    """
    g = _gamma_value(gamma)
    n = _length(n)
    if g == 0.0:
        raise ValueError("gamma: is 0, so exp(2 gamma R^2) = 1 at every radius and no radius reaches n")
    return math.sqrt(math.log(n) / (2.0 * g))


def sqrt_n_regime_length(gamma, R) -> float:
    """``exp(2 gamma R^2)``: the length near which Proposition 3.4's sqrt(n) growth stops (math.inf
    beyond the float64 range)."""
    g = _gamma_value(gamma)
    R = check_radius(R, "R")
    return _exp_or_inf(2.0 * g * R * R)


def _heads_tensor(M, name: str, ndim: int) -> torch.Tensor:
    t = as_tensor(M, name, dtype=torch.float64)
    if t.dim() == ndim - 1:
        t = t[None]
    if t.dim() != ndim or t.numel() == 0:
        raise ValueError(f"{name}: expected {'(H, k, d) or (k, d)' if ndim == 3 else '(H, k) or (k,)'}, "
                         f"got shape {tuple(t.shape)}")
    return t


def gamma_info_factored(Q, K, scale=1.0, *, tol: float = 1e-10) -> GammaInfo:
    """:func:`gamma_info` of a factored head ``A = scale K^T Q`` (Q, K of shape (k, d)), from the
    k x k matrix ``scale Q K^T``.

    Both have the same nonzero eigenvalues: if ``scale Q K^T w = lambda w`` then ``A w' = lambda w'``
    for ``w' = K^T w``. When k < d, A has rank at most k, so 0 is an eigenvalue too; it never
    changes gamma. The cost is that of a k x k eigenproblem instead of d x d (a Transformer head:
    k = 64, d = 768). When gamma = 0 there is no witness: ``eigenvector`` is None. Eigenvalues of
    modulus at most ``64 d eps ||A||_2`` count as 0, as in :func:`gamma_info` (||A||_2 from the
    factors, ``_factored_norm``), so that the two agree on a head whose gamma is exactly 0. When k > d
    the k x k matrix has k - d zero eigenvalues that A lacks: A (d x d, the smaller problem) is formed
    and the result is :func:`gamma_info`'s (with its eigenvector when gamma = 0)."""
    Qt, Kt = as_tensor(Q, "Q", dtype=torch.float64), as_tensor(K, "K", dtype=torch.float64)
    if Qt.dim() != 2 or Qt.shape != Kt.shape or Qt.numel() == 0:
        raise ValueError(f"Q, K: expected two (k, d) matrices of the same shape, got {tuple(Qt.shape)} and "
                         f"{tuple(Kt.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale: expected a finite real number, got {scale!r}")
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not tol >= 0:
        raise ValueError(f"tol: expected a number >= 0, got {tol!r}")
    if Qt.shape[0] > Qt.shape[1]:
        # k > d: the k x k matrix has k - d zero eigenvalues that A lacks (its rank is at most d), and A is the
        # smaller problem: gamma_info on it
        try:
            return gamma_info(scale * Kt.T @ Qt, tol=tol)
        except ValueError as exc:
            raise ValueError(f"Q, K: A = scale K^T Q has no real eigenvalue; Proposition 3.4 does not apply "
                             f"({exc})") from None
    M = (scale * Qt @ Kt.T).cpu().numpy()
    lam, W = _real_eigen(M, tol, abs(scale) * float(_factored_norm(Kt[None], Qt[None])[0]), Qt.shape[-1])
    lam_k = lam
    lam = np.concatenate([lam, [0.0]]) if Qt.shape[-1] > Qt.shape[0] else lam
    if lam.size == 0:
        raise ValueError("Q, K: A = scale K^T Q has no real eigenvalue; Proposition 3.4 does not apply")
    l_max, l_min = float(lam.max()), float(lam.min())
    case, g = _case_order(l_max, l_min)[0]
    lam_c = l_max if case == "max" else l_min
    if lam_c == 0.0:
        return GammaInfo(0.0, case, 0.0, None, l_max, l_min)
    i = int(np.argmin(np.abs(lam_k - lam_c)))
    w = W[:, i].real if np.linalg.norm(W[:, i].real) >= np.linalg.norm(W[:, i].imag) else W[:, i].imag
    u = Kt.T.cpu().numpy() @ w
    u = u / np.linalg.norm(u)
    u = u if u[int(np.argmax(np.abs(u)))] > 0 else -u   # a fixed sign: reproducible witnesses
    # A^T u = scale Q^T (K u), without forming the d x d matrix
    w_t = scale * (Qt.T.cpu().numpy() @ (Kt.cpu().numpy() @ u))
    return GammaInfo(g, case, lam_c, u, l_max, l_min, w_t)


def _factored_norm(K: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """``||K_h^T M_h||_2`` per head for K (H, k, d) and M (H, k, m), without the d x m product: with the
    reduced QR factorization ``K_h^T = U_h T_h`` (U_h with orthonormal columns, T_h of shape
    (min(k, d), k)), ``||K_h^T M_h||_2 = ||T_h M_h||_2``. No condition on K: a zero or linearly
    dependent key unit, or k > d, only makes T_h singular."""
    T = torch.linalg.qr(K.transpose(-1, -2), mode="r").R
    return torch.linalg.matrix_norm(T @ M, ord=2)


def augmented_head_norms(Q, K, V, b_Q=None, b_V=None, scale=1.0) -> tuple[np.ndarray, np.ndarray]:
    """``(||A'_h||_2, ||V'_h||_2)`` for every head of a layer with biases, as arrays of length H.

    Head h scores ``scale <Q_h x_i + b_Q, K_h x_j + b_K>`` and values ``V_h x_j + b_V`` (Q_h, K_h of
    shape (k, d), V_h (k_v, d); Q, K, V of shape (H, k, d) or one head (k, d)). Terms constant in j
    leave the softmax unchanged, so with x' = (x, 1) the head is self-attention with
    ``A'_h = scale [K_h^T; 0] [Q_h, b_Q]`` and ``V'_h = [V_h, b_V]`` on (d+1)-dimensional tokens of
    radius sqrt(R^2 + 1): Theorems 3.3 / 4.3 apply with these norms (:func:`biased_multihead_upper`).
    With the reduced QR factorization K_h^T = U T (U with orthonormal columns),
    ``||A'_h|| = |scale| ||T [Q_h, b_Q]||``, a min(k, d) x (d+1) matrix (``_factored_norm``): no d x d
    matrix, and no condition on K_h (a pruned, zero key unit, or k > d, is fine). ``b_K`` does not
    enter. Missing biases are zero.

    This is the lift of :func:`absorb_key_bias` at t = 1, in factored form (no d x d matrix is
    formed, which keeps it cheap for every head of every layer of a real model), with b_V kept in
    V'. :func:`operator_upper` is tighter: it picks the best t per head and drops b_V, which adds a
    constant to the output and changes no Lipschitz constant. Use this pair for a quick bound of many
    layers; use :func:`operator_upper` for the best bound of one operator.
    """
    Qh, Kh, Vh = (_heads_tensor(M, name, 3) for M, name in ((Q, "Q"), (K, "K"), (V, "V")))
    H, k, d = Qh.shape
    if Kh.shape != Qh.shape or Vh.shape[0] != H or Vh.shape[2] != d:
        raise ValueError(f"Q, K, V: expected Q and K of the same shape and V with {H} heads of width {d}, got "
                         f"{tuple(Qh.shape)}, {tuple(Kh.shape)}, {tuple(Vh.shape)}")
    bQ = torch.zeros(H, k, dtype=Qh.dtype, device=Qh.device) if b_Q is None else _heads_tensor(b_Q, "b_Q", 2)
    bV = (torch.zeros(H, Vh.shape[1], dtype=Vh.dtype, device=Vh.device) if b_V is None
          else _heads_tensor(b_V, "b_V", 2))
    if bQ.shape != (H, k) or bV.shape != (H, Vh.shape[1]):
        raise ValueError(f"b_Q, b_V: expected shapes {(H, k)} and {(H, Vh.shape[1])}, got {tuple(bQ.shape)} and "
                         f"{tuple(bV.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale: expected a finite real number, got {scale!r}")
    a = abs(scale) * _factored_norm(Kh, torch.cat([Qh, bQ[:, :, None]], 2))
    v = torch.linalg.matrix_norm(torch.cat([Vh, bV[:, :, None]], 2), ord=2)
    return a.cpu().numpy().astype(np.float64), v.cpu().numpy().astype(np.float64)


def biased_multihead_upper(a_norms, v_norms, w_norm, R, n) -> float:
    """Lemma 3.8 with Theorem 3.3 / 4.3 per bias-augmented head: an upper bound on the Lipschitz
    constant of a multi-head layer with biases on sequences of n tokens of norm at most R,
    ``||W_O||_2 (sum_h 3 ||V'_h||^2 (||A'_h||^2 R'^4 (4n + 1) + n))^{1/2}`` with ``R'^2 = R^2 + 1``.

    ``a_norms``, ``v_norms``: the per-head norms of :func:`augmented_head_norms` (finite, >= 0);
    ``w_norm``: ``||W_O||_2`` (finite, >= 0). The output bias does not change the constant. Evaluated
    in logarithms, like :func:`sqrt_n_upper`: never NaN, and ``math.inf`` (with a
    :class:`BoundOverflowWarning`) only when the bound exceeds the float64 range.
    """
    a = as_tensor(a_norms, "a_norms", dtype=torch.float64).detach().cpu().numpy()
    v = as_tensor(v_norms, "v_norms", dtype=torch.float64).detach().cpu().numpy()
    if a.ndim != 1 or a.shape != v.shape or a.size == 0 or (a < 0).any() or (v < 0).any():
        raise ValueError(f"a_norms, v_norms: expected two non-empty lists of norms >= 0 of the same length, got "
                         f"shapes {a.shape} and {v.shape}")
    w_norm = check_positive_float(w_norm, "w_norm", allow_zero=True)
    R = check_radius(R, "R")
    n = check_positive_int(n, "n")
    # head h squared: 3 ||V'||^2 (||A'||^2 R'^4 (4n + 1) + n), R'^2 = R^2 + 1; n may exceed the float range
    log_R2, log_n, log_4n1 = math.log1p(R * R), math.log(n), math.log(4 * n + 1)
    logs = []
    for ah, vh in zip(a.tolist(), v.tolist()):
        if vh == 0.0:
            continue
        inner = log_n if ah == 0.0 else float(np.logaddexp(2 * math.log(ah) + 2 * log_R2 + log_4n1, log_n))
        logs.append(math.log(3.0) + 2 * math.log(vh) + inner)
    if not logs or w_norm == 0.0:
        return 0.0
    top = max(logs)
    log_sum = top + math.log(sum(math.exp(t - top) for t in logs))
    return _exp_or_inf(math.log(w_norm) + 0.5 * log_sum, "biased_multihead_upper")


def score_gap(A, X, *, masked: bool = False) -> float:
    """The smallest margin between the two largest scores ``<A x_i, x_j>`` of a row (over j <= i
    when ``masked``); ``math.inf`` when no row has two keys.

    Theorems 3.7 / 4.5 need a positive margin, and the constant at R X approaches its limit
    (:func:`large_radius_limit`) like ``exp(-gap R^2)``.
    """
    a = as_tensor(A, "A", dtype=torch.float64)
    x = as_tensor(X, "X", dtype=torch.float64)
    if a.dim() != 2 or a.shape[0] != a.shape[1] or x.dim() != 2 or x.shape[1] != a.shape[0] or x.shape[0] == 0:
        raise ValueError(f"A, X: expected A (d, d) and X (n, d), got {tuple(a.shape)} and {tuple(x.shape)}")
    masked = check_bool(masked, "masked")
    _check_scores_memory(x.shape[0], "score_gap")
    S = x @ a.T @ x.T
    if masked:
        S = S.masked_fill(torch.triu(torch.ones_like(S, dtype=torch.bool), 1), -math.inf)
    top = torch.topk(S, min(2, S.shape[1]), dim=1).values
    gaps = top[:, 0] - top[:, 1] if top.shape[1] > 1 else torch.full((S.shape[0],), math.inf)
    gaps = torch.where(torch.isfinite(gaps), gaps, torch.full_like(gaps, math.inf))
    return float(gaps.min())


def large_radius_sup(V, n) -> float:
    """``||V||_2 sqrt(n)``: the largest value the limit of Theorems 3.7 / 4.5 takes over directions
    of n tokens (every token attends to the same one: multiplicity n)."""
    v = as_tensor(V, "V", dtype=torch.float64)
    if v.dim() != 2 or v.numel() == 0:
        raise ValueError(f"V: expected a non-empty matrix, got shape {tuple(v.shape)}")
    n = check_positive_int(n, "n")
    return float(torch.linalg.matrix_norm(v, ord=2)) * math.sqrt(n)


# ---------------------------------------------------------------------------- biases and whole operators
def absorb_key_bias(A, c, R) -> tuple[np.ndarray, float, float]:
    """Absorb a key bias into the score matrix by lifting tokens to one more coordinate.

    Scores with a key bias, ``<A x_i, x_j> + <c, x_j>`` (what a query bias b_Q becomes,
    docs/math.md section 1), equal plain scores ``<A' x'_i, x'_j>`` of the lifted tokens
    ``x' = (x, t)`` with

        A' = [[A, c / t], [0, 0]]   ((d+1) x (d+1)),     ``|x'|`` <= R' = (R^2 + t^2)^{1/2} on B_R,

    for every t > 0. The lift moves no token (the last coordinate is the constant t), so a perturbation
    of X is the same perturbation of X' and every Lipschitz bound for (A', R') holds with the key bias
    (values are lifted as V' = [V, 0], with ||V'||_2 = ||V||_2). Theorems 3.3 and 3.5 depend on A and R
    only through ||A||_2 R^2, so t is chosen to minimize ``||[A, c/t]||_2 (R^2 + t^2)``: a grid in
    log t, refined by a bounded scalar search; any t would give a valid bound.

    Returns
    -------
    tuple
        (A', R', t); for c = 0 (or None) the lift is skipped: (A, R, 0.0).
    """
    a = _square(A)
    R = check_radius(R, "R")
    if c is None:
        return a, R, 0.0
    cv = as_tensor(c, "c", dtype=torch.float64).detach().cpu().numpy().reshape(-1)
    if cv.shape[0] != a.shape[0]:
        raise ValueError(f"c: expected {a.shape[0]} entries to match A of shape {a.shape}, got {cv.shape[0]}")
    d = a.shape[0]
    if not np.any(cv):
        return a, R, 0.0
    if R == 0.0:
        # on B_0 = {0}: the key-bias term has no effect at X = 0, and the lift's optimum is t -> 0
        return np.pad(a, ((0, 1), (0, 1))), 0.0, 0.0
    # ||[A, c/t]||_2^2 = lambda_max(A A^T + c c^T / t^2): a rank-one update of a fixed matrix, whose
    # top eigenvalue is the root above lambda_1 of the secular equation 1 + sum w_i^2 / (lambda_i - x) = 0
    # t's optimum is unchanged when A and c are scaled together: the secular equation runs on A / s and c / s
    # (their squares overflowed for entries above about 1e154, leaving t 1e5 times off)
    s = max(float(np.abs(a).max()), float(np.abs(cv).max()))
    lam, U = np.linalg.eigh((a / s) @ (a / s).T)
    lam = np.clip(lam, 0.0, None)
    w2 = (U.T @ (cv / s)) ** 2

    def top(t: float) -> float:
        w = w2 / (t * t)
        lo, hi = float(lam[-1]), float(lam[-1] + w.sum())
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            gap = lam - mid
            if mid <= lo or mid >= hi:
                break
            if 1.0 + float(np.sum(w / gap)) < 0:   # below the root
                lo = mid
            else:
                hi = mid
        return hi

    def phi(log_t: float) -> float:
        t = math.exp(log_t)
        return 0.5 * math.log(top(t)) + math.log(R * R + t * t)

    grid = np.log(R) + np.linspace(-12.0, 12.0, 97)
    vals = [phi(float(s)) for s in grid]
    k = int(np.argmin(vals))
    from scipy.optimize import minimize_scalar

    lo_s, hi_s = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    res = minimize_scalar(phi, bounds=(float(lo_s), float(hi_s)), method="bounded",
                          options={"xatol": 1e-10})
    log_t = float(res.x) if res.fun <= vals[k] else float(grid[k])
    t = math.exp(log_t)
    lifted = np.zeros((d + 1, d + 1))
    lifted[:d, :d] = a
    lifted[:d, d] = cv / t
    return lifted, math.sqrt(R * R + t * t), t


# ---------------------------------------------------------------------------- predicted forms
def two_dirac_ratio_from_gamma(gamma, R) -> float:
    """``1 + 1 / (gamma R^2)``: the ratio of the two-Dirac witness's constant to Proposition 3.6's
    asymptotic value ``(gamma / 2) R^2 exp(gamma R^2)`` (docs/math.md sections 5.4 and 7.5).

    It is the constant of the witness's two-atom measure (:func:`meanfield.adversarial.sqrt_n_witness_constant`
    with ``of="measure"``) at ``n = exp(2 gamma R^2)`` (where the witness family is the two-Dirac
    measure) divided by the asymptotic value, to leading order: with b = 1/2 there, ``sqrt(n - 1) b
    (1 + gamma R^2) / ((gamma/2) R^2 e^{gamma R^2}) = 1 + 1/(gamma R^2)``. The neglected terms are of
    relative order ``exp(-2 gamma R^2)`` (times ``(R^2 |A^T u - lambda u|)^2`` for a non-normal A), so
    the ratio tends to 1 as Proposition 3.6 states, at the rate
    ``1/(gamma R^2)``. ``math.inf`` when gamma = 0 or R = 0.
    """
    g = _gamma_value(gamma)
    R = check_radius(R, "R")
    t = g * R * R
    return math.inf if t == 0.0 else 1.0 + 1.0 / t


def two_dirac_ratio(A, R) -> float:
    """:func:`two_dirac_ratio_from_gamma` with gamma = :func:`gamma` (A)."""
    return two_dirac_ratio_from_gamma(gamma(A), R)


def query_term_norms(A, V, X, log_weights=None, *, positions=None) -> np.ndarray:
    """``||V Sigma_mu(x_i) A||_2`` for every atom i of ``mu = sum_j a_j delta_{x_j}``.

    ``Sigma_mu(x_i)`` is the covariance of the attention distribution of the query x_i,
    ``P_ij = softmax_j(<A x_i, x_j> + log a_j)`` over the visible atoms (``s_j <= s_i`` when
    ``positions`` s are given: masked attention), and ``V Sigma A`` is the query term of the
    Jacobian (docs/math.md section 4.1). It is the constant that splitting atom i contributes
    (:func:`split_constant`, docs/math.md section 4.7). ``log_weights=None`` means uniform weights; a
    log-weight of -inf (an atom of zero mass, which splitting does not change) gives 0.
    Returns a float64 array of length N.
    """
    a, v = _A_V(A, V)
    x = _matrix(X, "X")
    if x.shape[1] != a.shape[0]:
        raise ValueError(f"X: expected points of dimension {a.shape[0]} to match A, got shape {x.shape}")
    N = x.shape[0]
    if log_weights is None:
        lw = np.full(N, -math.log(N))
    else:
        lw = as_tensor(log_weights, "log_weights", dtype=torch.float64, finite=False).detach().cpu().numpy()
        lw = lw.reshape(-1)
        if lw.shape != (N,):
            raise ValueError(f"log_weights: expected {N} log-weights (finite or -inf), got shape {lw.shape}")
        if np.isnan(lw).any() or np.isposinf(lw).any():
            raise ValueError("log_weights: contains NaN or +inf (-inf, a zero mass, is the only infinity allowed)")
    S = (x @ a.T) @ x.T + lw[None, :]
    if positions is not None:
        s = as_tensor(positions, "positions", dtype=torch.float64).detach().cpu().numpy().reshape(-1)
        if s.shape != (N,):
            raise ValueError(f"positions: expected {N} positions, got shape {s.shape}")
        S = np.where(s[None, :] <= s[:, None], S, -np.inf)
    m = S.max(axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    P = np.exp(S - m)
    z = P.sum(axis=1, keepdims=True)
    P = P / np.where(z > 0, z, 1.0)
    out = np.empty(N)
    for i in range(N):
        if lw[i] == -np.inf:   # no mass: splitting the atom changes nothing (as splitting.split_lipschitz)
            out[i] = 0.0
            continue
        mean = P[i] @ x
        C = x - mean
        cov = (C * P[i][:, None]).T @ C
        out[i] = np.linalg.norm(v @ cov @ a, 2)
    return out


def split_constant(lip_unsplit, query_norms, split) -> float:
    """docs/math.md section 4.7: the weighted (W2-sense) local constant of a measure whose atoms in
    ``split`` are each split into parts, whatever the fractions:
    ``max(lip_unsplit, max_{i in split} query_norms[i])``.

    ``lip_unsplit`` is the constant of the unsplit measure, ``query_norms`` the values
    ``||V Sigma_mu(x_i) A||_2`` of :func:`query_term_norms` (of the unsplit measure). Perturbations
    that move the parts of an atom in opposite directions leave the key side of every softmax unchanged to
    first order (the parts' own queries still move) and are orthogonal to the unsplit ones, so only the query
    term acts on them.

    ``lip_unsplit`` and every entry of ``query_norms`` (a 1-D list) must be finite and >= 0; ``split``
    is a list of integer atom indices in [0, N) (a float index, even a whole one, is a TypeError:
    nothing is truncated).
    """
    lip = check_positive_float(lip_unsplit, "lip_unsplit", allow_zero=True)
    q = as_tensor(query_norms, "query_norms", dtype=torch.float64).detach().cpu()
    if q.dim() != 1:
        raise ValueError(f"query_norms: expected one norm per atom (1-D), got shape {tuple(q.shape)}")
    q = q.numpy()
    if (q < 0).any():
        raise ValueError(f"query_norms: expected norms >= 0, got a minimum of {q.min():.3g}")
    if isinstance(split, (str, bytes)) or not hasattr(split, "__iter__"):
        raise TypeError(f"split: expected a list of atom indices, got {type(split).__name__}")
    idx = split.tolist() if isinstance(split, (np.ndarray, torch.Tensor)) else list(split)
    idx = idx if isinstance(idx, list) else [idx]
    bad = [i for i in idx if isinstance(i, (bool, np.bool_)) or not isinstance(i, numbers.Integral)]
    if bad:
        raise TypeError(f"split: expected integer atom indices, got {bad[0]!r} ({type(bad[0]).__name__})")
    idx = [int(i) for i in idx]
    if any(not 0 <= i < q.size for i in idx):
        raise ValueError(f"split: atom indices must lie in [0, {q.size}), got {idx}")
    if not idx:
        return lip
    return float(max(lip, float(q[idx].max())))


def __getattr__(name: str):
    # operator_upper reads the operators' parameters: it lives in meanfield.upper, above the operators
    # (this module imports none). The previous spelling bounds.operator_upper works for one more release
    if name in ("operator_upper", "UpperBound"):
        warnings.warn(f"meanfield.bounds.{name} moved to meanfield.upper.{name} (also meanfield.{name}); the old "
                      "path will be removed in the next release", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module("meanfield.upper"), name)
    raise AttributeError(f"module 'meanfield.bounds' has no attribute {name!r}")
