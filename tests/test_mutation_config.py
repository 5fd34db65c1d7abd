"""The mutation-testing configuration (docs/mutation.md) names files that exist: a file that moved
would silently drop out of the mutated core."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")

ROOT = Path(__file__).resolve().parents[1]


def test_every_mutated_file_exists_and_every_core_room_is_covered():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    missing = [f for f in cfg["only_mutate"] if not (ROOT / f).is_file()]
    assert not missing, f"only_mutate names files that do not exist: {missing}"
    for room in ("meanfield/bounds/sqrt_n.py", "meanfield/krylov.py", "meanfield/jacobian.py", "transport/sinkhorn.py"):
        assert room in cfg["only_mutate"]
    for folder in cfg["pytest_add_cli_args_test_selection"]:
        assert (ROOT / folder).exists(), folder
