"""What a device can hold and run: the memory budget of a computation, and whether Triton kernels run there.

Kernels that work in tiles (the attention kernel of :mod:`meanfield.kernels`, the streaming Sinkhorn of
:mod:`transport.streaming_sinkhorn`) size their tiles by :func:`memory_budget`, and pick a Triton kernel where
:func:`triton_runs` says one runs. Both are small queries kept apart from the decisions that use them,
so that those decisions are pure functions of (device type, dtype, shapes, budget) and testable on CPU.
"""

from __future__ import annotations

import functools
import os
import time
import warnings

import torch

from .validation import memory_limit

__all__ = ["memory_budget", "triton_runs", "triton_interpreted", "run_triton", "run_or_fall_back", "triton_min_dot_k",
           "ALWAYS_FREE", "DRIVER_TTL", "STRICTEST_MIN_DOT_K"]

#: the smallest reduction K of a Triton matrix product (``tl.dot``) by operand width in bits where the
#: installed Triton does not say: Triton 3.6 asks K >= 16 of every type but the 8-bit ones (32), later
#: versions 8 of float32 and 4 of float64 (their NVIDIA backend's ``min_dot_size``)
STRICTEST_MIN_DOT_K = {8: 32, 16: 16, 32: 16, 64: 16}


#: a computation that needs at most this many bytes is not asked about the device's free memory (the
#: driver query took about half of an attention call at N = 1e3 on an H200)
ALWAYS_FREE = 2**26

#: seconds a reading of the driver's free memory is reused, corrected by what torch's own allocator reserved
#: or released since: the query (cudaMemGetInfo) with torch's Python-side allocator statistics cost about
#: 0.4 ms on an H200, the whole fixed cost of a small attention call, and every streamed call sizes its tiles
#: by the budget. Another process's allocations are seen within this delay; a need above the corrected
#: reading always asks the driver again before it is refused or turned to a smaller path
DRIVER_TTL = 0.25

#: CUDA device index -> (time.monotonic() of the query, the driver's free bytes, torch's reserved bytes then)
_READINGS: dict = {}


def _allocator_bytes(index: int) -> tuple[int, int]:
    """(reserved, allocated) bytes of torch's caching allocator on CUDA device ``index``, from one C++ call
    (``torch.cuda.memory_reserved`` and ``memory_allocated`` each build and sort the whole statistics dict in
    Python); the public functions where that call is not there (another torch, or CUDA not initialized)."""
    try:
        stats = torch._C._cuda_memoryStats(index)
        return int(stats["reserved_bytes"]["all"]["current"]), int(stats["allocated_bytes"]["all"]["current"])
    except (AttributeError, KeyError, TypeError, RuntimeError):
        try:
            return int(torch.cuda.memory_reserved(index)), int(torch.cuda.memory_allocated(index))
        except (RuntimeError, AssertionError):
            return 0, 0


