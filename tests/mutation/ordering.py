"""A pytest plugin for mutation runs (docs/mutation.md): a mutant's tests run cheapest module first.

mutmut runs, for each mutant, the tests that reached the mutated function, and stops at the first
failure; the order decides what a killed mutant costs. The durations mutmut records leave out the
fixtures (a module fixture that runs every study takes minutes), so this plugin records the whole
time of each test (set-up, call, tear-down) during mutmut's clean run and, for a mutant, orders
the selected tests by module, cheapest module first, keeping each module's tests together so that
its module fixtures are built once. Inert outside mutmut (``MUTANT_UNDER_TEST`` unset).

Enabled by ``-p tests.mutation.ordering`` in ``[tool.mutmut] pytest_add_cli_args``.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

#: written into mutmut's working folder (mutants/), next to mutmut's own stats
DURATIONS = Path("mutation-test-durations.json")

_seconds: dict[str, float] = defaultdict(float)


def _phase() -> str | None:
    return os.environ.get("MUTANT_UNDER_TEST")


def _recording() -> bool:
    return _phase() in ("", "stats")


def pytest_runtest_logreport(report):
    if _recording():
        _seconds[report.nodeid] += report.duration


def pytest_sessionfinish(session, exitstatus):
    if _recording() and _seconds:
        known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        DURATIONS.write_text(json.dumps({**known, **_seconds}, indent=0, sort_keys=True))


def pytest_collection_modifyitems(session, config, items):
    if "__mutmut_" not in (_phase() or "") or not DURATIONS.exists():
        return
    seconds = json.loads(DURATIONS.read_text())
    module_cost: dict[str, float] = defaultdict(float)
    for item in items:
        module_cost[item.nodeid.split("::")[0]] += seconds.get(item.nodeid, 60.0)
    first_seen = {m: i for i, m in reversed(list(enumerate(item.nodeid.split("::")[0] for item in items)))}
    items.sort(key=lambda it: (module_cost[it.nodeid.split("::")[0]], first_seen[it.nodeid.split("::")[0]],
                               seconds.get(it.nodeid, 60.0)))
