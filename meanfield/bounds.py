"""The Lipschitz bounds of *How Smooth Is Attention?* (Castin, Ablin, Peyre, ICML 2024) as plain functions.

Every function takes matrices as numpy arrays or torch tensors and returns a Python float
(docs/math.md section 5). Spectral norms ``||.||_2`` throughout. Conventions: scores
``s_ij = <A x_i, x_j>``, values ``V x_j`` with ``V`` of shape (d_out, d), tokens in the ball B_R.

Upper bounds            :func:`sqrt_n_upper` (Thm 3.3 / 4.3), :func:`mean_field_upper` (Thm 3.5 / 4.4),
                        :func:`multihead_upper` (Lemma 3.8), :func:`l2_attention_upper` (Kim et al. Thm 3.2)
Lower bounds            :func:`sqrt_n_lower` (Prop 3.4), :func:`two_dirac_lower` (Prop 3.6, asymptotic)
Large radius            :func:`large_radius_limit` (Thm 3.7 / 4.5), :func:`argmax_indices`
Eigen-structure of A    :func:`gamma`, :func:`gamma_info`
Whole operators         :func:`operator_upper` (the best bound known for an operator), :func:`absorb_key_bias`

Bounds containing ``exp(c R^2)`` accept ``log=True`` and then return the natural logarithm of the
bound, finite for every finite radius. Their plain value is ``math.inf`` only when the true number
exceeds the float64 range (about 1.8e308); it is never NaN.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from particles.validation import as_tensor, check_positive_int, check_radius

__all__ = [
    "GammaInfo",
    "UpperBound",
    "absorb_key_bias",
    "argmax_indices",
    "gamma",
    "gamma_info",
    "l2_attention_upper",
    "large_radius_limit",
    "lambert_phi_inverse",
    "mean_field_upper",
    "multihead_upper",
    "operator_upper",
    "spectral_norm",
    "sqrt_n_lower",
    "sqrt_n_upper",
    "two_dirac_lower",
]


# ---------------------------------------------------------------------------- helpers
def _matrix(M, name: str) -> np.ndarray:
    t = as_tensor(M, name, dtype=torch.float64)
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a matrix (2-D), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty matrix, got shape {tuple(t.shape)}")
    return t.detach().cpu().numpy()


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
    if not isinstance(log, bool):
        raise TypeError(f"log: expected True or False, got {type(log).__name__}")
    return log


def _exp_or_inf(log_value: float) -> float:
    """exp(log_value), math.inf only when the number itself exceeds the float64 range."""
    if log_value == -math.inf:
        return 0.0
    try:
        return math.exp(log_value)
    except OverflowError:
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
    return _exp_or_inf(0.5 * math.log(3.0) + math.log(nv) + log_root)


def mean_field_upper(A, V, R, *, log: bool = False) -> float:
    """Theorem 3.5 (mean-field, Geshkovski et al. 2023) and Theorem 4.4 (masked, conditional W2):
    the Lipschitz constant of mean-field attention on P(B_R) is at most
    ``||V||_2 (1 + 3 ||A||_2 R^2) exp(2 ||A||_2 R^2)``.

    By Lemma 3.2 it also bounds Lip_X(f) for sequences X in B_R^n of every length n.
    ``log=True`` returns the natural logarithm of the bound (``-inf`` when V = 0).
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
    return value if log else _exp_or_inf(value)


def multihead_upper(head_lips, W_O) -> float:
    """Lemma 3.8: ``Lip(f_MH) <= ||W_O||_2 (sum_h Lip(f^h)^2)^{1/2}`` for f_MH = W_O concat_h f^h.

    ``head_lips`` are per-head Lipschitz constants (local values at one X or bounds on a set; the
    result is then of the same kind). An output bias does not change the constant.
    """
    lips = as_tensor(head_lips, "head_lips", dtype=torch.float64).detach().reshape(-1).numpy()
    if lips.size == 0:
        raise ValueError("head_lips: expected at least one per-head constant")
    if (lips < 0).any():
        raise ValueError(f"head_lips: Lipschitz constants must be non-negative (min is {lips.min():.3g})")
    w = _matrix(W_O, "W_O")
    return float(np.linalg.norm(w, 2) * math.sqrt(float(np.sum(lips * lips))))


# ---------------------------------------------------------------------------- lower bounds
@dataclass(frozen=True)
class GammaInfo:
    """The exponent of Proposition 3.4: gamma = max(lambda_max / 8, -lambda_min).

    ``case`` is ``"max"`` when lambda_max / 8 >= -lambda_min (witness (Ru, Ru/2, ..., Ru/2)) and
    ``"min"`` otherwise (witness (-Ru, Ru, ..., Ru)); ``eigenvalue`` and the unit ``eigenvector``
    u (A u = eigenvalue u) are those of the chosen case.
    """

    gamma: float
    case: str
    eigenvalue: float
    eigenvector: np.ndarray
    lambda_max: float
    lambda_min: float


