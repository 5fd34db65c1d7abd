"""The bounds and the worst-case search at extreme scales (a review that fuzzed the bounds in both directions, and
one of "every call returns", 2026-11-29): each test fails on the code before its fix."""

import warnings

import numpy as np
import pytest
import torch

from meanfield import SelfAttention


def test_the_large_radius_limit_does_not_depend_on_the_scale_of_its_direction():
    """Theorem 3.7's limit is a function of the direction X: X scaled by 1e-6 was refused as a tie (an absolute
    test on small scores), and scores at R = 1e160 overflowed. Truth: the maximizers, computed here in exact
    arithmetic on the unscaled integers."""
    from meanfield import bounds

    A = np.array([[2, -1, 0], [1, 3, 1], [0, 1, -2]])
    X = np.array([[3, 1, 0], [0, 2, 1], [1, 0, 3], [2, 2, 2], [1, -1, 0]])
    S = (X @ A.T) @ X.T                                        # integers: exact
    assert all(sorted(row)[-1] > sorted(row)[-2] for row in S)  # a unique maximizer in every row
    limit = bounds.large_radius_limit(A, np.eye(3), X)
    for c in (1e-6, 1e-150, 1e160):
        assert (bounds.argmax_indices(A, c * X) == S.argmax(axis=1)).all()
        assert bounds.large_radius_limit(c * A, np.eye(3), c * X) == limit
    with pytest.raises(ValueError, match="not unique"):       # a true tie stays one at every scale
        bounds.argmax_indices(np.eye(2), 1e-6 * np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]))


def test_an_upper_bound_with_a_key_bias_at_a_huge_radius_is_a_logarithm_not_an_error():
    import math
    import warnings

    from meanfield import operator_upper
    from meanfield.bounds import sqrt_n_upper

    op = SelfAttention(np.eye(2), np.eye(2), key_bias=[1.0, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # Theorem 3.3's log is finite: Theorem 3.5's overflow is not the result
        up = operator_upper(op, 1.4e154, 8)   # ValueError "R: ... got inf" before (sqrt(R * R + t * t))
    # Theorem 3.3 on the lifted tokens, in logarithms: sqrt(3) (||A'||^2 R'^4 (4n + 1) + n)^(1/2), R' >= R
    assert up.known and up.source.startswith("Theorem 3.3")
    assert 0.5 * math.log(3) + 2 * math.log(1.4e154) + 0.5 * math.log(33) <= up.log_value < math.inf
    assert sqrt_n_upper(np.eye(2), np.eye(2), 1e200, 8, log=True) == pytest.approx(
        0.5 * math.log(3) + 0.5 * (4 * math.log(1e200) + math.log(33)), rel=1e-12)
    assert sqrt_n_upper(np.eye(2), np.zeros((2, 2)), 1.0, 8, log=True) == -math.inf


def test_a_search_refuses_a_radius_whose_squared_norms_overflow_and_says_which_starts_overflowed():
    import warnings

    from meanfield.worst_case import worst_case_sequence

    op = SelfAttention(torch.eye(3, dtype=torch.float64), torch.eye(3, dtype=torch.float64))
    # every start at R = 1e160 was projected to the origin (its norm overflowed), and the bound came from there
    with pytest.raises(ValueError, match=r"R: 1e\+160 is above 1.34e\+154, where the squared norms"):
        worst_case_sequence(op, R=1e160, n=3, budget=50)
    op32 = SelfAttention(torch.eye(3), torch.eye(3))
    with pytest.raises(ValueError, match=r"R: 2e\+19 is above 1.84e\+19, where .* overflow float32"):
        worst_case_sequence(op32, R=2e19, n=3, budget=50)
    # float16 at R = 200 (200^2 = 4e4 < 65504): searched, as before the limit (a first limit of half the square root
    # refused it); the certified constant is float32's to the half type's rounding
    f16 = dict(dtype=torch.float16)
    half = worst_case_sequence(SelfAttention(0.01 * torch.eye(3, **f16), torch.eye(3, **f16)), R=200, n=3, budget=30)
    full = worst_case_sequence(SelfAttention(0.01 * torch.eye(3), torch.eye(3)), R=200, n=3, budget=30)
    assert half.lower == pytest.approx(full.lower, rel=1e-2)
    # one start whose constant overflows, one that does not: the search says so (it was silent)
    big = SelfAttention(1e300 * torch.eye(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64))
    origin = torch.zeros(3, 2, dtype=torch.float64)
    far = torch.tensor([[1e10, 0.0], [0.0, 1e10], [-1e10, 0.0]], dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = worst_case_sequence(big, R=1e10, n=3, budget=50, starts=[("origin", origin), ("far", far)])
    # one warning for the search, its ascent from the given starts and the ladder's after it (11 starts in all)
    lost = [w for w in caught if "overflows the dtype's range" in str(w.message)]
    assert len(lost) == 1 and lost[0].filename == __file__
    assert "at 1 of " in str(lost[0].message) and "starts (far);" in str(lost[0].message)
    assert not [w for w in caught if "encountered" in str(w.message)]   # numpy's own overflow warnings
    assert res.start_record("origin").final <= res.lower < float("inf")   # the ladder's rungs may do better


def test_starts_lost_to_overflow_in_both_ascents_are_named_once_and_the_search_keeps_its_result(monkeypatch):
    """The ladder's second ascent warned on its own (a second warning for one search), and where every one of its
    starts overflowed it raised the OverflowError of a search with no start left, although the first ascent had a
    finite result: one warning names the lost starts of both, the result is the first ascent's."""
    from meanfield import worst_case

    big = SelfAttention(1e300 * torch.eye(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64))
    origin = torch.zeros(3, 2, dtype=torch.float64)
    far = torch.tensor([[1e10, 0.0], [0.0, 1e10], [-1e10, 0.0]], dtype=torch.float64)
    monkeypatch.setattr(worst_case, "ladder_sequence_starts", lambda *a, **kw: [("rung-far", 0.5 * far)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = worst_case.worst_case_sequence(big, R=1e10, n=3, budget=400, starts=[("origin", origin), ("far", far)])
    lost = [str(w.message) for w in caught if "overflows the dtype's range" in str(w.message)]
    assert lost == [lost[0]] and "at 2 of 3 starts (far, rung-far)" in lost[0], lost
    assert [s.name for s in res.starts] == ["origin", "far", "rung-far"]
    assert res.start_record("origin").final == res.lower < float("inf")
