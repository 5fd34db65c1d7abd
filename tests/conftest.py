"""Shared fixtures, and the Hypothesis profiles of the suite.

Every property test (``@given``) of the default run is deterministic: the profile "deterministic"
derandomizes Hypothesis (the examples are a function of each test, the same on every run and
machine) and reads no example database (a failure stored by an earlier random run would otherwise
be replayed here and not on a fresh clone). A random campaign, new examples on every run with
failures stored in ``.hypothesis/`` and replayed first, is the profile "random":

    SMOOTH_ATTENTION_HYPOTHESIS=random python -m pytest tests/transport/test_fuzz.py

(``TRANSPORT_FUZZ_EXAMPLES=2000`` widens the transport fuzz further). A failure found that way is
kept as an explicit test (a plain test or ``@example``) before it is fixed.

Derandomized examples are a function of the test's source and of the constants Hypothesis finds in
the local modules imported so far (it mines them for interesting values): the same command draws
the same examples on every run, but one file run alone may draw other examples than the whole
suite. A failure prints its example and a ``@reproduce_failure`` blob (``print_blob``) that replays
it in isolation.
"""

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.register_profile("random", derandomize=False, print_blob=True)
PROFILE = os.environ.get("SMOOTH_ATTENTION_HYPOTHESIS", "deterministic")
if PROFILE not in ("deterministic", "random"):
    raise pytest.UsageError(f"SMOOTH_ATTENTION_HYPOTHESIS: expected 'deterministic' or 'random', got {PROFILE!r}")
settings.load_profile(PROFILE)


@pytest.fixture(scope="module")
def one_thread():
    """Pin torch to one thread for a module of many small problems (threads only contend there)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
