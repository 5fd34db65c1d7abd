"""The version of the ``smooth-attention`` distribution that ships particles, transport, meanfield and studies.

Read from the installed distribution's metadata; in a source tree that was never installed (the
folder put on ``sys.path`` by hand) from ``pyproject.toml`` next to the packages.
"""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

DISTRIBUTION = "smooth-attention"


def _from_source_tree() -> str:
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return "0+unknown"
    # the [project] table's version line (tomllib is Python >= 3.11 only)
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    found = re.search(r'^version\s*=\s*"([^"]+)"', project.group(1), re.M) if project else None
    return found.group(1) if found else "0+unknown"


def distribution_version() -> str:
    """The installed ``smooth-attention`` version, else the source tree's, else ``"0+unknown"``."""
    here = Path(__file__).resolve().parent.parent
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return _from_source_tree()
    # an installed distribution of another checkout would report its own version, not this tree's
    if (here / "pyproject.toml").is_file() and not _is_this_tree(dist, here):
        return _from_source_tree()
    return dist.version


def _is_this_tree(dist, here: Path) -> bool:
    """Whether an installed (possibly editable) distribution points at this source tree."""
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return True
    url = urlparse(direct.get("url", ""))
    if not direct.get("dir_info", {}).get("editable") or url.scheme != "file":
        return True  # a regular install: the packages are its own files
    try:
        return Path(unquote(url.path)).resolve() == here
    except OSError:
        return False


__version__ = distribution_version()
