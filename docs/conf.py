"""Sphinx configuration of smooth-attention's documentation: the API reference from the docstrings
(numpy style, through napoleon), the mathematical notes (docs/math.md, MyST Markdown with $...$ math)
and the examples.

Build (warnings are errors, every cross-reference must resolve):
``python -m sphinx -n -W --keep-going -q -b html docs docs/_build/html``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the packages of this checkout, installed or not
os.environ.setdefault("MPLBACKEND", "Agg")

from particles import __version__ as _version  # noqa: E402

project = "smooth-attention"
author = "the smooth-attention developers"
copyright = "the smooth-attention developers"
release = _version
version = ".".join(_version.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# sweeps.md links to ../benchmarks/, outside the documentation sources: kept for GitHub readers only
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []

# ---------------------------------------------------------------- autodoc
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True,
                           "member-order": "bysource"}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autoclass_content = "class"
autodoc_preserve_defaults = True
autosummary_generate = False
# optional dependencies are imported only where a page documents them; none is mocked
autodoc_mock_imports: list[str] = []

napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_use_ivar = True
napoleon_preprocess_types = False

# ---------------------------------------------------------------- MyST (docs/math.md uses $...$ and $$...$$)
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3  # math.md links to its own sections by their anchors

# ---------------------------------------------------------------- output
html_theme = "furo"
html_title = f"smooth-attention {release}"
html_static_path: list[str] = []

# ---------------------------------------------------------------- cross-references
# Every reference must resolve (the CI build also passes -n). Only names of other projects may be
# listed here: there is no intersphinx (the build runs offline), so their references stay unlinked.
nitpicky = True
nitpick_ignore_regex = [
    # PyTorch and NumPy types in signatures and docstrings (torch.Tensor, torch.dtype, numpy.ndarray, ...)
    ("py:.*", r"(torch|numpy|np)\..+"),
    # the standard library's types in signatures (pathlib.Path, collections.abc.Callable, os.PathLike, ...)
    ("py:.*", r"(pathlib|collections\.abc|os|argparse)\..+"),
    # the Hugging Face transformers layers that meanfield.hf accepts, named in its docstrings
    ("py:class", r"GPT2Attention|BertSelfAttention|BertAttention"),
]


def _public_alias(app, env, node, contnode):
    """Resolve a reference written with the path a name is imported from.

    ``meanfield.local_lipschitz`` is documented where it is defined, as
    ``meanfield.lipschitz.local_lipschitz``: a reference written with the public import path, or with
    a name the current module imports (``Measure`` in :mod:`meanfield.dynamics`), goes to that
    description. Constants are found by identity (``transport.DEFAULTS`` is the object documented
    as ``transport.options.DEFAULTS``). A name documented nowhere still fails the build.
    """
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    modname = node.get("py:module")
    domain = env.get_domain("py")
    for path in [target] + ([f"{modname}.{target}"] if modname else []):
        canonical = _canonical(path, domain)
        if canonical is not None and canonical != path:
            return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], canonical,
                                       node.deepcopy(), contnode)
    return None


def _canonical(path, domain):
    """The name under which the object at ``path`` (a dotted import path) is documented, or None."""
    import importlib
    import types

    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        tail = parts[cut:]
        base, done, found_all = obj.__name__, 0, True  # base: the documented name of tail[:done]'s object
        for i, attr in enumerate(tail):
            if not hasattr(obj, attr):  # a dataclass field without a default, say: named after its class
                found_all = False
                break
            obj = getattr(obj, attr)
            if isinstance(obj, types.ModuleType):
                base, done = obj.__name__, i + 1
            elif all(isinstance(getattr(obj, key, None), str) for key in ("__module__", "__qualname__")):
                base, done = f"{obj.__module__}.{obj.__qualname__}", i + 1
        rest = tail[done:]
        name = ".".join([base, *rest])
        if name in domain.objects:
            return name
        if not found_all:
            return None
        # a constant: the documented module-level name bound to this very object
        found = [other for other, entry in domain.objects.items()
                 if entry.objtype == "data" and other.rsplit(".", 1)[-1] == parts[-1]
                 and _lookup(other) is obj]
        return found[0] if len(found) == 1 else None
    return None


def _lookup(name):
    import importlib

    home, attr = name.rsplit(".", 1)
    try:
        return getattr(importlib.import_module(home), attr, None)
    except ImportError:
        return None


def setup(app):
    app.connect("missing-reference", _public_alias)
