"""torch's forward-mode AD, made ready without torch's own deprecation noise.

The first forward-mode product in a process (``torch.autograd.forward_ad``, ``torch.func.jvp`` or ``jacfwd``)
imports ``torch._decomp.decompositions_for_jvp``, whose module-level ``torch.jit.script`` calls each raise torch's
DeprecationWarning "`torch.jit.script` is deprecated" (18 of them under ``python -W always``): a warning about
torch's internals that no user of this framework can act on. :func:`ready` imports that module once, with exactly
that warning filtered; the framework calls it before its forward-mode products. Any other warning is left as it is.
"""

from __future__ import annotations

import functools
import warnings

__all__ = ["ready"]


@functools.cache
def ready() -> None:
    """Import torch's forward-mode decompositions once, torch.jit.script's DeprecationWarning filtered (module
    docstring); later calls cost a cached lookup."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=DeprecationWarning)
        try:
            import torch._decomp.decompositions_for_jvp  # noqa: F401
        except ImportError:  # pragma: no cover - a torch without that module has nothing to import quietly
            pass
