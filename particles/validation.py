"""Input checks shared by every layer of the framework.

Each check raises a ``ValueError`` or ``TypeError`` that names the argument and says what was
wrong; nothing is silently coerced except the documented conversions (numpy or Python
numbers to a torch tensor; integer arrays to the default floating dtype).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import numbers
import os

import numpy as np
import torch

DEFAULT_DTYPE = torch.float64

_OUTPUT_CHECKS_DEFERRED = contextvars.ContextVar("smooth_attention_output_checks_deferred", default=False)


@contextlib.contextmanager
def output_checks_deferred():
    """Inside, the attention kernels and the operators skip their check that an output is finite (a
    reduction and a host sync each, which on an accelerator stalls the pipeline): for callers that check
    what they compute from those outputs themselves. :func:`meanfield.simulate` uses it: every stage's
    particles are checked before the field is evaluated there, and a non-finite velocity makes the next
    stage's particles non-finite."""
    token = _OUTPUT_CHECKS_DEFERRED.set(True)
    try:
        yield
    finally:
        _OUTPUT_CHECKS_DEFERRED.reset(token)


def output_checks_are_deferred() -> bool:
    """Whether the caller is inside :func:`output_checks_deferred`."""
    return _OUTPUT_CHECKS_DEFERRED.get()


