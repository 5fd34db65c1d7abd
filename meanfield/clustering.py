"""Clustering diagnostics of token dynamics (docs/math.md section 6; Geshkovski et al.: [GLPR23] for the clustering,
[GLPR24] for the sphere models).

* :func:`cluster_labels` / :func:`count_clusters`: single-linkage clusters at a distance
  tolerance (connected components of the graph ``|x_i - x_j| <= tol``), over time for a trajectory;
* :func:`limit_set`: cluster centers and whether each is a vertex of their convex hull (for V = I
  the rescaled tokens converge to the vertices of a convex polytope);
* :func:`interaction_energy`: E_beta = (1/(2 beta)) sum_ij a_i a_j exp(beta <x_i, x_j>), i.e.
  (1/(2 beta n^2)) sum_ij exp(beta <x_i, x_j>) for uniform weights; non-decreasing along the SA
  and USA sphere dynamics;
* :func:`w2_to_reference`: W2 between an n-particle trajectory and a reference (large-n) trajectory
  at each time, the mean-field convergence diagnostic (uses :func:`transport.w2`).

Functions accept a tensor/array (N, d), a :class:`particles.Measure`, or (where it says so) a
:class:`meanfield.dynamics.Trajectory`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from particles import Measure
from particles.linkage import first_occurrence, linked_components, unit_scale
from particles.validation import as_tensor, check_positive_float, check_positive_int

from .dynamics import Trajectory

__all__ = ["cluster_labels", "count_clusters", "cluster_centers", "limit_set", "LimitSet", "hull_vertices",
           "interaction_energy", "w2_to_reference"]

#: above this many points single linkage runs on grid-cell representatives (see cluster_labels)
EXACT_LIMIT = 4000
#: the default clustering distance as a fraction of the configuration's scale, the larger of the diagonal of the
#: points' bounding box and their largest norm (a collapsing cluster keeps its norm, so on the unit sphere the
#: default stays 1e-3 however tight the cluster gets)
RELATIVE_TOL = 1e-3

def _points(x, name="points") -> tuple[np.ndarray, np.ndarray | None]:
    if isinstance(x, Measure):
        return x.points.detach().cpu().numpy(), x.weights.detach().cpu().numpy()
    t = as_tensor(x, name)
    if t.dim() != 2:
        raise ValueError(f"{name}: expected an (N, d) array of points, got shape {tuple(t.shape)}")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name}: expected at least one point of at least one coordinate, got shape {tuple(t.shape)}")
    return t.detach().cpu().numpy(), None


def _check_tol(tol, X: np.ndarray) -> float:
    """``tol``, or for None :data:`RELATIVE_TOL` times the configuration's scale: the larger of the diagonal of
    the bounding box of X and the largest norm in X (1.0 for all points at the origin). Relative to the
    diagonal alone, a collapsed cluster (spread 1e-14 on the sphere) counted every token as its own cluster."""
    if tol is None:
        if not len(X):
            return 1.0
        scale = max(float(np.linalg.norm(X.max(0) - X.min(0))), float(np.linalg.norm(X, axis=1).max()))
        return RELATIVE_TOL * scale if scale > 0 else 1.0
    # 0 links coinciding points only, as particles.linkage.linked_components does
    return check_positive_float(tol, "tol", allow_zero=True)


def _slack_ignored(slack, caller: str) -> None:
    """DeprecationWarning, attributed to the caller of ``caller`` (the public function given ``slack``)."""
    if slack is not None:
        warnings.warn(f"{caller}(slack=...): the clusters are exact at every size now; slack is ignored and will be "
                      "removed in the next release", DeprecationWarning, stacklevel=3)


def cluster_labels(points, tol: float | None = None, *, exact_limit: int = EXACT_LIMIT, slack=None
                   ) -> np.ndarray:
    """Single-linkage cluster labels at distance ``tol``, numbered 0..k-1 by first occurrence.

    ``tol`` None: :data:`RELATIVE_TOL` (1e-3) of the configuration's scale, the larger of the diagonal of
    the points' bounding box and their largest norm (on the unit sphere 1e-3 to 2e-3, also once the tokens
    have collapsed into one cluster); give an absolute distance to compare configurations of different
    spreads, or tokens that collapse at the origin; 0 links points whose squared distance is 0. ``exact_limit``:
    an integer >= 0.

    Exact at every size: up to ``exact_limit`` points scipy.cluster.hierarchy's single linkage cut at ``tol``,
    above it the components of the graph linking points within ``tol``
    (:func:`particles.linkage.linked_components`, memory O(N): a collapsed cloud of 10^6 tokens in under a second,
    10^6 tokens spread on the sphere in a few seconds). Both compare squared distances with ``tol^2``.
    ``slack`` is ignored (it set an approximation above ``exact_limit``, whose counts fell short of the exact
    ones: 81817 clusters for 148817 among 10^6 points on the sphere); passing it warns.
    """
    _slack_ignored(slack, "cluster_labels")
    X, _ = _points(points)
    tol = _check_tol(tol, X)
    exact_limit = check_positive_int(exact_limit, "exact_limit", minimum=0)
    n, d = X.shape
    if n == 1:
        return np.zeros(1, dtype=int)
    if n <= exact_limit:
        from scipy.cluster.hierarchy import fcluster, linkage
        from scipy.spatial.distance import pdist

        # squared distances against tol^2, as particles.linkage compares them (scipy's k-d tree): a pair at
        # exactly tol is linked or not the same way on every path (single linkage only orders the distances).
        # Points and tol scaled by one power of two first (exact): squares of 1e-160 or 1e160 stay in range
        Xs, ts = unit_scale(X, tol)
        raw = fcluster(linkage(pdist(Xs, "sqeuclidean"), method="single"), t=ts * ts, criterion="distance")
        return first_occurrence(raw)
    return first_occurrence(linked_components(X, tol, what="cluster_labels"))


def count_clusters(x, tol: float | None = None, *, exact_limit: int = EXACT_LIMIT, slack=None
                   ) -> int | np.ndarray:
    """Number of single-linkage clusters at the distance ``tol`` (None: :func:`cluster_labels`'s default, frame by
    frame); an array over time for a Trajectory or (T, N, d). Of a Measure or a Trajectory, the clusters of the
    support: atoms of zero mass are not in the measure (they neither count nor link two clusters).
    ``exact_limit`` and ``slack``: as in :func:`cluster_labels`."""
    _slack_ignored(slack, "count_clusters")
    kw = dict(exact_limit=exact_limit)
    lw = getattr(x, "log_weights", None)
    if isinstance(lw, torch.Tensor):   # a Measure (N, d) or a Trajectory (T, N, d): weights fixed in time
        x = x.points[..., lw > -math.inf, :]
    pts = as_tensor(getattr(x, "points", x), "x")
    if pts.dim() == 3:
        return np.array([int(cluster_labels(p, tol, **kw).max()) + 1 for p in pts])
    return int(cluster_labels(pts, tol, **kw).max()) + 1


def cluster_centers(x, tol: float | None = None, *, exact_limit: int = EXACT_LIMIT, slack=None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(centers (k, d), masses (k,), labels (N,)): weighted means and total weights of each cluster at the
    distance ``tol``, one label per atom; atoms of zero mass are clustered too (a cluster of them alone has mass 0,
    at their plain mean), where :func:`count_clusters` of a Measure counts its support only. ``exact_limit`` and
    ``slack``: as in :func:`cluster_labels`."""
    _slack_ignored(slack, "cluster_centers")
    kw = dict(exact_limit=exact_limit)
    X, w = _points(x)
    w = np.full(len(X), 1.0 / len(X)) if w is None else w
    labels = cluster_labels(X, tol, **kw)
    k = labels.max() + 1
    masses = np.bincount(labels, weights=w, minlength=k)
    centers = np.stack([np.bincount(labels, weights=w * X[:, c], minlength=k) for c in range(X.shape[1])], 1)
    # empty-mass clusters (atoms of weight 0) are located at their plain mean
    safe = masses > 0
    centers[safe] /= masses[safe, None]
    if not safe.all():
        counts = np.bincount(labels, minlength=k)
        plain = np.stack([np.bincount(labels, weights=X[:, c], minlength=k) for c in range(X.shape[1])], 1)
        centers[~safe] = plain[~safe] / counts[~safe, None]
    return centers, masses, labels


