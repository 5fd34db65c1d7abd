"""The default suite is deterministic: every property test (``@given``) runs under the profile of
tests/conftest.py that derandomizes Hypothesis and reads no example database (a failure met in a
random run would otherwise be replayed by some clones and not others).

Truths: the settings each collected property test resolves to, and two runs of one property test
drawing the same examples.
"""

from __future__ import annotations

import importlib
import os
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = pathlib.Path(__file__).parent

pytestmark = pytest.mark.skipif(os.environ.get("SMOOTH_ATTENTION_HYPOTHESIS", "deterministic") != "deterministic",
                                reason="a random Hypothesis campaign was asked for")


def property_tests():
    """(name, test) for every ``@given`` test in the repository's tests."""
    for path in sorted(ROOT.rglob("test_*.py")):
        if "@given" not in path.read_text():
            continue
        module = importlib.import_module(".".join(path.relative_to(ROOT.parent).with_suffix("").parts))
        for name, fn in sorted(vars(module).items()):
            if getattr(fn, "is_hypothesis_test", False):
                yield f"{path.relative_to(ROOT)}::{name}", fn


def test_every_property_test_is_derandomized():
    found = list(property_tests())
    # tests/meanfield/test_hardening.py (5), tests/transport/test_exact.py (3), tests/transport/test_fuzz.py (4)
    assert len(found) >= 12, [name for name, _ in found]
    for name, fn in found:
        resolved = getattr(fn, "_hypothesis_internal_use_settings", settings.default)
        assert resolved.derandomize and resolved.database is None, name


def test_two_runs_draw_the_same_examples():
    drawn = []

    @settings(max_examples=20)
    @given(st.floats(-1e3, 1e3), st.integers(1, 5))
    def probe(x, n):
        drawn.append((x, n))

    probe()
    first, drawn[:] = list(drawn), []
    probe()
    assert drawn == first and len(set(first)) > 5
