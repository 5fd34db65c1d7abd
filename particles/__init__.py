"""Measures: weighted particle clouds, optionally with positions in [0, 1] for masked attention."""

from ._version import DISTRIBUTION as __smooth_attention__  # noqa: F401  (marker: this is smooth-attention's)
from ._version import __version__ as __version__
from .ball import into_ball
from .io import load_measure, save_measure
from .measure import Measure
from .validation import DEFAULT_DTYPE

__all__ = ["Measure", "DEFAULT_DTYPE", "save_measure", "load_measure", "into_ball"]
