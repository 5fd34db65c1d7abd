"""Which attention path runs on an accelerator (CUDA), as a pure function of what the call is.

:func:`meanfield.kernels.attend` keeps its measured CPU map (benchmarks/README.md) on CPU; on any other
device it asks :func:`choose`, whose inputs are the device type, dtype, shapes, whether log-weights and
which positions are present, whether derivatives are needed, the memory budget
(:func:`particles.device.memory_budget`: the framework's limit capped by the device's free memory) and
whether Triton kernels run there. Nothing here reads a tensor or queries a device, so the CUDA decisions
are tested on CPU.

The rules, in order:

1. **dense** (the (m, n) score matrix, a few launches) while the scores are small
   (:data:`CUDA_DENSE_THRESHOLD` entries, or ``use(threshold=...)``) *and* their temporaries fit the budget;
2. **stream** whenever derivatives are needed, and for every call of a small head (at most 3 features, float32 or a
   half type) where Triton runs (:func:`small_kernels`): its engine (:func:`stream_engine`) is the Triton kernels of
   :mod:`meanfield.triton_attention` (forward, JVP, VJP; O(N) memory, one launch per pass) for narrow
   heads (d <= 16 in float32 / float64; heads of at most 3 features in float32 and the half types take the FMA
   kernels of :mod:`meanfield.triton_small_heads`, :func:`small_heads`), or the tile loops of
   :mod:`meanfield.streamed_attention` with tiles sized by the budget (:func:`tile_shape`: row blocks
   against all keys, a few large cuBLAS products per block instead of thousands of cache-sized ones) for wide
   heads (on Hopper GPUs only their VJP: float32 heads up to 64 take Triton's forward pass and JVP there,
   :data:`TRITON_WIDE_MAX_WIDTH`), where Triton does not run,
   and inside ``torch.func`` transforms. Where the mask allows (none, weights, a sequence's causal mask) and the
   dtype is float32 or a half type, the forward pass and the VJP run in torch's memory-efficient kernel
   (:mod:`meanfield.efficient_cuda`), except those of small heads on the Triton engine (:data:`SMALL_HEADS_FIRST`:
   the small-head kernels were 2.6-3.8x faster than SDPA and its backward at N = 1e4, 6-9x at 1e5 and 1e6);
3. **fused** (torch's ``scaled_dot_product_attention``) for forward passes with no positions or a
   sequence's causal mask, in a dtype CUDA's fused kernels take (float32, float16, bfloat16), the head
   zero-padded to a multiple of :data:`FUSED_ALIGN` (:func:`fused_widths`; zero columns change no score
   and no output) so that SDPA's flash / memory-efficient kernels take it instead of its math kernel,
   which would materialize the scores. The call runs with the math kernel excluded: should no fused
   kernel take the inputs after all, the call is streamed instead (:func:`meanfield.kernels.fused_or_stream`);
   Below :data:`CUDA_ROWS_THRESHOLD` score entries a float32 forward pass without a sequence's causal mask
   runs as **rows** instead: dense blocks of rows against all keys (:data:`ROW_ENTRIES` entries each, torch's
   softmax), the row-chunked recipe that beat SDPA (and the streamed kernel, with positions) at N = 1e4 on an
   H200 (benchmarks/gpu.md); for heads wider than :data:`ROWS_MAX_WIDTH` as **dense** (the whole matrix, where
   it fits the budget), which beat the row blocks there;
4. **stream** otherwise: arbitrary positions (SDPA would need an (m, n) mask) and float64 (SDPA's CUDA
   float64 backend is the math kernel).

The (m, n) scores are thus never materialized above the budget on an accelerator.
"""

from __future__ import annotations

import math

import torch

from particles import device as _device

__all__ = ["CUDA_DENSE_THRESHOLD", "CUDA_ROWS_THRESHOLD", "ROW_ENTRIES", "ROWS_TEMPORARIES", "DENSE_TEMPORARIES",
           "DENSE_MASK_BYTES", "dense_bytes",
           "ROWS_MAX_WIDTH", "FUSED_ALIGN", "TILE_FRACTION", "MAX_TILE_ENTRIES", "TRITON_DTYPES", "TRITON_MAX_FEATURES",
           "TRITON_MAX_WIDTH", "TRITON_WIDE_MAX_WIDTH", "TRITON_WIDE_CAPABILITY", "SMALL_HEAD_FEATURES",
           "SMALL_HEAD_DTYPES", "SMALL_HEAD_MAX", "SMALL_HEADS_FIRST", "small_heads", "small_kernels",
           "efficient_first", "triton_width",
           "choose",
           "stream_engine", "triton_vjp", "tile_shape", "fused_widths", "row_block"]

