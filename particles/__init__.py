"""Measures: weighted particle clouds, optionally with positions in [0, 1] for masked attention."""

from .measure import Measure
from .validation import DEFAULT_DTYPE

__all__ = ["Measure", "DEFAULT_DTYPE"]
