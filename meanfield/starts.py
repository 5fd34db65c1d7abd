"""Starting inputs of the worst-case search: witnesses, hubs, spread and random configurations.

:func:`sequence_starts` and :func:`measure_starts` build, from an operator's parameters
(:meth:`~meanfield.operator.AttentionOperator.parameters`), the inputs the search of
:mod:`meanfield.worst_case` ascends from: Proposition 3.4's witness in both eigen-cases
(:func:`meanfield.bounds.eigen_cases`), the two-Dirac witness of Proposition 3.6 (measures), the
large-radius hub configurations (Theorems 3.7 / 4.5), one token at 0 with the others spread
(Appendix C.7), and random and clustered random configurations on the sphere of radius R
(docs/math.md section 5). Operators without parameters (bare callables) get the unstructured ones.
:func:`longer_start` carries an input found at m tokens to n > m tokens without lowering its constant.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from particles import Measure
from particles.measure import position_dtype
from particles.validation import check_bool, check_positive_int, check_radius, make_generator

from . import adversarial
from .adapters import as_operator
from .bounds import eigen_cases
from .operator import sequence_positions

__all__ = ["sequence_starts", "measure_starts", "longer_start", "ladder_radii", "ladder_sequence_starts",
           "ladder_measure_starts", "LADDER_SPREADS"]


def _score_matrices(op, d) -> list[tuple[str, np.ndarray]]:
    """(label, A) of every head of the operator's record: the bilinear part of the scores, A x_i . x_j
    (for L2 heads 2 scale Q^T Q: the scores -scale |Q x_i - Q x_j|^2 differ from it by terms in i
    alone or j alone). The heads of a whole Hugging Face block are its attention's. None for
    operators without a record (bare callables)."""
    p = op.parameters(d)
    if p is None:
        return []
    mats = [h.A.detach().to(torch.float64).cpu().numpy() for h in p.heads]
    if len(mats) == 1:
        return [("", mats[0])]
    return [(f"[head {h}]", a) for h, a in enumerate(mats)]


#: how far the scores spread at the rungs of the ladder (:func:`meanfield.starts.ladder_radii`)
LADDER_SPREADS = (16.0, 4.0, 1.0)


def ladder_radii(f, R, *, d=None) -> list[float]:
    """The radii below R at which the structured starts are built again (the ladder), largest first: where
    the widest head's scores spread by 16, 4 and 1 (:data:`LADDER_SPREADS`), ``max_h (||A_h||_2 r^2 + ||c_h|| r)``
    with A_h the bilinear part of the scores and c_h the key bias. An empty list where the scores spread by at
    most 16 at R (the starts at R are not saturated), or for operators without readable parameters.

    Why: Lip(f on B_R^n) >= Lip(f on B_r^n) for r < R (the ball grows), but at a large radius every softmax of
    the starts at R saturates, their gradients vanish and the ascent stops at once (a review: 2.97 at R = 100,
    "converged" after 218 of 20000 products, where the search certified 789 at R = 20). From inputs whose
    scores spread by a few units the ascent rises (23316 at R = 100 in that case). The radii do not depend on
    R, so that searches at two radii share the rungs below both.
    """
    op = as_operator(f)
    R = check_radius(R, "R")
    d = _dims(op, d)
    p = op.parameters(d)
    if p is None or R == 0:
        return []
    growth = []
    for h in p.heads:
        A = h.A.detach().to(torch.float64).cpu()
        c = 0.0 if h.key_bias is None else float(h.key_bias.detach().to(torch.float64).norm())
        growth.append((float(torch.linalg.matrix_norm(A, 2)), c))
    if max(a * R * R + c * R for a, c in growth) <= LADDER_SPREADS[0]:
        return []   # the starts at R are not saturated: their ascent rises (rungs would only share its budget)
    radii = []
    for level in LADDER_SPREADS:
        # the radius where the widest head's scores spread by ``level``: max_h (a_h r^2 + c_h r) = level
        r = min(_root(a, c, level) for a, c in growth)
        if r < R * (1 - 1e-9) and math.isfinite(r):
            radii.append(r)
    return sorted(set(radii), reverse=True)


def _root(a, c, level):
    """The r >= 0 with a r^2 + c r = level (inf where a = c = 0)."""
    if a > 0:
        return 2 * level / (c + math.sqrt(c * c + 4 * a * level))
    return level / c if c > 0 else math.inf


def _witnesses(A, R, n):
    """[(case, X)] Proposition 3.4's witness (n, d) (float64) in each eigen-case of A that exists,
    the case of gamma(A) first (:func:`meanfield.bounds.eigen_cases`)."""
    return [(c.case, adversarial.sqrt_n_sequence_from_info(c, R, n, dtype=torch.float64))
            for c in eigen_cases(A)]


def _sphere(shape, R, g, dtype):
    Z = torch.randn(*shape, generator=g, dtype=torch.float64)
    return (R * Z / Z.norm(dim=-1, keepdim=True)).to(dtype)


def _dims(op, d):
    if op.d_in is not None:
        if d is not None and d != op.d_in:
            raise ValueError(f"d: {d} differs from the operator's input dimension {op.d_in}")
        return op.d_in
    if d is None:
        raise ValueError(f"d: the token dimension is required for {op!r}, which does not fix it")
    return check_positive_int(d, "d")


def _dtype_device(op):
    return (op.dtype or torch.float64), (op.device or torch.device("cpu"))


def sequence_starts(f, R, n, *, random=8, clusters=4, structured=True, seed=0, d=None
                    ) -> list[tuple[str, torch.Tensor]]:
    """Starting sequences (name, X (n, d)) in B_R^n for :func:`~meanfield.worst_case.worst_case_sequence`.

    Structured (``structured=True``), for the score matrix A of every head (docs/math.md section 5):

    * ``prop3.4-max`` / ``prop3.4-min``: Proposition 3.4's witness (R u, R u/2, ..., R u/2) with
      A u = lambda_max u, and (-R u, R u, ..., R u) with A u = lambda_min u, each where that
      eigenvalue exists with the right sign; the case of gamma(A) is
      :func:`meanfield.adversarial.sqrt_n_sequence` itself;
    * ``hub``: :func:`meanfield.adversarial.large_radius_configuration` (every token attends to
      token 0; Theorems 3.7 / 4.5);
    * ``zero+spread`` (once): :func:`meanfield.adversarial.zero_plus_spread` (Appendix C.7);

    ``random`` sequences of i.i.d. tokens uniform on the sphere of radius R (``random-k``), and
    ``clusters`` clustered ones (``cluster-k``): one or two single tokens at random places and n-1 or
    n-2 copies of a third, all uniform on the sphere (the worst cases found are often of this form:
    a few tokens and a cluster). Operators without readable score matrices (bare callables) get
    the random, clustered and zero-plus-spread starts only.
    The ladder's starts (the structured ones at smaller radii) are :func:`ladder_sequence_starts`.
    """
    op = as_operator(f)
    R = check_radius(R, "R")
    n = check_positive_int(n, "n")
    random = check_positive_int(random, "random", minimum=0)
    clusters = check_positive_int(clusters, "clusters", minimum=0)
    d = _dims(op, d)
    dtype, device = _dtype_device(op)
    out = []
    if check_bool(structured, "structured") and R > 0:
        out += _structured_sequences(op, R, n, d, dtype)
    g = make_generator(seed)
    for k in range(random):
        out.append((f"random-{k}", _sphere((n, d), R, g, dtype)))
    for k in range(clusters if n >= 3 else 0):
        P = _sphere((3, d), R, g, dtype)
        singles = 1 + k % 2
        X = P[2].expand(n, d).clone()
        where = torch.randperm(n, generator=g)[:singles]
        X[where] = P[:singles]
        out.append((f"cluster-{k}", X))
    return [(name, X.to(device)) for name, X in out]


def ladder_sequence_starts(f, R, n, *, d=None) -> list[tuple[str, torch.Tensor]]:
    """The structured starts of :func:`sequence_starts` built again at each radius of :func:`ladder_radii`
    (named ``"hub@0.5"`` for the hub at radius 0.5, ...): inputs of B_R^n from which the ascent rises where the
    softmaxes of the starts at R saturate. Empty where there is no rung.
    :func:`~meanfield.worst_case.worst_case_sequence` ascends from them when its search at R stopped on its own
    tests with half its budget or more left (``SearchOptions.ladder``)."""
    op = as_operator(f)
    R = check_radius(R, "R")
    n = check_positive_int(n, "n")
    d = _dims(op, d)
    dtype, device = _dtype_device(op)
    return [(f"{name}@{r:.3g}", X.to(device)) for r in ladder_radii(op, R, d=d)
            for name, X in _structured_sequences(op, r, n, d, dtype)]


def ladder_measure_starts(f, R, atoms, *, positions=None, d=None) -> list[tuple[str, Measure]]:
    """The structured starts of :func:`measure_starts` at each radius of :func:`ladder_radii` (as
    :func:`ladder_sequence_starts`)."""
    op = as_operator(f)
    R = check_radius(R, "R")
    atoms = check_positive_int(atoms, "atoms")
    d = _dims(op, d)
    dtype, device = _dtype_device(op)
    pos = _positions(op, positions, atoms, dtype)

    measure = _measure_maker(dtype, pos)
    return [(f"{name}@{r:.3g}", mu.to(device=device)) for r in ladder_radii(op, R, d=d)
            for name, mu in _structured_measures(op, r, atoms, d, measure)]


def _measure_maker(dtype, pos):
    """``measure(points, log_weights)``: a Measure in ``dtype`` with positions ``pos``, the weights normalized."""
    def measure(points, log_weights):
        pts = torch.as_tensor(np.asarray(points), dtype=dtype) if not isinstance(points, torch.Tensor) else points
        lw = torch.as_tensor(log_weights, dtype=dtype)
        return Measure(pts.to(dtype), log_weights=lw - torch.logsumexp(lw, 0), positions=pos)
    return measure


def _structured_sequences(op, R, n, d, dtype):
    """The structured starts of :func:`sequence_starts` at radius R (R > 0)."""
    out = []
    for label, A in _score_matrices(op, d):
        for case, X in _witnesses(A, R, n):
            out.append((f"prop3.4-{case}{label}", X.to(dtype)))
        try:
            out.append((f"hub{label}", adversarial.large_radius_configuration(A, n=n, R=R, masked=op.masked,
                                                                              dtype=dtype)))
        except ValueError:  # A = 0: no hub
            pass
    if n >= 2:
        out.append(("zero+spread", adversarial.zero_plus_spread(R, n, d, dtype=dtype)))
    return out


def measure_starts(f, R, atoms, *, positions=None, random=8, structured=True, seed=0, d=None
                   ) -> list[tuple[str, Measure]]:
    """Starting measures (name, mu) with ``atoms`` atoms in B_R for :func:`~meanfield.worst_case.worst_case_measure`.

    Structured, for every head's score matrix A (docs/math.md section 5):

    * ``prop3.6-max`` / ``prop3.6-min``: the two-Dirac witness of Proposition 3.6 in each eigen-case,
      p delta_{x0} + (1 - p) delta_{x1} with p = exp(-2 gamma_case R^2) (the case of gamma(A) is
      :func:`meanfield.adversarial.two_dirac`), its heavy atom split into atoms - 1 equal parts;
    * ``prop3.4-max`` / ``-min``: Proposition 3.4's sequence witness with uniform weights;
    * ``hub``: the hub configuration with uniform weights;

    and ``random`` measures: atoms uniform on the sphere of radius R, weights softmax of standard
    Gaussian logits. ``positions`` (masked operators; default i/atoms) are shared by every start.
    The ladder's starts are :func:`ladder_measure_starts`.
    """
    op = as_operator(f)
    R = check_radius(R, "R")
    atoms = check_positive_int(atoms, "atoms")
    random = check_positive_int(random, "random", minimum=0)
    d = _dims(op, d)
    dtype, device = _dtype_device(op)
    pos = _positions(op, positions, atoms, dtype)
    out = []

    measure = _measure_maker(dtype, pos)

    if check_bool(structured, "structured") and R > 0:
        out += _structured_measures(op, R, atoms, d, measure)
    g = make_generator(seed)
    for k in range(random):
        pts = _sphere((atoms, d), R, g, dtype)
        logits = torch.randn(atoms, generator=g, dtype=torch.float64)
        out.append((f"random-{k}", measure(pts, logits)))
    return [(name, mu.to(device=device)) for name, mu in out]


def _structured_measures(op, R, atoms, d, measure):
    """The structured starts of :func:`measure_starts` at radius R (R > 0); ``measure(points, log_weights)``."""
    dtype = _dtype_device(op)[0]
    out = []
    for label, A in _score_matrices(op, d):
        for c in eigen_cases(A):
            case, g_case = c.case, c.gamma
            W = adversarial.sqrt_n_sequence_from_info(c, R, max(atoms, 2), dtype=torch.float64)
            if atoms >= 2:
                x0, x1 = W[0].to(dtype), W[1].to(dtype)
                log_p = -2.0 * g_case * R * R
                log_q = math.log(-math.expm1(log_p)) if log_p < 0 else -math.inf
                pts = torch.stack([x0] + [x1] * (atoms - 1))
                lw = [log_p] + [log_q - math.log(atoms - 1)] * (atoms - 1)
                if all(math.isfinite(v) for v in lw):
                    out.append((f"prop3.6-{case}{label}", measure(pts, lw)))
            out.append((f"prop3.4-{case}{label}", measure(W[:atoms].numpy(), [0.0] * atoms)))
        try:
            hub = adversarial.large_radius_configuration(A, n=atoms, R=R, masked=op.masked, dtype=dtype)
            out.append((f"hub{label}", measure(hub, [0.0] * atoms)))
        except ValueError:
            pass
    return out


def _positions(op, positions, atoms, dtype):
    if positions is None:
        return sequence_positions(atoms, torch.zeros(0, dtype=dtype)) if op.masked else None
    if not op.masked:
        raise ValueError("positions: only masked operators use positions")
    pos = torch.as_tensor(positions, dtype=position_dtype(dtype)).detach().cpu()
    if pos.shape != (atoms,):
        raise ValueError(f"positions: expected {atoms} entries (one per atom), got shape {tuple(pos.shape)}")
    return pos


def longer_start(X, n, *, masked: bool = False) -> torch.Tensor:
    """n tokens whose local constant is at least that of X (m tokens): X repeated, ``[X; X; ...]``, cut to n.

    A search at n started from an input found at m < n (:func:`~meanfield.worst_case.worst_case_sequence`,
    ``starts=``) then never ends below it, so that the certified lower bound on Lip(f on B_R^n) does not
    decrease with n (docs/math.md section 5.9):

    * unmasked (m must divide n): attention sees its tokens through their empirical measure, which k = n / m
      copies of X leave unchanged (Lemma 3.2), so f([X; ...; X]) = [f(X); ...; f(X)]; a perturbation repeated
      in every copy is scaled by sqrt(k) on both sides, hence Lip_[X; ...; X](f) >= Lip_X(f);
    * masked (any m <= n): the first m outputs depend on the first m tokens only, so the Jacobian at the
      longer input has D f(X) as its top-left block with zeros to its right: again at least Lip_X(f).

    This holds for every operator of this framework and for attention layers without positional terms inside
    them. Tokens in B_R stay in B_R. Tokens with a NaN or infinite entry are a ValueError.
    """
    if not isinstance(X, torch.Tensor) or X.dim() != 2:
        raise TypeError(f"X: expected a tensor of shape (m, d), got {type(X).__name__}"
                        + (f" of shape {tuple(X.shape)}" if isinstance(X, torch.Tensor) else ""))
    m = X.shape[0]
    if m == 0:
        raise ValueError("X: has no token")
    if not bool(torch.isfinite(X).all()):
        bad = int((~torch.isfinite(X)).sum())
        raise ValueError(f"X: contains {bad} NaN or infinite entr{'y' if bad == 1 else 'ies'}")
    n = check_positive_int(n, "n", minimum=m)
    if not check_bool(masked, "masked") and n % m:
        raise ValueError(f"n: unmasked attention keeps the constant of X ({m} tokens) only at a multiple of {m}, "
                         f"got {n} (masked=True takes any n >= {m})")
    return X.repeat(-(-n // m), 1)[:n].clone()