def _free_bytes(device: torch.device, need=None) -> int:
    """Free bytes on a CUDA device for this process: the driver's free memory plus torch's cached but unused
    blocks. The driver is asked at most once per :data:`DRIVER_TTL` seconds (its reading corrected by torch's
    reserve since), and again whenever ``need`` exceeds the corrected reading."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    reserved, allocated = _allocator_bytes(index)

    def ask():
        _READINGS[index] = (time.monotonic(), int(torch.cuda.mem_get_info(index)[0]), reserved)
        return _READINGS[index]

    def estimate(reading):
        # torch's allocator took (or gave back) reserved - reading[2] bytes from the driver since the reading
        return max(0, reading[1] - (reserved - reading[2])) + max(0, reserved - allocated)

    reading = _READINGS.get(index)
    fresh = reading is None or time.monotonic() - reading[0] > DRIVER_TTL
    if fresh:
        reading = ask()
    free = estimate(reading)
    if need is not None and need > free and not fresh:
        free = estimate(ask())
    return free


def memory_budget(device, limit=None, *, need=None) -> int:
    """Bytes a computation on ``device`` may allocate: the framework's memory limit
    (:func:`particles.validation.memory_limit`, ``limit`` or ``$SMOOTH_ATTENTION_MEMORY_LIMIT``), capped on
    CUDA by the device's free memory (``torch.cuda.mem_get_info``, asked at most every :data:`DRIVER_TTL`
    seconds unless ``need`` exceeds the last reading; torch's cached blocks count as free).
    ``need``: the bytes the caller is about to weigh against the budget; at most :data:`ALWAYS_FREE` of them
    are taken to be free on the device (the framework's limit still applies) without asking the driver."""
    cap = memory_limit(limit)
    device = device if isinstance(device, torch.device) else torch.device(device)
    if device.type != "cuda" or (need is not None and need <= min(cap, ALWAYS_FREE)):
        return cap
    return int(min(cap, _free_bytes(device, need)))


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def triton_min_dot_k(bits: int) -> int:
    """The smallest reduction K that the installed Triton's NVIDIA backend accepts in ``tl.dot`` for operands
    of ``bits`` bits (its ``min_dot_size`` at sm_90), read once; :data:`STRICTEST_MIN_DOT_K` where Triton is
    absent or does not say. The kernels zero-pad their feature columns to at least this (d = 3 in float32:
    8 columns with Triton 3.9, 16 with Triton 3.6, whose ``tl.dot`` refuses K = 8 at compile time)."""
    if bits not in STRICTEST_MIN_DOT_K:
        raise ValueError(f"bits: expected one of {sorted(STRICTEST_MIN_DOT_K)}, got {bits!r}")
    try:
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import min_dot_size

        t = {8: tl.float8e4nv, 16: tl.float16, 32: tl.float32, 64: tl.float64}[bits]
        k = int(min_dot_size(GPUTarget("cuda", 90, 32))(t, t)[2])
    except Exception:  # no Triton, or a layout of it without this function: the strictest known floor
        return STRICTEST_MIN_DOT_K[bits]
    return max(1, k)


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


def _compile_reason(exc) -> str:
    """The reason of a Triton compile error in one line: Triton's message quotes the kernel's source first and
    chains the cause (``Input shapes should have ... K >= 16``), which is what a reader needs."""
    causes = []
    while exc is not None and len(causes) < 8:
        causes.append(exc)
        exc = exc.__cause__ or exc.__context__
    for e in reversed(causes):
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        if lines:
            head = lines[0] if len(causes) == 1 else lines[-1]
            return f"{type(e).__name__}: {head}"[:300]
    return type(causes[0]).__name__ if causes else "unknown error"


def run_or_fall_back(failed: dict, key, kernel, fallback, refused, message):
    """``kernel()``, or ``fallback()`` (a slower path computing the same thing) once the kernel refused a call
    of ``key``: an exception for which ``refused(exc)`` is true is recorded in ``failed`` (key -> repr), warned
    about once (RuntimeWarning, ``message(exc)``) and answered by the fallback, as is every later call with that
    key at once; any other exception (an error of the computation itself) propagates."""
    if key in failed:
        return fallback()
    try:
        return kernel()
    except Exception as exc:
        if not refused(exc):
            raise
        failed[key] = repr(exc)
        warnings.warn(message(exc), RuntimeWarning, stacklevel=4)
        return fallback()


def run_triton(key, kernel, fallback, what: str):
    """``kernel()``, or ``fallback()`` (the torch path computing the same thing) where the Triton kernel of
    ``key`` does not compile on this GPU: the first failure warns (RuntimeWarning naming the error) and
    every later call with that key takes the fallback at once. Errors of the computation itself (a CUDA
    error, a wrong input) propagate. The kernels are compiled without spills for sm_80 and sm_90 by the
    tests; this covers other GPUs and Triton versions."""
    return run_or_fall_back(_FAILED, key, kernel, fallback, _compile_failure,
                            lambda exc: f"{what}: the Triton kernel does not compile here ({_compile_reason(exc)}); "
                                        "computing with torch instead from now on in this process")