#: On an accelerator, dense up to this many score entries (all batch entries). Below it the dense path's
#: few launches beat the fused and streamed kernels' fixed costs (N = 1e3: dense 0.07-0.12 ms against
#: 0.24-0.83 ms for auto's fused call on an H100; benchmarks/gpu.md re-measures it)
CUDA_DENSE_THRESHOLD = 2**21
#: score-sized temporaries of the dense path (scores, masked scores, exponentials, probabilities), in
#: :func:`dense_bytes`
DENSE_TEMPORARIES = 4
#: bytes per score entry of the dense path's masks (booleans, the half types' float32 softmax), in
#: :func:`dense_bytes`
DENSE_MASK_BYTES = 4
#: On an accelerator, float32 forward passes without a sequence's causal mask run as dense row blocks ("rows")
#: up to this many score entries (all batch entries). Measured on an H200 at N = 1e4 (benchmarks/gpu.md, grid):
#: rows of 2048 against all keys took 1.12 / 1.39 / 1.76 ms at d = 3 (unweighted / weighted / arbitrary
#: positions) against SDPA with a padded head 1.42 / 1.69 / 2.15 ms and the streamed kernel's 2.83 ms, and at
#: d = 64 1.48 / 1.78 / 2.17 ms against 1.45 / 1.66 / 2.30 ms and 3.73 ms; with a causal mask SDPA was faster
#: (1.29 against 1.72 ms), and at N = 1e5 SDPA (the streamed kernel with positions) in every case. The
#: crossover between 1e4 and 1e5 is not measured: 2^27 entries (N = 11,585) keeps to the measured side
CUDA_ROWS_THRESHOLD = 2**27
#: Heads wider than this (q's or v's features) take the whole score matrix at once ("dense", where its
#: temporaries fit the budget) instead of row blocks up to :data:`CUDA_ROWS_THRESHOLD` entries: at N = 1e4 in
#: d = 64, in both H200 runs of 2026-11-27 (benchmarks/gpu.md, grid), naive dense took 1.03-1.08 / 1.30-1.37 /
#: 1.69 ms (unweighted / weighted / arbitrary positions) against the row blocks' 1.47-1.52 / 1.73-1.78 /
#: 2.17 ms, where in d = 3 the row blocks won (1.00-1.03 / 1.32-1.34 / 1.75-1.81 against 1.38-1.40 / 1.67-1.71 /
#: 2.06-2.09 ms). Between 16 and 64 unmeasured
ROWS_MAX_WIDTH = 16
#: score entries of one row block of the "rows" path (2048 rows against 1e4 keys, as measured)
ROW_ENTRIES = 2**24
#: block-sized temporaries of the "rows" path (scores, probabilities, a masked copy)
ROWS_TEMPORARIES = 3
#: SDPA's fused CUDA kernels take heads whose size is a multiple of this
FUSED_ALIGN = 8
#: dtypes SDPA has fused CUDA kernels for (float64 runs its math kernel, which materializes the scores)
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: the tiles of the tile loops take at most this fraction of the budget (inputs, outputs and the
#: allocator's slack share the rest)
TILE_FRACTION = 0.25
#: larger tiles gain nothing once a launch's fixed cost is amortized; this many entries (1 GiB of float32)
MAX_TILE_ENTRIES = 2**28
#: score-sized buffers the tile loops hold per tile (scores / probabilities, their cotangent, a product)
TILE_TEMPORARIES = 3
#: dtypes the Triton kernels take (products accumulate in float32 for the half types, float64 for float64)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: largest feature size (of q, k and of v) the Triton kernels accept at all
TRITON_MAX_FEATURES = 256
#: the widest padded feature size (:func:`triton_width`) the streamed kernel sends to Triton, by dtype:
#: up to it every kernel compiles for sm_80 and sm_90 without register spills at its tile size
#: (tests/test_triton_compile.py). float32 and float64 products are IEEE, i.e. CUDA-core FMAs,
#: whose registers grow with the width; wider heads take the tile loops, whose products are cuBLAS GEMMs
TRITON_MAX_WIDTH = {torch.float64: 16, torch.float32: 16, torch.float16: 32, torch.bfloat16: 32}
#: on GPUs of compute capability :data:`TRITON_WIDE_CAPABILITY` and above, the forward pass and the JVP also take
#: wider float32 heads, with three-pass TF32 products (meanfield.triton_attention._precision). Measured on an
#: H200 at d = 64 (benchmarks/gpu.md, "wide"): at N = 1e5 the forward pass took 39-67 ms against SDPA's 41-140 ms
#: and the tile loops' 97-181 ms, the JVP 153-277 ms against the tile loops' 257-494 ms (SDPA's backward:
#: 94-201 ms), errors 2-8e-7 against float64; the VJP took 425-450 ms against the tile loops' 230-271 ms, so the
#: VJP keeps :data:`TRITON_MAX_WIDTH`. For sm_80 the JVP kernel spills 540 bytes at width 64 (8 on sm_90):
#: unmeasured there, those GPUs keep the tile loops
TRITON_WIDE_MAX_WIDTH = {torch.float32: 64}
#: the compute capability from which :data:`TRITON_WIDE_MAX_WIDTH` applies (Hopper)
TRITON_WIDE_CAPABILITY = (9, 0)


def dense_bytes(entries: int, element_size: int) -> int:
    """The dense path's peak bytes for ``entries`` score entries, forward and backward: :data:`DENSE_TEMPORARIES`
    score-sized tensors and :data:`DENSE_MASK_BYTES` a score entry. Measured peaks with derivatives (n = 4096,
    d = 3, weights and positions, a query that sees no key): 3.6 float64 score matrices' worth (28 bytes an entry,
    here 36), 4.1 float32 (16; here 20), 5.2-5.4 float16 and bfloat16 (11; here 12); forward only 2.0-2.7."""
    return entries * (DENSE_TEMPORARIES * element_size + DENSE_MASK_BYTES)


def _dense_fits(entries, element_size, budget, temporaries=None):
    """Whether the dense path (:func:`dense_bytes`), or ``temporaries`` buffers of ``entries`` (the row blocks),
    fit ``budget``: bytes, or a callable returning them (called here only, so that a call the dense paths are not
    considered for never asks the driver for the free memory)."""
    need = dense_bytes(entries, element_size) if temporaries is None else temporaries * entries * element_size
    return need <= (budget() if callable(budget) else budget)


#: heads of at most this many features (q, k and v) run in the FMA kernels of :mod:`meanfield.triton_small_heads`
#: wherever the Triton kernels run (the particle regime: d = 1 to 3), in the dtypes of :data:`SMALL_HEAD_DTYPES`;
#: None: the matrix-product kernels of :mod:`meanfield.triton_attention` for every head. Compiled for sm_90 (Triton
#: 3.9) the float32 loops take 24 instructions per score entry and thread at d = 3 in the forward pass, 41 in the JVP
#: and 26 + 33 in the VJP's two passes, against 70, 129 and 80 + 119 for the matrix-product kernels at 16 columns
#: (Triton 3.6's padding of d = 3, which takes no smaller float32 product) and 48, 75, 47 + 78 at 8 (Triton 3.9's):
#: ``python tests/triton_compile_check.py``'s ``loop_per_entry``. Timed on an H200: :data:`SMALL_HEADS_FIRST`
SMALL_HEAD_FEATURES = 3
#: The dtypes of the small-head kernels, which compute in float32. float64 keeps the matrix-product kernels
#: (its loops in FMAs take 65 instructions per entry and spill registers, where a float64 product of 4 columns,
#: Triton's smallest, runs on the tensor cores of sm_80 and sm_90)
SMALL_HEAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


#: Whether small heads (:func:`small_heads`) on an accelerator where the Triton kernels run take the small-head
#: kernels for every pass above the dense path: forward passes go to the streamed path (not "rows" nor "fused",
#: :func:`choose`'s ``small_kernels``), and its forward pass and VJP to the small-head kernels rather than torch's
#: memory-efficient kernel (:func:`efficient_first`). Measured on an H200 (2026-11-29, benchmarks/gpu.md, "small";
#: d = 3, float32), the small-head kernels against the best of the matrix-product kernels and SDPA (padded; its
#: backward for the derivatives): at N = 1e4 2.6-3.2x faster forward, 3.1-3.4x JVP, 2.7-3.8x VJP (every mask); at
#: 1e5 6.0-8.1x, 7.2-8.0x, 6.0-7.5x; at 1e6 (no mask, positions) 7.1-8.9x, 7.3-7.6x, 6.1-6.4x; errors 1-9e-7
#: against float64, as the matrix-product kernels'. Set it False for torch's kernels (SDPA, memory-efficient)
SMALL_HEADS_FIRST = True


def efficient_first(device_type: str, dtype, e: int, c: int, engine: str) -> bool:
    """Whether an ``auto`` streamed call on ``device_type`` sends the passes the mask allows to torch's memory-efficient
    kernel (``engine``: the engine :func:`stream_engine` chose): on every accelerator, except for small heads on the
    Triton engine once :data:`SMALL_HEADS_FIRST` is on."""
    if device_type == "cpu":
        return False
    return not (SMALL_HEADS_FIRST and engine == "triton" and small_heads(e, c, dtype))


#: The most features the small-head kernels can take at all, since they unroll features one by one up to 4. A
#: :data:`SMALL_HEAD_FEATURES` set higher still sends wider heads to the matrix-product kernels
SMALL_HEAD_MAX = 4


def small_kernels(device_type: str, dtype, e: int, c: int, *, triton: bool, transforms: bool) -> bool:
    """Whether an ``auto`` call of a head of ``e`` query / key and ``c`` value features in ``dtype`` on
    ``device_type`` runs in the small-head Triton kernels (:data:`SMALL_HEADS_FIRST`, :func:`small_heads`, and the
    streamed path's engine there is Triton: ``triton`` whether Triton runs on that device, ``transforms`` whether a
    ``torch.func`` transform is active); never on the CPU, whose measured map stays."""
    return (device_type != "cpu" and SMALL_HEADS_FIRST and small_heads(e, c, dtype)
            and stream_engine(device_type, dtype, e, c, triton=triton, transforms=transforms) == "triton")


def small_heads(e: int, c: int, dtype=torch.float32) -> bool:
    """Whether a head of ``e`` query / key features and ``c`` value features in ``dtype`` takes the small-head
    kernels (:data:`SMALL_HEAD_FEATURES`, at most :data:`SMALL_HEAD_MAX`; :data:`SMALL_HEAD_DTYPES`)."""
    return (SMALL_HEAD_FEATURES is not None and dtype in SMALL_HEAD_DTYPES and 1 <= min(e, c)
            and max(e, c) <= min(SMALL_HEAD_FEATURES, SMALL_HEAD_MAX))


def triton_width(size: int, dtype) -> int:
    """The tile width of a feature size in the Triton kernels: zero-padded to a power of two, at least the
    smallest reduction of a matrix product that the installed Triton accepts
    (:func:`particles.device.triton_min_dot_k`; d = 3 in float32 is 8 columns with Triton 3.9, 16 with 3.6)."""
    floor = _device.triton_min_dot_k(8 * dtype.itemsize)
    return max(floor, 1 << max(0, int(size) - 1).bit_length())


def stream_engine(device_type: str, dtype, e: int, c: int, *, triton: bool, transforms: bool = False,
                  capability=None) -> str:
    """The engine of the streamed kernel: "auto" on CPU (its fused flash kernel where the mask allows, tile
    loops otherwise: the measured CPU map); on an accelerator "triton" where Triton runs, outside
    ``torch.func`` transforms (which wrap tensors), for the dtypes and widths of :data:`TRITON_MAX_WIDTH`
    (d <= 16 in float32 / float64: the particle regime) and, on a GPU of compute ``capability`` (major, minor)
    at least :data:`TRITON_WIDE_CAPABILITY`, of :data:`TRITON_WIDE_MAX_WIDTH` (float32 heads up to 64, whose
    VJP stays in the tile loops: :func:`triton_vjp`); "tiles" (budget-sized, cuBLAS products) otherwise."""
    if device_type == "cpu":
        return "auto"
    if triton and not transforms and dtype in TRITON_MAX_WIDTH:
        if triton_vjp(dtype, e, c):   # the widths every Triton kernel takes
            return "triton"
        if (capability is not None and tuple(capability) >= TRITON_WIDE_CAPABILITY
                and max(triton_width(e, dtype), triton_width(c, dtype)) <= TRITON_WIDE_MAX_WIDTH.get(dtype, 0)):
            return "triton"
    return "tiles"


def triton_vjp(dtype, e: int, c: int) -> bool:
    """Whether the Triton engine, chosen by :func:`stream_engine`, also computes the VJP (the widths of
    :data:`TRITON_MAX_WIDTH`); a wider head's VJP runs in the tile loops (where the mask allows, in torch's
    memory-efficient kernel before either: :mod:`meanfield.efficient_cuda`)."""
    return dtype in TRITON_MAX_WIDTH and max(triton_width(e, dtype), triton_width(c, dtype)) <= TRITON_MAX_WIDTH[dtype]


def tile_shape(batch: int, m: int, n: int, element_size: int, budget: int) -> tuple[int, int]:
    """(block_q, block_k) of the tile loops on an accelerator: rows of all n keys while
    :data:`TILE_TEMPORARIES` tiles of ``batch`` x rows x n entries fit :data:`TILE_FRACTION` of ``budget``
    (and :data:`MAX_TILE_ENTRIES`); with keys too many for one row block, blocks of 64 rows x part of the keys."""
    entries = min(MAX_TILE_ENTRIES, int(TILE_FRACTION * budget) // (TILE_TEMPORARIES * element_size))
    per_row = max(1, batch) * max(1, n)
    rows = entries // per_row
    if rows >= min(64, max(1, m)):
        return max(1, min(m, rows)), max(1, n)
    rows = max(1, min(m, 64))
    return rows, max(1, min(n, entries // (max(1, batch) * rows)))


def fused_widths(e: int, c: int, weighted: bool, causal: bool, dtype=None) -> tuple[int, bool]:
    """(padded width of q, k and v, whether the log-weights ride as coordinates) for SDPA on CUDA.

    The log-weights become one more coordinate (q' = [q, 1], k' = [k, log a]) with the causal mask (which
    SDPA cannot combine with a mask) and wherever that coordinate costs no width after padding (d = 3:
    4 -> 8); otherwise a broadcast additive mask row (memory-efficient kernel). In float16 they take two
    coordinates (:func:`meanfield.flash_cpu.weight_coordinates`), only with the causal mask: the mask row,
    which keeps log 0 = -inf, is exact.
    """
    align = lambda w: FUSED_ALIGN * math.ceil(max(1, w) / FUSED_ALIGN)
    plain = align(max(e, c))
    if dtype == torch.float16:
        fold = weighted and causal
        return (align(max(e + 2, c)) if fold else plain), fold
    fold = weighted and (causal or align(max(e + 1, c)) == plain)
    return (align(max(e + 1, c)) if fold else plain), fold


def choose(device_type: str, dtype, batch: int, m: int, n: int, e: int, c: int, *, weighted: bool,
           positions: str, derivatives: bool, transforms: bool, budget: int, threshold=None,
           small_kernels=False) -> str:
    """The path ("dense", "rows", "fused" or "stream") of :func:`meanfield.kernels.attend` with ``method="auto"``
    on an accelerator (module docstring). ``positions`` is "none", "causal" (a sequence's causal mask)
    or "other"; ``budget`` in bytes, or a callable returning them (read only where the dense path is
    considered); ``threshold`` the size given to ``kernels.use(threshold=...)``; ``small_kernels`` whether the call
    would run in the small-head Triton kernels (:func:`small_kernels`; a bool, or a callable returning it, called only
    above the dense path): then every call above the dense path is streamed. Otherwise whether Triton runs does not
    change the path: the streamed path picks its engine itself (:func:`stream_engine`)."""
    if positions not in ("none", "causal", "other"):
        raise ValueError(f"positions: expected 'none', 'causal' or 'other', got {positions!r}")
    entries = max(1, batch) * m * n
    element_size = dtype.itemsize
    dense_at = CUDA_DENSE_THRESHOLD if threshold is None else threshold
    if entries <= dense_at and _dense_fits(entries, element_size, budget):
        return "dense"
    if derivatives or (small_kernels() if callable(small_kernels) else small_kernels):
        return "stream"
    if (dtype == torch.float32 and positions != "causal" and entries <= CUDA_ROWS_THRESHOLD
            and max(e, c) > ROWS_MAX_WIDTH and _dense_fits(entries, element_size, budget)):
        return "dense"
    if (dtype == torch.float32 and positions != "causal" and entries <= CUDA_ROWS_THRESHOLD
            and _dense_fits(min(entries, max(ROW_ENTRIES, max(1, batch) * n)), element_size, budget,
                            temporaries=ROWS_TEMPORARIES)):
        return "rows"
    if dtype in FUSED_DTYPES and positions in ("none", "causal"):
        return "fused"
    return "stream"


def row_block(batch: int, n: int) -> int:
    """Query rows per block of the "rows" path: :data:`ROW_ENTRIES` score entries (all batch entries), at least
    one row."""
    return max(1, ROW_ENTRIES // (max(1, batch) * max(1, n)))