def hull_vertices(points) -> np.ndarray:
    """Indices of the points that are vertices of their convex hull (scipy.spatial.ConvexHull).

    Degenerate sets (fewer than d + 1 affinely independent points) are handled in their affine hull;
    one point is its own vertex, and in dimension one the vertices are the min and the max.
    """
    X, _ = _points(points)
    n = len(X)
    if n == 1:
        return np.array([0])
    c = X - X.mean(0)
    _, s, Vt = np.linalg.svd(c, full_matrices=False)
    rank = int((s > 1e-10 * max(s[0], 1e-300)).sum())
    if rank == 0:
        return np.array([0])
    Z = c @ Vt[:rank].T
    if rank == 1 or n <= rank + 1:
        if rank == 1:
            return np.unique([int(np.argmin(Z[:, 0])), int(np.argmax(Z[:, 0]))])
        return np.arange(n)  # a simplex: every point is a vertex
    from scipy.spatial import ConvexHull

    return np.sort(ConvexHull(Z).vertices)


@dataclass
class LimitSet:
    """Clusters of a (rescaled) final configuration and the polytope they span.

    ``centers`` (k, d), ``masses`` (k,), ``labels`` (N,), ``is_vertex`` (k,): whether each center is a
    vertex of the convex hull of the centers; ``spread``: the largest distance of a point to its
    cluster's center (how far the clusters are from being points).
    """

    centers: np.ndarray
    masses: np.ndarray
    labels: np.ndarray
    is_vertex: np.ndarray
    spread: float

    @property
    def n_clusters(self) -> int:
        return len(self.centers)

    @property
    def all_vertices(self) -> bool:
        """True when every cluster sits at a vertex of the polytope (Geshkovski et al., V = I)."""
        return bool(self.is_vertex.all())


