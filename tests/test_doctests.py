"""Every docstring example of the packages runs and prints what it says (doctest): an example a reader copies
must work. One test per module that has examples."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import warnings

import pytest

PACKAGES = ("particles", "transport", "meanfield", "studies")


def _modules_with_examples():
    names = []
    for pkg in PACKAGES:
        root = importlib.import_module(pkg)
        for info in pkgutil.walk_packages(root.__path__, pkg + "."):
            if info.name.endswith("__main__"):
                continue
            with warnings.catch_warnings():   # deprecated aliases (meanfield.sphere) say so when imported
                warnings.simplefilter("ignore", DeprecationWarning)
                mod = importlib.import_module(info.name)
            if any(t.examples for t in doctest.DocTestFinder().find(mod)):
                names.append(info.name)
    return names


@pytest.mark.parametrize("name", _modules_with_examples())
def test_docstring_examples_run(name, one_thread):
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples of {name} fail"
