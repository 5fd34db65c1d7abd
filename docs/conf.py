"""Sphinx configuration of smooth-attention's documentation: the API reference from the docstrings
(numpy style, through napoleon), the mathematical notes (docs/math.md, MyST Markdown with $...$ math)
and the examples.

Build (warnings are errors): ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
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
nitpicky = False
