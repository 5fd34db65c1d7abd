"""The series' derivatives and the certified local constant through them (meanfield/series_jacobian.py), against
independent truths: finite differences of the polynomial kernel (torch's gradcheck), the kernel sum written out,
the dense Jacobians of the exact and the truncated maps (their distance in the operator norm, against the proved
bound), and the certified constant of the exact map (local_lipschitz's default path, a dense SVD)."""

from __future__ import annotations

import math

import pytest
import torch

from meanfield import MultiHeadAttention, SelfAttention, kernels, local_lipschitz
from meanfield import series_attention as series
from meanfield import series_jacobian as sj
from particles import Measure

DT = torch.float64


def written_out(x, y, w, K):
    s = x @ y.transpose(-1, -2)
    return sum(s ** p / math.factorial(p) for p in range(K + 1)) @ w if K >= 0 else torch.zeros_like(x @ y.mT @ w)


def rand(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=DT) * scale


# ---------------------------------------------------------------------- the kernel sum and its derivatives
@pytest.mark.parametrize("K", [0, 1, 2, 5, 9])
def test_kernel_sum_is_the_truncated_exponential_kernel_written_out(K):
    x, y, w = rand(3, 11, 3, seed=1, scale=0.6), rand(3, 13, 3, seed=2, scale=0.6), rand(3, 13, 4, seed=3)
    assert torch.allclose(series.kernel_sum(x, y, w, K), written_out(x, y, w, K), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("K", [0, 1, 3, 6])
def test_kernel_sum_derivatives_match_finite_differences(K):
    # reverse mode, forward mode, double backward and forward over reverse, all against finite differences
    x = rand(2, 3, 2, seed=4, scale=0.5).requires_grad_()
    y = rand(2, 4, 2, seed=5, scale=0.5).requires_grad_()
    w = rand(2, 4, 2, seed=6).requires_grad_()
    f = lambda a, b, c: series.kernel_sum(a, b, c, K)  # noqa: E731
    tight = {"eps": 1e-6, "atol": 1e-9, "rtol": 1e-7}
    assert torch.autograd.gradcheck(f, (x, y, w), check_forward_ad=True, **tight)
    assert torch.autograd.gradgradcheck(f, (x, y, w), check_fwd_over_rev=True, **tight)


def test_kernel_sum_tangent_with_some_inputs_fixed():
    x, y, w = rand(6, 3, seed=7, scale=0.5), rand(8, 3, seed=8, scale=0.5), rand(8, 2, seed=9)
    tx, ty, tw = rand(6, 3, seed=10), rand(8, 3, seed=11), rand(8, 2, seed=12)
    for fixed in range(3):
        tangents = [tx, ty, tw]
        tangents[fixed] = torch.zeros_like(tangents[fixed])
        want = torch.func.jvp(lambda a, b, c: written_out(a, b, c, 7), (x, y, w), tuple(tangents))[1]
        with torch.autograd.forward_ad.dual_level():
            args = [torch.autograd.forward_ad.make_dual(t, d) if i != fixed else t
                    for i, (t, d) in enumerate(zip((x, y, w), tangents))]
            got = torch.autograd.forward_ad.unpack_dual(series.kernel_sum(*args, 7)).tangent
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_derivatives_save_only_the_inputs():
    # the graph of the series saves O(rows) numbers, not the M features of every row
    n, saved = 20000, [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    X = (torch.rand(n, 2, generator=torch.Generator().manual_seed(0), dtype=DT) - 0.5).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = series.series_attend(X, X, X)
    M = series.feature_count(2, series.plan(X.detach(), X.detach()).degree + 1)
    assert saved[0] < 40 * n * 8 < M * n * 8
    g = torch.autograd.grad(out.sum(), X)[0]
    assert torch.isfinite(g).all()


def test_pinned_degree_is_the_explicit_one_without_the_radius_limit():
    q, k, v = rand(9, 2, seed=13, scale=2.0), rand(12, 2, seed=14, scale=2.0), rand(12, 3, seed=15)
    with pytest.raises(ValueError, match="r = "):
        series.series_attend(q, k, v)
    with series.pinned(30):
        pinned = series.series_attend(q, k, v)
    assert torch.equal(pinned, series.series_attend(q, k, v, degree=30))
    with pytest.raises(ValueError, match="degree"):
        series.pinned(-1).__enter__()


# ---------------------------------------------------------------------- the truncation bound
def dense_jacobian(op, X, lw, K=None):
    """The Jacobian of the points map at X in the estimate's norm (D^{1/2} J D^{-1/2} for weights), exact (dense
    attention) or of the series of degree K."""
    def f(Y):
        if K is None:
            with kernels.use("dense"):
                return op.points_map(Y, lw, None)
        with kernels.use("series"), series.pinned(K):
            return op.points_map(Y, lw, None)

    J = torch.autograd.functional.jacobian(f, X)
    n, dout = J.shape[:2]
    J = J.reshape(n * dout, -1)
    if lw is not None:
        w = torch.exp(lw - lw.max())
        J = w.sqrt().repeat_interleave(dout)[:, None] * J * (1 / w.sqrt()).repeat_interleave(X.shape[-1])[None, :]
    return J


def operators(d, seed):
    A, V = rand(d, d, seed=seed), rand(d, d, seed=seed + 1)
    yield SelfAttention(A, V)
    yield SelfAttention(A, V + 3.0)                      # values far from their centre
    yield SelfAttention.from_qkv(rand(2, d, seed=seed + 2), rand(2, d, seed=seed + 3), V,
                                 b_Q=rand(2, seed=seed + 4))  # factored scores, a key bias


@pytest.mark.parametrize("r", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("K", [4, 8, 14])
def test_weights_and_derivative_weights_are_within_their_etas(r, K):
    # the proof's first step, written out: scores spread over [-r, r], weights of the series (T_K) and of its
    # derivative (T_{K-1}) against the exact softmax weights; at the score -r the bound is nearly met
    s = torch.linspace(-r, r, 41, dtype=DT)
    a = torch.exp(rand(41, seed=int(10 * r) + K))
    T = lambda p: sum(s ** i / math.factorial(i) for i in range(p + 1))  # noqa: E731
    exact = a * torch.exp(s) / (a * torch.exp(s)).sum()
    approx = a * T(K) / (a * T(K)).sum()
    rho = a * T(K - 1) / (a * T(K)).sum()
    eta0, eta1 = sj._etas(r, K)
    e0 = ((approx - exact).abs() / exact).max().item()
    e1 = ((rho - exact).abs() / exact).max().item()
    assert e0 <= eta0 + 1e-14 and e1 <= eta1 + 1e-14   # float64 rounding where the etas are below it
    if 1e-12 < eta0 < 0.1:   # above rounding and where the bound is finite and small: within 5x of it
        assert e0 >= eta0 / 5 and e1 >= eta1 / 5


@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_truncation_bound_is_above_the_distance_of_the_jacobians(d, weighted):
    for seed in range(3):
        X = rand(16, d, seed=100 + seed)
        X = X / X.norm(dim=1).max() * (0.6 + 0.4 * seed)
        lw = torch.log_softmax(rand(16, seed=200 + seed), 0) if weighted else None
        for op in operators(d, 10 * seed):
            exact = dense_jacobian(op, X, lw)
            rounding = 1e-13 * torch.linalg.matrix_norm(exact, 2).item()
            for K in (3, 6, 10):
                bound = float(sj.truncation_bound(op, X[None], lw, K=K)[0])
                gap = torch.linalg.matrix_norm(dense_jacobian(op, X, lw, K) - exact, 2).item()
                assert gap <= bound + rounding, (seed, K, gap, bound)


@pytest.mark.parametrize("scale", [0.5, 1.0, 2.0])
def test_truncation_bound_on_two_diracs_is_valid_and_not_vacuous(scale):
    # two atoms at +-x with A = scale I: scores at +-r, the tail's worst case; there the bound is within 10-70x
    X = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=DT)
    op = SelfAttention(scale * torch.eye(2, dtype=DT), torch.eye(2, dtype=DT))
    exact = dense_jacobian(op, X, None)
    ratios = []
    for K in (5, 8, 12):
        bound = float(sj.truncation_bound(op, X[None], None, K=K)[0])
        if not math.isfinite(bound):
            continue
        gap = torch.linalg.matrix_norm(dense_jacobian(op, X, None, K) - exact, 2).item()
        assert gap <= bound
        ratios.append(gap / bound)
    assert ratios and max(ratios) >= {0.5: 0.1, 1.0: 0.02, 2.0: 1e-3}[scale]


def test_degree_meets_the_epsilon_and_refuses_large_radii():
    X = rand(50, 2, seed=300)
    X = X / X.norm(dim=1).max() * 1.5
    op = SelfAttention(rand(2, 2, seed=301), rand(2, 2, seed=302))
    K = sj.degree(op, X[None])
    r = float(sj._quantities(op, X[None], None)[0])
    assert series.error_bound(r, K - 1) <= torch.finfo(DT).eps < series.error_bound(r, K - 2)
    assert float(sj.truncation_bound(op, X[None], None, K=K)[0]) < 1e-12
    with pytest.raises(ValueError, match="attention: the series needs r"):
        sj.degree(op, 3 * X[None])
    with pytest.raises(ValueError, match="K"):
        sj.truncation_bound(op, X[None], None, K=0)


# ---------------------------------------------------------------------- the certified constant
def top_singular_value(op, X, lw):
    return torch.linalg.matrix_norm(dense_jacobian(op, X, lw), 2).item()


@pytest.mark.parametrize("weighted", [False, True])
def test_series_certificate_brackets_the_exact_constant(weighted):
    for seed in range(3):
        X = rand(60, 2, seed=400 + seed)
        X = X / X.norm(dim=1).max() * 1.5
        lw = torch.log_softmax(rand(60, seed=500 + seed), 0) if weighted else None
        for op in operators(2, 20 * seed):
            target = Measure(X, torch.exp(lw)) if weighted else X
            est = local_lipschitz(op, target, attention="series", tol=1e-8)
            exact = local_lipschitz(op, target, tol=1e-8)
            top = top_singular_value(op, X, None if not weighted else Measure(X, torch.exp(lw)).log_weights)
            assert est.converged
            assert est.value <= top * (1 + 1e-12) and top <= est.upper * (1 + 1e-12)
            assert abs(est.value - exact.value) <= est.error + exact.error + 1e-12 * top


def test_series_certificate_of_a_batch_and_its_truncation_term():
    X = rand(3, 40, 2, seed=600)
    X = X / X.norm(dim=-1).amax() * 1.2
    op = SelfAttention(rand(2, 2, seed=601), rand(2, 2, seed=602))
    est = local_lipschitz(op, X, attention="series")
    exact = local_lipschitz(op, X)
    K = sj.degree(op, X)
    eps = sj.truncation_bound(op, X, None, K=K)
    assert torch.all(eps > 0) and torch.all(eps < 1e-12)
    assert torch.all((est.value - exact.value).abs() <= est.error + exact.error)
    assert torch.all(est.error >= 2 * eps)


def test_series_option_refuses_what_it_does_not_cover():
    X = rand(20, 2, seed=700) * 0.3
    op = SelfAttention(rand(2, 2, seed=701), rand(2, 2, seed=702))
    with pytest.raises(ValueError, match="attention: expected 'auto', 'exact' or 'series'"):
        local_lipschitz(op, X, attention="fast")
    with pytest.raises(ValueError, match="attention: 'series' runs with the matrix-free"):
        local_lipschitz(op, X, attention="series", method="dense")
    with pytest.raises(ValueError, match="attention: a causal mask"):
        local_lipschitz(SelfAttention(op.A, op.V, masked=True), X, attention="series")
    mh = MultiHeadAttention([op, op], W_O=torch.eye(2, 4, dtype=DT))
    with pytest.raises(ValueError, match="attention: the series' truncation bound covers SelfAttention"):
        local_lipschitz(mh, X, attention="series")
    with pytest.raises(ValueError, match="attention: the series needs r"):
        local_lipschitz(op, 30 * X, attention="series")


def test_auto_takes_the_series_for_large_bounded_float64_inputs_only(monkeypatch):
    from meanfield.kernels import record_paths

    X = torch.rand(1500, 2, generator=torch.Generator().manual_seed(800), dtype=DT) - 0.5
    op = SelfAttention(rand(2, 2, seed=801), rand(2, 2, seed=802))
    with record_paths() as paths:
        small = local_lipschitz(op, X)
    assert "series" not in paths                      # 2.25e6 score entries: below the threshold
    monkeypatch.setattr(sj, "SERIES_THRESHOLD", 2**10)
    assert sj.preferred(op, X[None])
    with record_paths() as paths:
        auto = local_lipschitz(op, X)
    assert set(paths) == {"series"} and abs(auto.value - small.value) <= auto.error + small.error
    # what auto leaves exact: float32 points, masks, operators the bound does not cover, radii beyond the series',
    # and the dense solver
    assert not sj.preferred(op, X[None].float())
    assert not sj.preferred(SelfAttention(op.A, op.V, masked=True), X[None])
    assert not sj.preferred(MultiHeadAttention([op, op], W_O=torch.eye(2, 4, dtype=DT)), X[None])
    assert not sj.preferred(op, 40 * X[None])
    monkeypatch.setattr(sj, "auto_degree", lambda *a: 12)   # auto would take the series everywhere
    for kwargs in ({"method": "dense"}, {"attention": "exact"}):
        with record_paths() as paths:
            local_lipschitz(op, X[:60], **kwargs)
        assert "series" not in paths


def test_auto_floor_and_cost_model_follow_the_measured_crossovers():
    """series_jacobian.SERIES_THRESHOLD (2^22 score entries), product_cost and COST_RATIO against the crossovers
    measured on 2 CPU cores (benchmarks/README.md, bench_series.py --crossover): the study's disc (d = 2, r = 4.4)
    about even at 2000 points and 1.1x faster at 3000; sphere tokens in d = 3 at r = 0.9 1.3x at 3000 (left exact)
    and 2.5x at 6000; at r = 2 0.67x at 4000 and 1.1x at 6000 (both left exact)."""
    from studies.experiments.at_scale import seeded_attention, uniform_ball

    disc = seeded_attention(2, 0, None)
    assert not sj.preferred(disc, uniform_ball(2000, 2, 1.5, 1)[None])   # 4e6 entries: below the floor
    assert sj.preferred(disc, uniform_ball(3000, 2, 1.5, 1)[None])
    x = torch.randn(6000, 3, generator=torch.Generator().manual_seed(803), dtype=DT)
    x = x / x.norm(dim=1, keepdim=True)
    A = rand(3, 3, seed=804)
    sphere = [SelfAttention(s * A / torch.linalg.matrix_norm(A, 2), rand(3, 3, seed=805)) for s in (0.9, 2.0)]
    assert not sj.preferred(sphere[0], x[None, :3000])
    assert sj.preferred(sphere[0], x[None])
    assert not sj.preferred(sphere[1], x[None, :4000]) and not sj.preferred(sphere[1], x[None])


def test_the_cost_model_tracks_measured_product_times_across_head_sizes():
    """product_cost over the exact path's, against the ratios of the products' times measured on one CPU thread at
    n = 3000 (sphere tokens, ||A|| = 1.2, 0.9, 0.7, 0.55, 0.45 in d = 2..6: degrees 20, 18, 17, 16, 15): 0.197,
    0.671, 3.59, 12.3 and 56.2. Without the per-row overhead (ROW_DEGREE_COST) d = 2 came out at 0.068."""
    measured = {2: (20, 0.197), 3: (18, 0.671), 4: (17, 3.585), 5: (16, 12.28), 6: (15, 56.2)}
    for d, (K, ratio) in measured.items():
        model = sj.product_cost(1, 3000, d, d, K) / (sj.DENSE_PASSES * series.dense_cost(3000**2, d, d))
        assert 0.7 <= model / ratio <= 1.45, (d, model, ratio)


def test_kernel_sum_broadcasts_its_batch_dimensions_and_names_bad_arguments():
    # a review found mismatched batch shapes silently wrong (the features written into a buffer of another shape)
    x, y, w = rand(1, 4, 2, seed=900, scale=0.5), rand(3, 5, 2, seed=901, scale=0.5), rand(3, 5, 3, seed=902)
    assert torch.allclose(series.kernel_sum(x, y, w, 3), written_out(x, y, w, 3), rtol=1e-13, atol=1e-13)
    xg = x.clone().requires_grad_()
    want = torch.autograd.grad(written_out(xg, y, w, 3).sum(), xg)[0]
    assert torch.allclose(torch.autograd.grad(series.kernel_sum(xg, y, w, 3).sum(), xg)[0], want, rtol=1e-12)
    with pytest.raises(ValueError, match="x, y, w"):
        series.kernel_sum(x, y[..., :1], w, 3)
    with pytest.raises(ValueError, match="x, y, w"):
        series.kernel_sum(x, y, w[..., :4, :], 3)
    with pytest.raises(ValueError, match="w: expected a floating tensor"):
        series.kernel_sum(x, y, w.long(), 3)
    with pytest.raises(ValueError, match="K"):
        series.kernel_sum(x, y, w, 2.5)


def test_members_of_zero_weight_have_finite_gradients():
    # every log-weight of member 0 is -inf: its output is 0 @ v, and its gradients 0, as the dense path's
    q = rand(2, 6, 2, seed=910, scale=0.5).requires_grad_()
    k = rand(2, 7, 2, seed=911, scale=0.5).requires_grad_()
    v = rand(2, 7, 3, seed=912).requires_grad_()
    lw = torch.log_softmax(rand(2, 7, seed=913), -1)
    lw[0] = float("-inf")
    grads = {}
    for method in ("series", "dense"):
        with kernels.use(method):
            out = kernels.attend(q, k, v, lw)
        grads[method] = torch.autograd.grad((out * rand(2, 6, 3, seed=914)).sum(), (q, k, v))
    for gs, gd in zip(grads["series"], grads["dense"]):
        assert torch.isfinite(gs).all() and torch.allclose(gs, gd, atol=1e-12)


def test_vmap_through_the_series_names_the_method():
    X = rand(30, 2, seed=920, scale=0.3)
    op = SelfAttention(rand(2, 2, seed=921), rand(2, 2, seed=922))
    with kernels.use("series"), series.pinned(12), pytest.raises(NotImplementedError, match="method='series'"):
        torch.func.jacfwd(lambda Y: op.points_map(Y, None, None))(X)


def test_auto_counts_the_derivative_sums_in_its_cost():
    # sphere tokens in d = 3 at 9000 points: r = 0.9 (degree 18) and r = 1.3 (degree 21) take the series (measured
    # 1.7x and about 1.1-1.3x faster), r = 2.5 (degree 28, 3.7x the features of degree 18) stays exact
    g = torch.Generator().manual_seed(930)
    X = torch.randn(1, 9000, 3, generator=g, dtype=DT)
    X = X / X.norm(dim=-1, keepdim=True)
    A = torch.eye(3, dtype=DT)
    assert sj.preferred(SelfAttention(0.9 * A, A), X)
    assert sj.preferred(SelfAttention(1.3 * A, A), X)
    assert not sj.preferred(SelfAttention(2.5 * A, A), X)
    assert sj.product_cost(1, 9000, 3, 3, 18) == (2 * 9000 * series.feature_count(3, 18) * (1 + 4 * 7) +
                                                  sj.ROW_DEGREE_COST * 9000 * 18)




def test_a_tol_below_the_series_truncation_bound(monkeypatch):
    """A review: auto, taking the series, raised "raise max_iter or loosen tol" at tol = 2e-14 where the exact path
    converges (its error includes 2 eps_J, which no iteration lowers). auto now certifies such a member on the exact
    path; attention="series" says that the truncation bound is what stops it. Truth: the dense Jacobian."""
    from meanfield import ConvergenceError
    from meanfield.kernels import record_paths
    from studies.experiments.at_scale import seeded_attention, uniform_ball

    monkeypatch.setattr(sj, "SERIES_THRESHOLD", 2**10)
    monkeypatch.setattr(sj, "COST_RATIO", 1e9)   # auto takes the series whatever it costs at 300 points
    att, X = seeded_attention(2, 0, None), uniform_ball(300, 2, 1.5, 0)
    truth = float(torch.linalg.matrix_norm(torch.autograd.functional.jacobian(att.sequence, X).reshape(600, 600), 2))
    assert sj.preferred(att, X[None])
    with record_paths() as paths:
        est = local_lipschitz(att, X, tol=2e-14)
    assert "series" in paths and est.converged and abs(est.value - truth) <= est.error + 1e-13 * truth
    assert set(paths) != {"series"}                           # the exact path certified it
    with record_paths() as paths:
        local_lipschitz(att, X, tol=1e-6)
    assert set(paths) == {"series"}                           # at a usual tol the series' estimate is kept
    with pytest.raises(ConvergenceError, match="series' truncation bound .* use attention='exact' or tol >="):
        local_lipschitz(att, X, attention="series", tol=2e-14)


def test_mixed_precision_asked_of_the_series(monkeypatch):
    """A review: mixed=True was dropped without a word where the series ran. attention='series' now refuses it,
    naming the argument, and auto keeps the exact path (with its float32 phase) where mixed=True is asked."""
    from meanfield.kernels import record_paths
    from studies.experiments.at_scale import seeded_attention, uniform_ball

    monkeypatch.setattr(sj, "SERIES_THRESHOLD", 2**10)
    monkeypatch.setattr(sj, "COST_RATIO", 1e9)
    att, X = seeded_attention(2, 0, None), uniform_ball(300, 2, 1.5, 0)
    with pytest.raises(ValueError, match="mixed: the series' products run"):
        local_lipschitz(att, X, attention="series", mixed=True)
    with record_paths() as paths:
        mixed = local_lipschitz(att, X, mixed=True)
    assert "series" not in paths
    with record_paths() as paths:
        plain = local_lipschitz(att, X)
    assert set(paths) == {"series"} and abs(mixed.value - plain.value) <= mixed.error + plain.error


def test_an_estimate_says_which_attention_path_certified_it(monkeypatch):
    """A user could not tell whether auto had taken the series (whose truncation bound lowers value and raises
    error): the estimate now says it, checked against the paths the kernels recorded."""
    from meanfield.kernels import record_paths

    X = torch.rand(1500, 2, generator=torch.Generator().manual_seed(810), dtype=DT) - 0.5
    op = SelfAttention(rand(2, 2, seed=811), rand(2, 2, seed=812))
    exact = local_lipschitz(op, X)
    assert exact.attention == "exact" and "attention=" not in repr(exact)
    monkeypatch.setattr(sj, "SERIES_THRESHOLD", 2**10)
    with record_paths() as paths:
        auto = local_lipschitz(op, X)
    assert set(paths) == {"series"} and auto.attention == "series" and "attention='series'" in repr(auto)
    assert local_lipschitz(op, X, attention="series").attention == "series"
    assert local_lipschitz(op, X, attention="exact").attention == "exact"
    # a tol the truncation bound keeps out of reach (a bound made 1e-7 of the value here: the true one is below
    # float64's epsilon at this input): auto certifies again on the exact path, and says so
    monkeypatch.setattr(sj, "truncation_bound", lambda *a, **k: torch.tensor([1e-7 * exact.value], dtype=DT))
    with record_paths() as paths:
        back = local_lipschitz(op, X, tol=1e-7)
    assert "series" in paths and set(paths) - {"series"} and back.attention == "exact" and back.converged
    monkeypatch.undo()
    monkeypatch.setattr(sj, "SERIES_THRESHOLD", 2**10)
    batch = local_lipschitz(op, torch.stack([X, X.flip(0)]))
    assert batch.attention == "series" and batch[1].attention == "series"
