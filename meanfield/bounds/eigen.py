"""The real eigen-structure of A that Propositions 3.4 and 3.6 read (docs/math.md section 5.3): gamma, its case
("max" or "min") and eigenvector, from A or from factored heads Q^T K."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from particles.linkage import linked_components
from particles.validation import as_tensor

from .numerics import _check_tol, _square

__all__ = ["GammaInfo", "eigen_cases", "gamma_info", "gamma", "gamma_info_factored"]


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
