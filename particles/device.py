"""What a device can hold and run: the memory budget of a computation, and whether Triton kernels run there.

Kernels that work in tiles (the attention kernel of :mod:`meanfield.kernels`, the streaming Sinkhorn of
:mod:`transport.streaming_sinkhorn`) size their tiles by :func:`memory_budget`, and pick a Triton kernel where
:func:`triton_runs` says one runs. Both are small queries kept apart from the decisions that use them,
so that those decisions are pure functions of (device type, dtype, shapes, budget) and testable on CPU.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from .validation import memory_limit

__all__ = ["memory_budget", "triton_runs", "triton_interpreted", "run_triton"]


def memory_budget(device, limit=None) -> int:
    """Bytes a computation on ``device`` may allocate: the framework's memory limit
    (:func:`particles.validation.memory_limit`, ``limit`` or ``$SMOOTH_ATTENTION_MEMORY_LIMIT``), capped on
    CUDA by the device's free memory (``torch.cuda.mem_get_info``; torch's cached blocks count as free)."""
    cap = memory_limit(limit)
    device = torch.device(device)
    if device.type != "cuda":
        return cap
    free, _ = torch.cuda.mem_get_info(device)
    try:
        # memory torch holds in its cache but does not use is free for this process
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    except (RuntimeError, AssertionError):
        cached = 0
    return int(max(0, min(cap, free + cached)))


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreted() -> bool:
    """Whether Triton kernels are asked to run in its interpreter (``TRITON_INTERPRET=1``, which Triton reads
    when it is first imported): on CPU tensors, for tests without a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_runs(device_type: str) -> bool:
    """Whether the framework's Triton kernels can run on tensors of ``device_type``: compiled on CUDA
    (Triton ships with torch's CUDA wheels on Linux), interpreted on CPU only under ``TRITON_INTERPRET=1``."""
    if not _triton_importable():
        return False
    if device_type == "cuda":
        return torch.cuda.is_available()
    return device_type == "cpu" and triton_interpreted()


#: Triton kernels that failed to compile in this process (key -> the error), run by their torch path since
_FAILED: dict = {}


def _compile_failure(exc) -> bool:
    """A Triton compile-time or resource error (not an error of the computation, nor of the interpreter)."""
    try:
        from triton.errors import TritonError
        from triton.runtime.errors import InterpreterError
    except ImportError:
        return False
    return isinstance(exc, TritonError) and not isinstance(exc, InterpreterError)


def run_triton(key, kernel, fallback, what: str):
    """``kernel()``, or ``fallback()`` (the torch path computing the same thing) where the Triton kernel of
    ``key`` does not compile on this GPU: the first failure warns (RuntimeWarning naming the error) and
    every later call with that key takes the fallback at once. Errors of the computation itself (a CUDA
    error, a wrong input) propagate. The kernels are compiled without spills for sm_80 and sm_90 by the
    tests; this covers other GPUs and Triton versions."""
    if key in _FAILED:
        return fallback()
    try:
        return kernel()
    except Exception as exc:
        if not _compile_failure(exc):
            raise
        _FAILED[key] = repr(exc)
        warnings.warn(f"{what}: the Triton kernel does not compile here ({str(exc)[:300]}); computing with "
                      "torch instead from now on in this process", RuntimeWarning, stacklevel=3)
        return fallback()
