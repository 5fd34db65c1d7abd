"""A pytest plugin for mutation runs with mutmut (docs/mutation.md). Inert outside mutmut.

Two jobs, both about which tests a mutant meets and in what order:

* **Module fixtures.** mutmut maps each mutated function to the tests that called it while it
  records (its "stats" run). A module-scoped fixture runs inside the first test of its module, so
  the functions it calls (a fixture that runs every study calls most of ``studies``) would be
  credited to that test alone, and a mutant there would never meet the module's other tests,
  which check the fixture's output. Here every test of a module is credited with what the earlier
  tests of that module called.
* **Order.** For each mutant mutmut runs its tests and stops at the first failure, so the order
  decides what a killed mutant costs. The whole time of each test (set-up, call, tear-down) is
  recorded during mutmut's runs of unmutated code, and a mutant's tests run cheapest module
  first, each module's tests together (its module fixtures are built once).

Enabled by ``-p tests.mutation.plugin`` in ``[tool.mutmut] pytest_add_cli_args``; mutmut sets
``MUTANT_UNDER_TEST`` ("stats" while it records, "" for its clean run, a mutant's name otherwise).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

#: written into mutmut's working folder (mutants/), next to mutmut's own stats
DURATIONS = Path("mutation-test-durations.json")

_seconds: dict[str, float] = defaultdict(float)
_called_in_module: dict[str, set[str]] = defaultdict(set)


def _phase() -> str | None:
    return os.environ.get("MUTANT_UNDER_TEST")


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    # before mutmut's own teardown hook hands the functions this test called over to its map
    if _phase() != "stats":
        return
    from mutmut.state import state

    called = state()._stats
    seen = _called_in_module[_module(item.nodeid)]
    seen |= called
    called |= seen


def pytest_runtest_logreport(report):
    if _phase() in ("", "stats"):
        _seconds[report.nodeid] += report.duration


def pytest_sessionfinish(session, exitstatus):
    if _phase() in ("", "stats") and _seconds:
        known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        DURATIONS.write_text(json.dumps({**known, **_seconds}, indent=0, sort_keys=True))


def pytest_collection_modifyitems(session, config, items):
    if "__mutmut_" not in (_phase() or "") or not DURATIONS.exists():
        return
    seconds = json.loads(DURATIONS.read_text())
    module_cost: dict[str, float] = defaultdict(float)
    for item in items:
        module_cost[_module(item.nodeid)] += seconds.get(item.nodeid, 60.0)
    first_seen = {m: i for i, m in reversed(list(enumerate(_module(item.nodeid) for item in items)))}
    items.sort(key=lambda it: (module_cost[_module(it.nodeid)], first_seen[_module(it.nodeid)],
                               seconds.get(it.nodeid, 60.0)))
