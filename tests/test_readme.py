"""Every ```python block of README.md runs as written, in order, in one namespace (the blocks read as
one session: the second continues the first)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ```python blocks of a Markdown text, each with the README line number of its first line."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def run_blocks(text: str, name: str = "README.md") -> dict:
    """Execute the blocks in one namespace; a failing block raises with its line numbers in the README."""
    namespace: dict = {"__name__": "__readme__"}
    for line, code in python_blocks(text):
        # pad with newlines so that tracebacks give the line numbers of the README itself
        exec(compile("\n" * (line - 1) + code, name, "exec"), namespace)
    return namespace


def test_readme_has_python_blocks():
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 2, "README.md lost its python examples"
    assert all(code.strip() for _, code in blocks)


def test_readme_blocks_run(tmp_path, monkeypatch, one_thread, capsys):
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)  # anything a block writes stays out of the checkout
    ns = run_blocks(README.read_text(encoding="utf-8"))
    # the names the README promises exist after it ran
    for name in ("att", "mu", "est", "nu", "traj"):
        assert name in ns, f"README.md no longer defines {name!r}"
    assert capsys.readouterr().out.strip()


def test_a_broken_block_fails_with_its_readme_line():
    text = "intro\n\n```python\nx = 1\n```\n\ntext\n\n```python\ny = x + 1\nz = undefined_name\n```\n"
    with pytest.raises(NameError, match="undefined_name") as info:
        run_blocks(text, "fake.md")
    frames = [f for f in info.traceback if str(f.path) == "fake.md"]
    assert frames and frames[-1].lineno + 1 == 11  # pytest's lineno is 0-based
    # bash blocks and indented fences are not executed
    assert python_blocks("```bash\nexit 1\n```\n") == []


def test_blocks_keep_their_order_and_namespace():
    ns = run_blocks("```python\na = [1]\n```\n\n```python\na.append(2)\n```\n")
    assert ns["a"] == [1, 2]


def test_readme_time_and_memory_table_is_the_measured_one():
    """The README's time/memory table is studies/data/costs.json (the file ``meanfield --help`` prints),
    so a re-measurement that is not pasted into the README fails here."""
    from studies import costs

    data = costs.load()
    assert data["levels"].get("quick"), "studies/data/costs.json has no quick-level measurement"
    assert costs.markdown_table(data) in README.read_text(encoding="utf-8"), (
        "README.md's time and memory table differs from studies/data/costs.json: paste "
        "`python -c 'from studies import costs; print(costs.markdown_table())'` into the README")


def test_help_prints_the_same_measurements():
    from studies import costs
    from studies.cli import build_parser

    data = costs.load()
    text = build_parser().format_help()
    for name, entry in data["levels"]["quick"]["studies"].items():
        assert name in text
        if entry.get("status") == "ok":
            assert f"{entry['peak_gib']:.1f} GiB" in text


def test_readme_claims_table_is_the_reports_short_form():
    """The README's copy of the report's claims table has report.claims_table's header and reads without
    escapes: five cells per row, each one line of at most SHORT_MAX characters, ids of the form
    <study>-<k> numbered from 1 within each study."""
    from studies.contract import SHORT_MAX
    from studies.report import claims_table

    header = claims_table({"studies": {}}).splitlines()[0]
    lines = README.read_text(encoding="utf-8").splitlines()
    assert header in lines, "README.md lost the report's claims table (or has the old, long form)"
    rows = []
    for line in lines[lines.index(header) + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    assert len(rows) >= 40
    seen: dict = {}
    for row in rows:
        assert "\\|" not in row, row
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert len(cells) == 5 and all(len(c) <= SHORT_MAX for c in cells), row
        study, k = cells[0].rsplit("-", 1)
        assert int(k) == seen.get(study, 0) + 1, row
        seen[study] = int(k)