def limit_set(x, tol: float | None = None, *, exact_limit: int = EXACT_LIMIT, slack=None) -> LimitSet:
    """Cluster ``x`` at the distance ``tol`` (None: :func:`cluster_labels`'s default) and test which cluster centers
    are vertices of their convex hull. ``exact_limit`` and ``slack``: as in :func:`cluster_labels`."""
    X, _ = _points(x)
    _slack_ignored(slack, "limit_set")
    centers, masses, labels = cluster_centers(x, tol, exact_limit=exact_limit)
    is_vertex = np.zeros(len(centers), dtype=bool)
    is_vertex[hull_vertices(centers)] = True
    spread = float(np.linalg.norm(X - centers[labels], axis=1).max())
    return LimitSet(centers, masses, labels, is_vertex, spread)


#: score entries :func:`interaction_energy` holds at once (rows of points against all points)
ENERGY_BLOCK = 2**22


def interaction_energy(x, beta: float, weights=None, *, log: bool = False) -> float | np.ndarray:
    """E_beta = (1/(2 beta)) sum_ij a_i a_j exp(beta <x_i, x_j>) (uniform: 1/(2 beta n^2) sum_ij ...).

    This is the energy of the sphere models of Geshkovski et al. [GLPR24] (their normalization):
    the USA field is a_i^{-1} grad_{x_i} E_beta and the SA field a positive multiple of it per
    particle, so E_beta is non-decreasing along both projected flows. Computed in log-sum-exp form;
    ``log=True`` returns log E_beta, which stays finite where E_beta overflows float64 (beta R^2 above
    about 700: an OverflowError says so rather than returning inf).
    ``x`` may be points, a Measure, or a Trajectory / (T, N, d) tensor (then an array over time);
    ``weights`` (non-negative, not all zero; normalized here) only for points, a Measure or a Trajectory
    carrying their own.
    """
    from particles.validation import check_bool

    log = check_bool(log, "log")
    beta = float(beta)
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta: expected a positive inverse temperature, got {beta}")
    if isinstance(x, Measure):
        pts, lw = x.points, x.log_weights
    else:
        pts = as_tensor(getattr(x, "points", x), "x")
        lw = getattr(x, "log_weights", None)
        if pts.dim() < 2 or pts.shape[-2] == 0 or pts.shape[-1] == 0:
            raise ValueError(f"x: expected an (N, d) array (or (T, N, d)) of at least one point of at least one "
                             f"coordinate, got shape {tuple(pts.shape)}")
    if weights is not None:
        if lw is not None:
            raise ValueError(f"weights: {type(x).__name__} carries its own weights; pass its points to weigh them "
                             "otherwise")
        w = as_tensor(weights, "weights", dtype=pts.dtype)
        if w.shape != (pts.shape[-2],) or bool((w < 0).any()):
            raise ValueError(f"weights: expected {pts.shape[-2]} non-negative weights")
        if not float(w.sum()) > 0:
            raise ValueError("weights: every weight is zero")
        w = w / w.max()   # by the largest first: a sum of large raw counts stays finite
        lw = torch.log(w / w.sum())
    if lw is None:
        lw = torch.full((pts.shape[-2],), -math.log(pts.shape[-2]), dtype=pts.dtype, device=pts.device)
    pts = pts.detach()
    # in blocks of rows against every point: memory O(ENERGY_BLOCK + N), never the N x N matrix (1e5 points in
    # float64 would be 80 GB); the blocks' log-sums combined by one more log-sum-exp
    n = pts.shape[-2]
    rows = max(1, ENERGY_BLOCK // max(1, math.prod(pts.shape[:-2]) * n))
    parts = []
    for i in range(0, n, rows):
        s = beta * pts[..., i:i + rows, :] @ pts.transpose(-1, -2) + lw[i:i + rows, None] + lw[None, :]
        parts.append(torch.logsumexp(s.flatten(-2), -1))
    logE = (torch.logsumexp(torch.stack(parts, -1), -1) - math.log(2 * beta)).cpu().numpy()
    if log:
        return float(logE) if logE.ndim == 0 else logE
    if bool((logE > math.log(np.finfo(np.float64).max)).any()):
        raise OverflowError(f"interaction_energy: log E_beta = {float(np.max(logE)):.4g} overflows float64; pass "
                            "log=True for log E_beta")
    E = np.exp(logE)
    return float(E) if E.ndim == 0 else E


def w2_to_reference(traj, reference, method: str = "exact", **kw) -> np.ndarray:
    """W2(mu_n(t_k), mu_ref(t_k)) at every requested time of two trajectories on the same times.

    The mean-field limit says this tends to zero as n grows when mu_n(0) -> mu_ref(0) (stability
    of the continuity equation in W2, the Lipschitz property of Theorem 3.5 with Gronwall). Positions, if any,
    are not used (W2 of the points, :meth:`particles.Measure.unmasked`).
    """
    # imported here: transport loads POT (~0.8 s), which nothing else in this module needs
    from transport import w2

    for name, t in (("traj", traj), ("reference", reference)):
        if not isinstance(t, Trajectory):
            raise TypeError(f"{name}: expected a Trajectory (what meanfield.simulate returns), got {type(t).__name__}; "
                            "for one measure, call transport.w2 directly")
    if len(traj) != len(reference) or not torch.allclose(traj.times, reference.times):
        raise ValueError("reference: the two trajectories must be sampled at the same times")
    return np.array([w2(a.unmasked(), b.unmasked(), method=method, **kw) for a, b in zip(traj, reference)])