def resolve_dtype(dtype) -> torch.dtype | None:
    """Accept a torch dtype, a numpy dtype or a name such as ``"float32"``."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        value = getattr(torch, dtype, None)
        if isinstance(value, torch.dtype):
            return value
        raise TypeError(f"dtype: unknown dtype name {dtype!r}")
    try:
        return torch.from_numpy(np.zeros(0, dtype=np.dtype(dtype))).dtype
    except TypeError as exc:
        raise TypeError(f"dtype: cannot interpret {dtype!r} as a dtype") from exc


def float_dtype(dtype, name: str = "dtype") -> torch.dtype | None:
    """:func:`resolve_dtype`, refusing non-floating dtypes (an int64 operator would round to zeros)."""
    dt = resolve_dtype(dtype)
    if dt is not None and not dt.is_floating_point:
        raise TypeError(f"{name}: expected a floating dtype (torch.float64 or torch.float32), got {dt}")
    return dt


def as_tensor(value, name: str, *, dtype=None, device=None, finite: bool = True) -> torch.Tensor:
    """Convert ``value`` (torch tensor, numpy array, nested list or number) to a float tensor.

    Float tensors keep their dtype unless ``dtype`` is given (float32 is a user's request, kept);
    numpy arrays, lists and integer data become float64. Tensors that require grad are not
    copied, so gradients flow through. ``finite=True`` rejects NaN and inf entries.
    """
    dtype = resolve_dtype(dtype)
    if isinstance(value, torch.Tensor):
        t = value
    elif isinstance(value, (np.ndarray, np.generic, numbers.Number, list, tuple)):
        try:
            arr = np.asarray(value)
        except ValueError as exc:     # a ragged nested list: numpy's "setting an array element with a sequence"
            raise ValueError(f"{name}: expected a rectangular array of numbers (rows of equal length), got a ragged "
                             f"nested sequence ({exc})") from exc
        if arr.dtype == object:
            raise TypeError(f"{name}: expected a numeric array, got an array of Python objects")
        if arr.dtype.kind == "b":
            raise TypeError(f"{name}: expected real numbers, got booleans (convert explicitly, e.g. X.astype(float))")
        if arr.dtype.kind not in "iuf":
            raise TypeError(f"{name}: expected real numbers, got numpy dtype {arr.dtype}")
        if any(st < 0 for st in arr.strides):
            arr = np.ascontiguousarray(arr)   # a reversed view (X[::-1]): torch takes no negative strides
        t = torch.as_tensor(arr)
    else:
        raise TypeError(f"{name}: expected a torch tensor or numpy array, got {type(value).__name__}")
    if t.is_complex():
        raise TypeError(f"{name}: complex values are not supported")
    if t.device.type == "meta":
        raise ValueError(f"{name}: a tensor on the meta device holds shapes, not numbers; give it on 'cpu' or 'cuda'")
    if t.dtype == torch.bool:
        raise TypeError(f"{name}: expected real numbers, got a bool tensor (convert explicitly, e.g. X.double())")
    if dtype is None and not t.is_floating_point():
        dtype = DEFAULT_DTYPE
    if dtype is None and not isinstance(value, torch.Tensor):
        dtype = DEFAULT_DTYPE
    if device is not None:
        device = check_device(device)
    if dtype is not None or device is not None:
        t = t.to(dtype=dtype or t.dtype, device=device or t.device)
    if finite and t.numel() and not bool(torch.isfinite(t.detach()).all()):
        bad = int((~torch.isfinite(t.detach())).sum())
        raise ValueError(f"{name}: contains {bad} NaN or infinite entr{'y' if bad == 1 else 'ies'}")
    return t


def unshared(t: torch.Tensor, given) -> torch.Tensor:
    """``t`` (made from ``given`` by :func:`as_tensor`), or a copy of it where it is ``given`` itself or holds a numpy
    array's memory: an object that keeps ``t`` then no longer changes with the caller's in-place edits of ``given``
    (a measure built from X in a loop that then does ``X += dt * v``). The copy is ``clone``, which keeps autograd:
    gradients still reach ``given``."""
    if isinstance(given, torch.Tensor):
        shared = t is given
    elif isinstance(given, np.ndarray):
        # a dtype numpy has no counterpart of (bfloat16) came from a conversion, so from a copy
        shared = (t.device.type == "cpu" and not t.requires_grad and t.dtype != torch.bfloat16
                  and np.may_share_memory(t.numpy(), given))
    else:
        shared = False
    return t.clone() if shared else t


def broadcast_shapes(*shapes) -> torch.Size:
    """torch.broadcast_shapes in plain Python: the same result, and a RuntimeError where the shapes do not broadcast.
    torch's first call imports torch._refs and sympy (1 to 5 s of the first attention call in a process, measured
    on 2 CPU cores); every broadcast of batch dimensions in this framework goes through here instead."""
    out: list[int] = []
    for shape in shapes:
        shape = tuple(int(s) for s in shape)
        if len(shape) > len(out):
            out = [1] * (len(shape) - len(out)) + out
        for i, s in enumerate(shape, start=len(out) - len(shape)):
            if s < 0:
                raise RuntimeError(f"broadcast_shapes: negative size {s} in {shape}")
            if out[i] == 1:
                out[i] = s
            elif s != 1 and s != out[i]:
                raise RuntimeError(f"Shape mismatch: objects cannot be broadcast to a single shape: {shape} against "
                                   f"{tuple(out)}")
    return torch.Size(out)


def check_ndim(t: torch.Tensor, name: str, ndim: int, what: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {what} ({ndim}-D), got shape {tuple(t.shape)}")


def weight_tolerance(dtype: torch.dtype, given=None) -> float:
    """Tolerance on ``|sum(weights) - 1|`` for a given floating dtype.

    ``given`` is the weights as the user passed them: weights given in a lower precision (float32
    weights for float64 points) are judged in their own precision, not after the upcast.
    """
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    if dtype.is_floating_point:
        # half precisions (float16, bfloat16): a few roundings of 1/n already exceed 1e-5
        tol = max(tol, 4 * torch.finfo(dtype).eps)
    own = getattr(given, "dtype", None)
    if isinstance(own, np.dtype) and own.kind == "f":
        own = torch.from_numpy(np.zeros(0, dtype=own)).dtype
    if isinstance(own, torch.dtype) and own.is_floating_point and own != torch.float64:
        tol = max(tol, 1e-5, 4 * torch.finfo(own).eps)
    return tol


def zero_mass_log_weight(dtype: torch.dtype) -> float:
    """The finite number the fused and streamed attention kernels stand the log of a zero mass in for, and clamp
    smaller log-weights to: the dtype's most negative number / 4 (float16's kernels mark zero masses in a column of
    their own instead)."""
    return torch.finfo(dtype).min / 4


def log_weight_clamp_matters(lw: torch.Tensor) -> torch.Tensor | None:
    """A 0-d bool tensor (no host sync): whether clamping ``lw`` at :func:`zero_mass_log_weight` can change an
    attention result: two different positive-mass log-weights lie below it (their ratio is lost: a masked row
    whose visible keys all sit there gets equal weights, where the dense path gave their softmax), or one does
    beside a zero mass (-inf, clamped to the same value: a row that sees both tied them). Equal ones without zero
    masses (Hugging Face's masks fill finfo.min) lose nothing: every path gives the same. None for float16 and
    non-floats."""
    if lw.dtype == torch.float16 or not lw.is_floating_point():
        return None
    if lw.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=lw.device)
    # the values the clamp sends to one (zero masses, -inf, among them): it matters where two of them differ, i.e. two
    # positive masses, or one and a zero mass; seven small operations (each a launch on a GPU: this runs in every
    # checked weighted call), masked_fill rather than torch.where with a Python number (half the time on a CPU)
    others = (lw < zero_mass_log_weight(lw.dtype)).logical_not_()   # NaN and +inf among them
    return lw.masked_fill(others, math.inf).amin() < lw.masked_fill(others, -math.inf).amax()


def check_log_weight_floor(lw: torch.Tensor, name: str = "log_weights") -> None:
    """Refuse log-weights where the kernels' clamp would change a result (:func:`log_weight_clamp_matters`): two
    different positive masses below ``finfo.min / 4``, or one beside a zero mass. One pass over ``lw``."""
    matters = log_weight_clamp_matters(lw)
    if matters is not None and bool(matters):
        low = zero_mass_log_weight(lw.dtype)
        tiny = (lw > -math.inf) & (lw < low)
        raise ValueError(f"{name}: {int(tiny.sum())} atom(s) of positive mass have log-weights below {low:.3g} "
                         f"(from {float(lw[tiny].min()):.4g} to {float(lw[tiny].max()):.4g}), where the attention "
                         "kernels clamp them to one value, that of a zero mass (-inf); give them one value and no "
                         "zero masses, or -inf for a zero mass")


def scalar(value, name: str):
    """``value`` with a one-element real torch tensor of no dimensions (``X.norm(dim=1).max()``, ``torch.tensor(64)``)
    taken as the Python number it holds (int or float); anything else unchanged, for the caller's own check. Such a
    tensor that carries a derivative (it requires grad, holds a forward-mode tangent, or is traced by a torch.func
    transform: vmap, jacfwd, grad) is a TypeError naming ``name``: the number is a plain float from here on, and its
    derivative would be silently lost (pass ``.detach()`` to mean it); so is one on the meta device, which holds no
    number."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool:
        if value.requires_grad or _traced(value):
            raise TypeError(f"{name}: a tensor that carries a derivative (it requires grad, has a forward-mode "
                            "tangent or is traced by a torch.func transform), where a number is taken (its derivative "
                            "would be lost); pass .detach() or a number")
        if value.device.type == "meta":
            raise TypeError(f"{name}: a tensor on the meta device holds no number; pass a number")
        return value.item()
    return value


def _traced(t: torch.Tensor) -> bool:
    """Whether ``t`` holds a forward-mode tangent or is wrapped by a torch.func transform."""
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    if wrapped is not None and wrapped(t):
        return True
    return torch.autograd.forward_ad.unpack_dual(t).tangent is not None


def check_radius(R, name: str = "R") -> float:
    R = scalar(R, name)
    if not isinstance(R, numbers.Real) or isinstance(R, bool):
        raise TypeError(f"{name}: expected a real number, got {type(R).__name__}")
    R = float(R)
    if not np.isfinite(R) or R < 0:
        raise ValueError(f"{name}: expected a finite non-negative radius, got {R}")
    return R


def check_positive_int(value, name: str, minimum: int = 1) -> int:
    """An integer >= ``minimum`` (numpy integers accepted), as an int; bools, floats and strings are a
    TypeError naming ``name``, a smaller integer a ValueError. A 0-d tensor counts as the number it holds
    (:func:`scalar`)."""
    given = value
    value = scalar(value, name)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        what = f"a {given.dtype} tensor" if isinstance(given, torch.Tensor) else type(value).__name__
        raise TypeError(f"{name}: expected an integer, got {what} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
    return int(value)


def check_positive_float(value, name: str, *, allow_zero: bool = False, allow_inf: bool = False) -> float:
    """A real number > 0 (>= 0 with ``allow_zero``), finite unless ``allow_inf`` (numpy scalars accepted),
    as a float; bools and strings are a TypeError naming ``name``, NaN or a value out of range a
    ValueError. The one check of real options, from particles to the studies. A 0-d tensor counts as the number
    it holds (:func:`scalar`)."""
    value = scalar(value, name)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")
    try:
        out = float(value)
    except OverflowError:  # an int beyond the float range, e.g. 10**400
        out = math.inf if value > 0 else -math.inf
    if math.isnan(out) or (math.isinf(out) and not allow_inf):
        raise ValueError(f"{name}: expected a finite number, got {out}")
    if not (out >= 0 if allow_zero else out > 0):
        raise ValueError(f"{name}: expected a {'non-negative' if allow_zero else 'positive'} number, got {out}")
    return out


def check_bool(value, name: str, *, allow_none: bool = False):
    """``value`` as a Python bool: True or False only (numpy booleans accepted), None too when
    ``allow_none``. A truthy string such as ``"yes"`` or ``"False"``, or a number, is a TypeError
    naming ``name``, never taken for its truth value."""
    if value is None and allow_none:
        return None
    if not isinstance(value, (bool, np.bool_)):
        allowed = "None, True or False" if allow_none else "True or False"
        raise TypeError(f"{name}: expected {allowed}, got {type(value).__name__} {value!r}")
    return bool(value)


def check_device(device, name: str = "device") -> torch.device | None:
    """None or a torch device (or its name) that torch can use here; a ValueError saying so for a CUDA
    device when torch sees none (instead of torch's AssertionError deep inside the first transfer)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"{name}: expected a torch device or a name such as 'cpu' or 'cuda', got {device!r}") from exc
    if dev.type == "meta":
        raise ValueError(f"{name}: the meta device holds shapes, not numbers, and nothing here can be computed on it; "
                         "use device='cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}: {device!r} was asked for, but CUDA is not available (torch sees no CUDA "
                         "device); use device='cpu'")
    return dev


def torch_dtype(np_dtype) -> torch.dtype:
    """The torch dtype that numpy's ``np_dtype`` converts to (``torch.from_numpy``)."""
    return torch.from_numpy(np.empty(0, np_dtype)).dtype


def to_arguments(device, dtype):
    """(device, dtype) of a ``to(device=None, dtype=None)`` call, with a dtype given alone in the first place taken as
    the dtype, as ``torch.Tensor.to(torch.float64)`` and ``torch.nn.Module.to(torch.float64)`` take it."""
    if isinstance(device, torch.dtype):
        if dtype is not None:
            raise TypeError(f"dtype: given twice, as the first argument ({device}) and as dtype={dtype}")
        return None, device
    return device, dtype


#: The bound of the seeds, which are integers from 0 to SEED_LIMIT - 1. torch's CPU generator keeps the low 32 bits
#: of a seed (2**32 draws what 0 draws, -1 what 2**32 - 1 draws), so larger or negative seeds would repeat others
SEED_LIMIT = 2**32


def check_seed(seed, name: str = "seed"):
    """None, a torch.Generator, or an integer in [0, 2**32) (numpy integers accepted; :data:`SEED_LIMIT`)."""
    if seed is None or isinstance(seed, torch.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, None or a torch.Generator, got {type(seed).__name__}")
    if not 0 <= int(seed) < SEED_LIMIT:
        raise ValueError(f"{name}: expected an integer in [0, 2**32), got {int(seed)} (torch's generator keeps a "
                         f"seed's low 32 bits: it would draw what seed {int(seed) % SEED_LIMIT} draws)")
    return int(seed)


def make_generator(seed, device=None) -> torch.Generator | None:
    """A torch Generator seeded by ``seed`` (None: use the global RNG)."""
    seed = check_seed(seed)
    if seed is None or isinstance(seed, torch.Generator):
        return seed
    g = torch.Generator(device=device or "cpu")
    g.manual_seed(int(seed))
    return g


# ---------------------------------------------------------------------- memory guards
MEMORY_LIMIT_ENV = "SMOOTH_ATTENTION_MEMORY_LIMIT"
#: Default largest single allocation a dense method may make, 8 GiB (half of a 16 GB laptop)
DEFAULT_MEMORY_LIMIT = 8 * 2**30
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}


class MemoryLimitError(MemoryError, ValueError):
    """A dense method would allocate more than the memory limit; the message names the size and the
    method to use instead. Raised before anything is allocated."""


def parse_bytes(value, name: str = "memory_limit") -> int:
    """A byte count from an int or a string such as ``"16G"``, ``"512MiB"`` or ``"2e9"``."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected a number of bytes or a size such as '16G', got a bool")
    if isinstance(value, numbers.Real):
        try:
            out = float(value)
        except OverflowError:  # an int beyond the float range
            out = float("inf")
    elif isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        digits = text.rstrip("KMGTIB")
        unit = text[len(digits):]
        if unit not in _UNITS:
            raise ValueError(f"{name}: unknown unit in {value!r} (use B, K, M, G or T)")
        try:
            out = float(digits) * _UNITS[unit]
        except ValueError as exc:
            raise ValueError(f"{name}: expected a size such as '16G' or a number of bytes, got {value!r}") from exc
    else:
        raise TypeError(f"{name}: expected a number of bytes or a size such as '16G', got {type(value).__name__}")
    if not np.isfinite(out) or out <= 0:
        raise ValueError(f"{name}: expected a positive size, got {value!r}")
    return int(out)


def memory_limit(value=None) -> int:
    """The allocation limit in bytes: ``value`` if given, else ``$SMOOTH_ATTENTION_MEMORY_LIMIT``, else
    :data:`DEFAULT_MEMORY_LIMIT` (8 GiB)."""
    if value is not None:
        return parse_bytes(value)
    env = os.environ.get(MEMORY_LIMIT_ENV, "")
    return _limit_from_env(env) if env and not env.isspace() else DEFAULT_MEMORY_LIMIT


@functools.lru_cache(maxsize=16)
def _limit_from_env(env: str) -> int:
    """:func:`memory_limit` of the variable's text, parsed once per text (it is read on every attention call); the
    default is read at every call, so that a program may change :data:`DEFAULT_MEMORY_LIMIT`."""
    return parse_bytes(env.strip(), MEMORY_LIMIT_ENV)


def format_bytes(n: float) -> str:
    if isinstance(n, int) and n.bit_length() > 1000:  # beyond the float range: n / size would overflow
        return f"about 2^{n.bit_length() - 1} B"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def check_allocation(nbytes: float, what: str, instead: str, limit=None) -> None:
    """Refuse (:class:`MemoryLimitError`) an allocation of ``nbytes`` above :func:`memory_limit`.

    ``what`` names the computation, ``instead`` says what to use instead.
    """
    lim = memory_limit(limit)
    if nbytes > lim:
        raise MemoryLimitError(f"{what}: needs about {format_bytes(nbytes)}, above the memory limit of "
                               f"{format_bytes(lim)} (set by memory_limit= or ${MEMORY_LIMIT_ENV}); {instead}")


# ---------------------------------------------------------------------- iterative solvers
ON_FAILURE = ("raise", "warn")


class ConvergenceError(ValueError, RuntimeError):
    """An iterative solver (Lipschitz estimate, Sinkhorn, ...) stopped before reaching its tolerance.

    ``.estimate`` holds what it reached (a result object with ``converged=False``). The estimators of
    the framework (``local_lipschitz``, ``lipschitz_ratio``, ``split_lipschitz``, the transport solvers) take
    ``on_failure="raise"`` (this error; the default except for ``split_lipschitz``) or ``"warn"`` (a
    RuntimeWarning, and the result returned with ``converged=False``). ``simulate`` raises it, without an
    estimate, when an adaptive solver exceeds its step budget or its step size underflows.
    """

    def __init__(self, message, estimate=None):
        super().__init__(message)
        self.estimate = estimate


def check_on_failure(value) -> str:
    if value not in ON_FAILURE:
        raise ValueError(f"on_failure: expected 'raise' or 'warn', got {value!r}")
    return value