def gamma_info(A, *, tol: float = 1e-10) -> GammaInfo:
    """Real eigen-structure of A used by Propositions 3.4 and 3.6 (see :class:`GammaInfo`).

    An eigenvalue counts as real when |Im| <= tol (1 + |lambda|). lambda_max / 8 counts only if
    lambda_max > 0 and -lambda_min only if lambda_min < 0; when every real eigenvalue is 0,
    gamma = 0 (case "max"). A matrix with no real eigenvalue raises a ValueError.
    """
    a = _square(A)
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not (math.isfinite(tol) and tol >= 0):
        raise ValueError(f"tol: expected a finite tolerance >= 0, got {tol!r}")
    evals, evecs = np.linalg.eig(a)
    real = np.abs(evals.imag) <= tol * (1.0 + np.abs(evals))
    if not real.any():
        raise ValueError(f"A: has no real eigenvalue (eigenvalues {np.round(evals, 6).tolist()}); "
                         "Proposition 3.4 needs one (a real A of odd dimension always has one)")
    lam = evals.real[real]
    vecs = evecs[:, real]
    i_max, i_min = int(np.argmax(lam)), int(np.argmin(lam))
    l_max, l_min = float(lam[i_max]), float(lam[i_min])
    t_max = l_max / 8.0 if l_max > 0 else 0.0
    t_min = -l_min if l_min < 0 else 0.0
    case, idx = ("max", i_max) if t_max >= t_min else ("min", i_min)
    u = _real_unit_eigenvector(a, float(lam[idx]), vecs[:, idx])
    return GammaInfo(max(t_max, t_min), case, float(lam[idx]), u, l_max, l_min)


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
    the witness's constant matches it to about 1e-4; in case "max" it is strictly above, by sqrt(2)
    at n = 2); it grows like sqrt(n) while n << exp(2 gamma R^2).
    """
    g = gamma(A)
    R = check_radius(R, "R")
    n = check_positive_int(n, "n")
    if n == 1:
        return 0.0
    # in logarithms: n may be an integer beyond float range (10**400)
    log_m = math.log(n - 1)
    t = log_m - 2.0 * g * R * R                      # log((n-1) e^{-2 gamma R^2})
    softplus = t + math.log1p(math.exp(-t)) if t > 0 else math.log1p(math.exp(t))
    return _exp_or_inf(0.5 * log_m - softplus)


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
    return value if log else _exp_or_inf(value)


# ---------------------------------------------------------------------------- large radius
def argmax_indices(A, X, *, masked: bool = False, rtol: float = 1e-9) -> np.ndarray:
    """m_i = argmax_j <A x_i, x_j> (over j <= i when ``masked``), as an int array of length n.

    Raises a ValueError when some row's maximum is not unique: the runner-up score lies within
    ``rtol`` (1 + |max|) of the maximum (Theorems 3.7 / 4.5 need unique maximizers).
    """
    a = _square(A)
    x = _matrix(X, "X")
    if x.shape[1] != a.shape[0]:
        raise ValueError(f"X: expected tokens of dimension {a.shape[0]} to match A, got shape {x.shape}")
    if not isinstance(masked, bool):
        raise TypeError(f"masked: expected True or False, got {type(masked).__name__}")
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
    """Theorem 3.7 (unmasked) / Theorem 4.5 (masked): ``lim_{R -> inf} Lip_{RX}(f) =
    ||V||_2 sqrt(max_j #{i : m_i = j})`` with m_i from :func:`argmax_indices` (j <= i if masked).

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
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x < 0:
        raise ValueError(f"x: expected a finite non-negative number, got {x!r}")
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

    ``norm="inf"`` (as published): ``(4 phi^{-1}(N-1) + 1/sqrt(k)) ||W_O^T||_inf
    max_h ||W_Q^h||_inf ||W_Q^h^T||_inf max_h ||W_V^h^T||_inf``.

    ``norm="2"``: ``(sqrt(N)/sqrt(k)) (4 phi^{-1}(N-1) + 1) (sum_h ||W_Q^h||_2^4 ||W_V^h||_2^2)^{1/2}
    ||W_O||_2``. The form as commonly recalled, with ``||W_Q^h||_2^2`` inside the sum, is false
    (docs/math.md section 5): it scales linearly in W_Q while L2 attention scales quadratically (at
    N = 1 the map is x -> x A W_V W_O, of constant ||W_Q W_Q^T W_V W_O||_2 / sqrt(k)); the tests
    check a counterexample and the fourth-power form on random and adversarial inputs. The
    fourth power is what the published proof's per-head factor ||W_Q||_2 ||W_Q^T||_2 gives.

    phi^{-1}(N-1) = W_0((N-1)/e) (:func:`lambert_phi_inverse`). Different heads may have
    different k; the factor 1/sqrt(k) is then taken per head (largest value for ``"inf"``).

    ``W_Q`` may be a list of (D, k) matrices, an (H, D, k) array or a (D, k) matrix; ``W_V``
    likewise; ``W_O=None`` is the identity (plain concatenation). Passing a
    :class:`meanfield.L2SelfAttention` as the first argument reads its W_Q, W_V, W_O (an output
    bias does not change the constant). The theorem is stated for unmasked attention.
    """
    if hasattr(W_Q, "W_Q") and hasattr(W_Q, "W_V") and hasattr(W_Q, "W_O"):
        if W_V is not None or W_O is not None:
            raise ValueError("W_V, W_O: give them only with matrices, not with an L2SelfAttention operator")
        W_Q, W_V, W_O = W_Q.W_Q, W_Q.W_V, W_Q.W_O
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
        return float(math.sqrt(N) * math.sqrt(sum(terms)) * np.linalg.norm(wo, 2))
    inf = np.inf
    q_term = max((4.0 * c + 1.0 / math.sqrt(k)) * np.linalg.norm(q, inf) * np.linalg.norm(q.T, inf)
                 for q, k in zip(WQ, ks))
    v_term = max(np.linalg.norm(v.T, inf) for v in WV)
    return float(np.linalg.norm(wo.T, inf) * q_term * v_term)


# ---------------------------------------------------------------------------- biases and whole operators
def absorb_key_bias(A, c, R) -> tuple[np.ndarray, float, float]:
    """Absorb a key bias into the score matrix by lifting tokens to one more coordinate.

    Scores with a key bias, ``<A x_i, x_j> + <c, x_j>`` (what a query bias b_Q becomes,
    docs/math.md section 1), equal plain scores ``<A' x'_i, x'_j>`` of the lifted tokens
    ``x' = (x, t)`` with

        A' = [[A, c / t], [0, 0]]   ((d+1) x (d+1)),     |x'| <= R' = (R^2 + t^2)^{1/2} on B_R,

    for every t > 0. The lift moves no token (the last coordinate is the constant t), so a perturbation
    of X is the same perturbation of X' and every Lipschitz bound for (A', R') holds with the key bias
    (values are lifted as V' = [V, 0], with ||V'||_2 = ||V||_2). Theorems 3.3 and 3.5 depend on A and R
    only through ||A||_2 R^2, so t is chosen to minimize ``||[A, c/t]||_2 (R^2 + t^2)``: a grid in
    log t, refined by a bounded scalar search; any t would give a valid bound.

    Returns
    -------
    (A', R', t) ; for c = 0 (or None) the lift is skipped: (A, R, 0.0).
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
    lam, U = np.linalg.eigh(a @ a.T)
    lam = np.clip(lam, 0.0, None)
    w2 = (U.T @ cv) ** 2

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


def _head_upper(A, c, V, R, n) -> tuple[float, str]:
    """log of min(Theorem 3.3, Theorem 3.5) for one head (Theorem 3.5 alone when n is None)."""
    a, Rl, t = absorb_key_bias(A, c, R)
    v = _matrix(V, "V")
    if a.shape[0] != v.shape[1]:
        v = np.pad(v, ((0, 0), (0, a.shape[0] - v.shape[1])))
    lifted = f" (key bias absorbed: tokens lifted to (x, {t:.3g}), radius {Rl:.6g})" if t > 0 else ""
    mf = mean_field_upper(a, v, Rl, log=True)
    if n is None:
        return mf, "Theorem 3.5 / 4.4" + lifted
    sq = sqrt_n_upper(a, v, Rl, n)
    log_sq = math.log(sq) if sq > 0 else -math.inf
    if sq != math.inf and log_sq <= mf:
        return log_sq, "Theorem 3.3 / 4.3" + lifted
    return mf, "Theorem 3.5 / 4.4" + lifted


def _logsumexp(xs) -> float:
    top = max(xs)
    if top in (math.inf, -math.inf):
        return top
    return top + math.log(sum(math.exp(x - top) for x in xs))


def _heads_of(op):
    """(list of (A, c, V) numpy heads, W_O or None, note) of an operator, or (None, None, reason)."""
    from .attention import MultiHeadAttention, SelfAttention
    from .hf import HFAttention
    from .operator import TorchMultiheadAttention

    np64 = lambda t: None if t is None else t.detach().to(torch.float64).cpu().numpy()
    if isinstance(op, SelfAttention):
        return [(np64(op.A), np64(op.key_bias), np64(op.V))], None, ""
    if isinstance(op, MultiHeadAttention):
        return [(np64(h.A), np64(h.key_bias), np64(h.V)) for h in op.heads], np64(op.W_O), ""
    if isinstance(op, HFAttention):
        if op.block:
            return None, None, "no bound is known for the whole block (LayerNorm and residual)"
        if op.kind == "bert_self":
            return None, None, "BertSelfAttention alone: wrap BertAttention to read W_O"
        p = op.parameters()
        heads = []
        for h in range(p.num_heads):
            c = p.scale * (p.K[h].T @ p.b_Q[h])
            heads.append((np64(p.A(h)), np64(c), np64(p.V[h])))
        return heads, np64(p.W_O), ""
    if isinstance(op, TorchMultiheadAttention):
        m = op.module
        if not m._qkv_same_embed_dim or m.bias_k is not None or m.add_zero_attn:
            return None, None, "torch MultiheadAttention with kdim/vdim, bias_k/bias_v or add_zero_attn"
        E, H = m.embed_dim, m.num_heads
        k = E // H
        W = m.in_proj_weight.detach()
        b = m.in_proj_bias.detach() if m.in_proj_bias is not None else torch.zeros(3 * E, dtype=W.dtype)
        heads = []
        for h in range(H):
            rows = slice(h * k, (h + 1) * k)
            Q, K, V = W[:E][rows], W[E:2 * E][rows], W[2 * E:][rows]
            c = (K.T @ b[:E][rows]) / math.sqrt(k)
            heads.append((np64(K.T @ Q / math.sqrt(k)), np64(c), np64(V)))
        return heads, np64(m.out_proj.weight), ""
    return None, None, f"no bound is known for {type(op).__name__}"


def operator_upper(op, R, n=None) -> UpperBound:
    """The best upper bound the framework knows on the Lipschitz constant of an attention operator.

    On sequences (``n`` given): a bound on Lip(f on B_R^n) = sup over X in B_R^n of Lip_X(f). On
    measures (``n=None``): a bound on the W2 Lipschitz constant of F on measures supported in B_R
    (conditional W2 when masked), which by Lemma 3.2 also bounds Lip_X(f) for every n.

    * single head (:class:`~meanfield.SelfAttention`): min(Theorem 3.3 / 4.3, Theorem 3.5 / 4.4)
      (docs/math.md sections 5.1, 5.2); on measures Theorem 3.5 / 4.4 alone;
    * multi-head (:class:`~meanfield.MultiHeadAttention`, Hugging Face layers through
      :meth:`~meanfield.hf.HFAttention.parameters`, ``torch.nn.MultiheadAttention``): Lemma 3.8
      over the heads' bounds (docs/math.md section 5.6);
    * biases: a value bias or an output bias adds a constant and changes no Lipschitz constant; a
      key bias (from b_Q) is absorbed head by head with :func:`absorb_key_bias`;
    * L2 attention (:class:`~meanfield.L2SelfAttention`, unmasked, sequences):
      :func:`l2_attention_upper` with N = n (Kim et al., docs/math.md section 5.8).

    Other operators (masked L2, sphere models, whole Hugging Face blocks, bare callables) get an
    :class:`UpperBound` with ``known=False`` and ``value = inf``, its ``source`` saying why.

    Examples
    --------
    >>> import numpy as np
    >>> from meanfield import SelfAttention, bounds
    >>> b = bounds.operator_upper(SelfAttention(np.eye(2), np.eye(2)), R=1.0, n=8)
    >>> round(b.value, 4), b.source
    (11.0905, 'Theorem 3.3 / 4.3')
    """
    from .attention import L2SelfAttention
    from .operator import as_operator

    op = as_operator(op)
    R = check_radius(R, "R")
    if n is not None:
        n = check_positive_int(n, "n")
    if isinstance(op, L2SelfAttention):
        if op.masked:
            return UpperBound(math.inf, "none: Kim et al.'s bound is stated for unmasked L2 attention")
        if n is None:
            return UpperBound(math.inf, "none: Kim et al.'s bound depends on the number of tokens N")
        value = l2_attention_upper(op, N=n)
        return UpperBound(math.log(value) if value > 0 else -math.inf, "Kim et al. Theorem 3.2 (2-norm form)")
    heads, W_O, reason = _heads_of(op)
    if heads is None:
        return UpperBound(math.inf, "none: " + reason)
    per = tuple(_head_upper(A, c, V, R, n) for A, c, V in heads)
    if W_O is None:
        return UpperBound(per[0][0], per[0][1])
    nw = float(np.linalg.norm(W_O, 2))
    log_w = math.log(nw) if nw > 0 else -math.inf
    log_value = log_w + 0.5 * _logsumexp([2.0 * lv for lv, _ in per])
    kinds = sorted({s.split(" (")[0] for _, s in per})
    return UpperBound(log_value, f"Lemma 3.8 over {len(per)} heads ({', '.join(kinds)})", per)
