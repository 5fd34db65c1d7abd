"""The attention path on an accelerator, decided on CPU: the pure choice of meanfield.accelerator_paths as
a function of device type, dtype, head size, masks, derivatives and memory budget; the memory budget
from a faked ``torch.cuda.mem_get_info``; the tile shapes; SDPA with a zero-padded head against the
dense kernel; and the fallback from SDPA to the streamed kernel where no fused kernel takes a call."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from meanfield import accelerator_paths as ap
from meanfield import kernels
from meanfield import streamed_attention as streaming
from meanfield.kernels import attend
from particles import device

DT = torch.float64
GiB = 2**30


def _close(a, b, tol=1e-10):
    assert a.shape == b.shape
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, b.abs().max().item()), err


def _choose(n, e=3, dtype=torch.float32, positions="none", derivatives=False, budget=40 * GiB, weighted=False,
            batch=1, transforms=False, threshold=None, m=None):
    return ap.choose("cuda", dtype, batch, n if m is None else m, n, e, e, weighted=weighted, positions=positions,
                     derivatives=derivatives, transforms=transforms, budget=budget, threshold=threshold)


# ---------------------------------------------------------------- the choice on CUDA


def test_the_issue_regimes_on_an_h100_sized_budget():
    """The cases of the measurements that failed: d = 3 forward at 1e5 and 1e6 (SDPA's math kernel would
    allocate the 9.3 GiB / 3.7 TiB scores) go to SDPA with the head padded to 8; float64 and arbitrary
    positions stream; derivatives stream; small problems stay dense."""
    assert _choose(10**5) == "fused" and _choose(10**6) == "fused"
    assert ap.fused_widths(3, 3, weighted=False, causal=False) == (8, False)
    assert ap.fused_widths(3, 3, weighted=True, causal=False) == (8, True)   # log a rides in column 4
    assert ap.fused_widths(64, 64, weighted=True, causal=False) == (64, False)  # a mask row, no 72
    assert ap.fused_widths(64, 64, weighted=True, causal=True) == (72, True)  # SDPA: no mask with is_causal
    # float16: two coordinates (log 0 has no safe single stand-in), only under the causal mask
    assert ap.fused_widths(3, 3, weighted=True, causal=False, dtype=torch.float16) == (8, False)
    assert ap.fused_widths(7, 7, weighted=True, causal=True, dtype=torch.float16) == (16, True)
    assert _choose(10**5, weighted=True, positions="causal") == "fused"
    assert _choose(10**5, dtype=torch.float64) == "stream"
    assert _choose(10**5, positions="other") == "stream"
    assert _choose(10**5, derivatives=True) == "stream" and _choose(10**6, e=64, derivatives=True) == "stream"
    assert _choose(1000) == "dense" and _choose(1000, dtype=torch.float64, derivatives=True) == "dense"


@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("e", [3, 8])
def test_fused_attend_in_float16_keeps_a_key_of_weight_zero_unseen(e, align):
    """fused_attend in float16, with and without a causal mask: a key of weight 0 whose score is 2e4 above a live
    key's gets no weight (float16's finfo.min / 4 = -16376 as log 0 would lose to it); and CPU auto, which takes
    fused_attend for a float16 weighted causal sequence above 2^14 scores, agrees with the dense kernel."""
    q = torch.zeros(3, e, dtype=torch.float16)
    k = torch.zeros(3, e, dtype=torch.float16)
    v = torch.zeros(3, e, dtype=torch.float16)
    q[:, 0], k[0, 0], k[1:, 0], v[1:, 0] = 100.0, 100.0, -100.0, 1.0
    lw = torch.tensor([-math.inf, 0.0, 0.0], dtype=torch.float16)
    assert streaming.fused_attend(q, k, v, lw, align=align)[:, 0].tolist() == [1.0, 1.0, 1.0]
    pos = torch.arange(3, dtype=torch.float16)
    out = streaming.fused_attend(q, k, v, lw, pos, pos, align=align)   # row 0 sees only the dead key: 0
    assert out[:, 0].tolist() == [0.0, 1.0, 1.0]
    n = 200
    g = torch.Generator().manual_seed(4)
    qb, kb = (torch.randn(n, e, generator=g) * 40).half(), (torch.randn(n, e, generator=g) * 40).half()
    vb = torch.randn(n, e, generator=g).half()
    w = torch.log(torch.rand(n, generator=g)).half()
    w[::3] = -math.inf
    posb = torch.arange(n, dtype=torch.float16)
    assert kernels.choose(qb, kb, vb, w, posb, posb) == "fused"
    got = attend(qb, kb, vb, w, posb, posb)
    ref = attend(qb.double(), kb.double(), vb.double(), w.double(), posb.double(), posb.double(), method="dense")
    assert (got.double() - ref).abs().max() <= 2e-2 * max(1.0, ref.abs().max().item())


def test_rows_where_row_chunked_dense_was_measured_fastest():
    """N = 1e4 on an H200 (benchmarks/gpu.md): float32 forward passes without a causal mask ran fastest as dense
    row blocks against all keys; with a causal mask SDPA, with derivatives the streamed kernel, at 1e5 SDPA or
    the streamed kernel; float64 (unmeasured) keeps the streamed kernel."""
    for positions in ("none", "other"):
        for e in (3, 64):
            # wide heads: the whole matrix, which beat the row blocks at d = 64 (ROWS_MAX_WIDTH)
            expected = "rows" if e <= ap.ROWS_MAX_WIDTH else "dense"
            assert _choose(10**4, e=e, positions=positions) == expected
            assert _choose(10**4, e=e, positions=positions, weighted=True) == expected
            assert _choose(10**5, e=e, positions=positions) in ("fused", "stream")
    assert _choose(10**4, e=16) == "rows" and _choose(10**4, e=17) == "dense"
    # the whole matrix only where its temporaries fit; row blocks, then SDPA, otherwise
    # (1e8 entries of 4 float32 temporaries and 4 bytes of masks: 2.0 GB)
    assert _choose(10**4, e=64, budget=2.0e9) == "dense" and _choose(10**4, e=64, budget=1.99e9) == "rows"
    assert _choose(10**4, e=64, positions="causal") == "fused" and _choose(11_586, e=64) == "fused"
    assert _choose(11_585) == "rows" and _choose(11_586) == "fused"     # 2^27 entries
    assert _choose(10**4, positions="causal") == "fused"
    assert _choose(10**4, derivatives=True) == "stream"
    assert _choose(10**4, dtype=torch.float64) == "stream" and _choose(10**4, dtype=torch.float16) == "fused"
    # a block of 2^24 entries with 3 temporaries (201 MB in float32) must fit the budget
    assert _choose(10**4, budget=202 * 10**6) == "rows" and _choose(10**4, budget=200 * 10**6) == "fused"
    assert ap.row_block(1, 10**4) == 1677 and ap.row_block(12, 10**4) == 139 and ap.row_block(1, 10**9) == 1


def test_dense_needs_both_a_small_size_and_room():
    assert _choose(1000, budget=GiB) == "dense"
    # 1e6 entries of float32 with 4 temporaries and 4 bytes of masks: 20 MB; in one row block with 3: 12 MB
    assert _choose(1000, budget=20 * 10**6) == "dense" and _choose(1000, budget=19 * 10**6) == "rows"
    assert _choose(1000, budget=11 * 10**6) == "fused"
    assert _choose(1000, budget=15 * 10**6, derivatives=True) == "stream"
    # use(threshold=...) widens the dense regime, never beyond the budget
    assert _choose(10**4, threshold=10**8) == "dense"
    assert _choose(10**4, threshold=10**8, budget=GiB) == "rows"
    assert _choose(10**4, threshold=10**8, budget=100 * 10**6) == "fused"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_never_a_kernel_that_materializes_the_scores_above_the_budget(dtype):
    """Over a grid of sizes, heads, masks, derivatives and budgets: "dense" only where its temporaries fit
    the budget; "fused" only where SDPA has fused CUDA kernels (not float64, no arbitrary mask)."""
    size = torch.empty((), dtype=dtype).element_size()
    grid = itertools.product([10, 1000, 3000, 10**5, 10**6], [1, 3, 8, 64, 65, 300], ["none", "causal", "other"],
                             [False, True], [2**20, GiB, 80 * GiB], [1, 12])
    for n, e, positions, derivatives, budget, batch in grid:
        path = _choose(n, e=e, dtype=dtype, positions=positions, derivatives=derivatives, budget=budget,
                       batch=batch)
        if path == "dense":
            assert batch * n * n * (ap.DENSE_TEMPORARIES * size + ap.DENSE_MASK_BYTES) <= budget
        elif path == "rows":
            block = min(batch * n * n, max(ap.ROW_ENTRIES, batch * n))
            assert ap.ROWS_TEMPORARIES * block * size <= budget and positions != "causal" and not derivatives
            assert batch * n * n <= ap.CUDA_ROWS_THRESHOLD
        elif path == "fused":
            assert dtype != torch.float64 and positions != "other" and not derivatives
        else:
            assert path == "stream"


@pytest.mark.parametrize("transforms, triton, dtype, e, expected", [
    (False, True, torch.float32, 3, "triton"),
    (False, True, torch.float64, 16, "triton"),
    (False, True, torch.float16, 32, "triton"),
    (False, True, torch.float16, 64, "tiles"),
    (False, True, torch.float32, 17, "tiles"),       # IEEE FMA products of 32 columns spill registers
    (False, True, torch.float64, 64, "tiles"),
    (True, True, torch.float32, 3, "tiles"),         # torch.func wraps tensors: the differentiable tiles
    (False, False, torch.float32, 3, "tiles"),       # no Triton: tiles sized by the budget
])
def test_stream_engine(transforms, triton, dtype, e, expected):
    assert ap.stream_engine("cuda", dtype, e, e, triton=triton, transforms=transforms) == expected
    assert ap.stream_engine("cuda", dtype, e, e, triton=triton, transforms=transforms, capability=(8, 0)) == expected
    # the CPU keeps its measured map whatever is installed
    assert ap.stream_engine("cpu", dtype, e, e, triton=triton, transforms=transforms) == "auto"


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (12, 1)])
def test_wide_float32_heads_take_triton_forward_and_jvp_on_hopper_and_later(capability):
    """Measured on an H200 (benchmarks/gpu.md, "wide"): at d = 64 Triton's three-pass TF32 forward pass and JVP
    beat the tile loops (and SDPA's forward), its VJP did not; on sm_80 the JVP kernel spills, unmeasured."""
    f32 = torch.float32
    for e, expected in ((17, "triton"), (32, "triton"), (64, "triton"), (65, "tiles"), (128, "tiles")):
        assert ap.stream_engine("cuda", f32, e, e, triton=True, capability=capability) == expected, e
        assert ap.stream_engine("cuda", f32, e, e, triton=True, capability=(8, 9)) == "tiles"
    assert ap.stream_engine("cuda", f32, 64, 3, triton=True, capability=capability) == "triton"
    assert ap.stream_engine("cuda", torch.float64, 64, 64, triton=True, capability=capability) == "tiles"
    assert ap.stream_engine("cuda", f32, 64, 64, triton=True, transforms=True, capability=capability) == "tiles"
    assert ap.stream_engine("cuda", f32, 64, 64, triton=False, capability=capability) == "tiles"
    # the VJP: Triton only at the widths of TRITON_MAX_WIDTH
    assert ap.triton_vjp(f32, 3, 3) and ap.triton_vjp(f32, 16, 9) and ap.triton_vjp(torch.float64, 16, 16)
    assert not ap.triton_vjp(f32, 17, 17) and not ap.triton_vjp(f32, 64, 64) and not ap.triton_vjp(f32, 3, 64)


def test_a_wide_head_chosen_by_device_takes_the_tile_loops_for_its_vjp(monkeypatch):
    """The engine chosen by device at d = 64 is Triton for the forward pass and JVP; the VJP goes to the tile
    loops unless Triton was forced."""
    from meanfield import attention_tiles as tiles

    calls = []
    monkeypatch.setattr(streaming, "_triton", lambda: (_ for _ in ()).throw(AssertionError("Triton VJP")))
    real = tiles.backward_tiles
    monkeypatch.setattr(tiles, "backward_tiles", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 20, 64, generator=g, dtype=torch.float32) for _ in range(3))
    out, lse = tiles.forward_tiles(q, k, v, None, None, None, tiles.Plan(8, 20))
    chosen = tiles.Plan(8, 20, engine="triton", fused=True)
    streaming._fast_backward(q, k, v, None, None, None, out, lse, torch.ones_like(out), None, chosen,
                             (True, True, True, False))
    assert calls == [1]
    with pytest.raises(AssertionError, match="Triton VJP"):
        streaming._fast_backward(q, k, v, None, None, None, out, lse, torch.ones_like(out), None,
                                 tiles.Plan(8, 20, engine="triton", fused=False), (True, True, True, False))


@pytest.mark.parametrize("batch, m, n, size, budget", [
    (1, 10**5, 10**5, 4, 40 * GiB), (1, 10**6, 10**6, 4, 40 * GiB), (12, 4096, 4096, 8, GiB),
    (1, 10**6, 10**6, 8, 2**20), (1, 7, 5, 4, 40 * GiB), (3, 10**6, 2 * 10**8, 4, GiB)])
def test_tile_shape_fits_the_budget_and_spans_the_keys_when_it_can(batch, m, n, size, budget):
    bq, bk = ap.tile_shape(batch, m, n, size, budget)
    assert 1 <= bq <= m and 1 <= bk <= n
    entries = batch * bq * bk
    allowed = max(ap.TILE_FRACTION * budget / (ap.TILE_TEMPORARIES * size), batch * min(m, 64))
    assert entries <= min(ap.MAX_TILE_ENTRIES, allowed) or (bq == min(m, 64) and bk == 1)
    if batch * min(m, 64) * n <= ap.TILE_FRACTION * budget / (ap.TILE_TEMPORARIES * size):
        assert bk == n  # row blocks against all keys: one launch of each kind per row block
    # the CPU-cache-sized tiles (256 x 256) are 152,881 tiles per pass at N = 1e5; here a few dozen
    if m == n == 10**5:
        assert math.ceil(m / bq) * math.ceil(n / bk) <= 64


@pytest.mark.parametrize("floors", [{64: 4, 32: 8, 16: 16}, {64: 16, 32: 16, 16: 16}], ids=["triton3.9", "triton3.6"])
def test_triton_width(floors, monkeypatch):
    """Powers of two, at least the smallest reduction of tl.dot in the installed Triton (3.6 refuses K = 8 in
    float32 at compile time; 3.9 takes it)."""
    monkeypatch.setattr(device, "triton_min_dot_k", lambda bits: floors[bits])
    f32, f64 = floors[32], floors[64]
    assert [ap.triton_width(e, torch.float32) for e in (1, 3, 8, 9, 16, 17, 64)] == \
        [f32, f32, max(8, f32), 16, 16, 32, 64]
    assert [ap.triton_width(e, torch.float64) for e in (1, 3, 5)] == [f64, f64, max(8, f64)]
    assert [ap.triton_width(e, torch.float16) for e in (3, 64, 65)] == [16, 64, 128]
    # d = 3 stays on the Triton engine with either floor (16 columns is the widest float32 width it takes)
    assert ap.stream_engine("cuda", torch.float32, 3, 3, triton=True) == "triton"


def test_triton_min_dot_k_reads_the_installed_triton_or_takes_the_strictest(monkeypatch):
    """Triton 3.6 asks K >= 16 of tl.dot in every 16- to 64-bit type (seen on an H200: the kernels did not
    compile with K = 8); its NVIDIA backend from 3.9 on takes 8 in float32 and 4 in float64. Without Triton:
    the strictest floor."""
    import builtins
    import sys

    device.triton_min_dot_k.cache_clear()
    try:
        triton = sys.modules.get("triton")
        try:
            import triton
        except ImportError:
            triton = None
        if triton is not None:
            version = tuple(int(x) for x in triton.__version__.split(".")[:2])
            if version >= (3, 9):
                assert [device.triton_min_dot_k(b) for b in (16, 32, 64)] == [16, 8, 4]
            elif version <= (3, 6):
                assert [device.triton_min_dot_k(b) for b in (16, 32, 64)] == [16, 16, 16]
        device.triton_min_dot_k.cache_clear()
        with pytest.raises(ValueError, match="bits"):
            device.triton_min_dot_k(12)
        real_import = builtins.__import__

        def no_triton(name, *a, **kw):
            if name.startswith("triton"):
                raise ImportError(name)
            return real_import(name, *a, **kw)

        monkeypatch.setattr(builtins, "__import__", no_triton)
        monkeypatch.delitem(sys.modules, "triton.backends.nvidia.compiler", raising=False)
        assert [device.triton_min_dot_k(b) for b in (16, 32, 64)] == [16, 16, 16]
    finally:
        device.triton_min_dot_k.cache_clear()


def test_choose_rejects_an_unknown_positions_kind():
    with pytest.raises(ValueError, match="positions"):
        _choose(100, positions="sequence")


# ---------------------------------------------------------------- the memory budget


class FakeDriver:
    """torch.cuda's memory queries on a CPU build: the driver's free memory, torch's allocator counters and a
    clock, each settable; counts the driver queries."""

    def __init__(self, monkeypatch, free, reserved=0, allocated=0):
        self.free, self.reserved, self.allocated, self.now, self.queries = free, reserved, allocated, 100.0, []
        monkeypatch.setattr(device, "_READINGS", {})
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: self.allocated)
        monkeypatch.setattr(device.time, "monotonic", lambda: self.now)
        # on a CUDA build the budget would read the real allocator's counters from this one call: faked too
        monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda index: {
            "reserved_bytes": {"all": {"current": self.reserved}},
            "allocated_bytes": {"all": {"current": self.allocated}}}, raising=False)

    def mem_get_info(self, dev=None):
        self.queries.append(dev)
        return self.free, 80 * GiB


def test_memory_budget_is_the_free_memory_capped_by_the_limit(monkeypatch):
    FakeDriver(monkeypatch, free=3 * GiB, reserved=2 * GiB, allocated=GiB)
    # free 3 GiB + 1 GiB cached by torch but unused
    assert device.memory_budget("cuda", limit=100 * GiB) == 4 * GiB
    assert device.memory_budget("cuda", limit="2G") == 2 * GiB
    monkeypatch.setenv("SMOOTH_ATTENTION_MEMORY_LIMIT", "1G")
    assert device.memory_budget("cuda:0") == GiB
    assert device.memory_budget("cpu") == GiB


def test_the_allocator_counters_come_from_one_call_where_torch_has_it(monkeypatch):
    """torch.cuda.memory_reserved / memory_allocated build and sort the whole statistics dict in Python; the
    budget reads the nested dict of torch._C._cuda_memoryStats once instead, and falls back to them."""
    stats = {"reserved_bytes": {"all": {"current": 5 * GiB}}, "allocated_bytes": {"all": {"current": 2 * GiB}}}
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda index: stats, raising=False)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 1 / 0)
    assert device._allocator_bytes(0) == (5 * GiB, 2 * GiB)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda index: {}, raising=False)   # CUDA not initialized
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 3)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 1)
    assert device._allocator_bytes(0) == (3, 1)


def test_the_driver_is_asked_once_per_ttl_and_its_reading_follows_torchs_own_allocations(monkeypatch):
    """The driver's free memory is read at most once per DRIVER_TTL seconds; in between, what torch's allocator
    reserved from (or released to) the driver is subtracted from (added to) that reading, and a need above the
    corrected reading asks again (a refusal or a smaller path is never decided on an old reading)."""
    drv = FakeDriver(monkeypatch, free=10 * GiB, reserved=2 * GiB, allocated=GiB)
    limit = 100 * GiB
    assert device.memory_budget("cuda", limit) == 11 * GiB and len(drv.queries) == 1
    # torch reserves 4 GiB more (all in use): the driver has 6 GiB left, nothing is cached
    drv.free, drv.reserved, drv.allocated = 6 * GiB, 6 * GiB, 6 * GiB
    assert device.memory_budget("cuda", limit) == 6 * GiB and len(drv.queries) == 1
    # torch frees its tensors (kept in its cache): 6 GiB cached, 6 GiB from the driver
    drv.allocated = 0
    assert device.memory_budget("cuda", limit) == 12 * GiB and len(drv.queries) == 1
    # empty_cache gives the reserve back to the driver
    drv.free, drv.reserved = 12 * GiB, 0
    assert device.memory_budget("cuda", limit) == 12 * GiB and len(drv.queries) == 1
    # another process takes 8 GiB: unseen until the reading expires ...
    drv.free = 4 * GiB
    assert device.memory_budget("cuda", limit) == 12 * GiB and len(drv.queries) == 1
    # ... or a need above the reading asks again at once
    assert device.memory_budget("cuda", limit, need=13 * GiB) == 4 * GiB and len(drv.queries) == 2
    drv.free = 9 * GiB
    drv.now += device.DRIVER_TTL + 0.01
    assert device.memory_budget("cuda", limit) == 9 * GiB and len(drv.queries) == 3
    # a need the reading covers asks nothing
    assert device.memory_budget("cuda", limit, need=8 * GiB) == 9 * GiB and len(drv.queries) == 3


def test_the_accelerator_choice_reads_the_budget_and_the_positions(monkeypatch):
    """kernels._choose_accelerator (what auto runs on a device other than the CPU), on CPU tensors with a
    faked budget: it classifies the positions and passes the budget to the pure choice."""
    seen = {}

    def fake_choose(*args, **kw):
        seen.update(kw, args=args)
        return "fused" if kw["positions"] == "causal" else "stream"

    monkeypatch.setattr(ap, "choose", fake_choose)
    reads = []
    monkeypatch.setattr(device, "memory_budget", lambda dev, limit=None, need=None: reads.append(need) or 123)
    n = 50
    q, k, v = (torch.randn(2, n, 3, dtype=DT) for _ in range(3))
    pos = torch.arange(n, dtype=DT)
    assert kernels._choose_accelerator(q, k, v, None, pos, pos, None) == ("fused", True)
    assert reads == []  # the budget is handed over unread: the choice reads it only where dense is considered
    assert seen["positions"] == "causal" and seen["budget"]() == 123 and seen["args"][2:6] == (2, n, n, 3)
    assert reads == [2 * n * n * (ap.DENSE_TEMPORARIES * 8 + ap.DENSE_MASK_BYTES)]
    assert kernels._choose_accelerator(q, k, v, None, pos, pos.flip(0), None) == ("stream", False)
    kernels._choose_accelerator(q, k, v, torch.zeros(n, dtype=DT), None, None, None)
    assert seen["positions"] == "none" and seen["weighted"] and not seen["derivatives"]
    kernels._choose_accelerator(q.requires_grad_(True), k, v, None, None, None, None)
    assert seen["derivatives"]


def test_the_positions_are_read_only_where_the_path_depends_on_them(monkeypatch):
    """Recognising a sequence's causal mask reads the positions (a host sync on a GPU): not for the dense path
    or for derivatives (chosen whatever the mask), but for every other path, and the causal choice wins."""
    n = 50
    q, k, v = (torch.randn(1, n, 3, dtype=DT) for _ in range(3))
    pos = torch.arange(n, dtype=DT)
    reads = []
    real = kernels.sequence_mask
    monkeypatch.setattr(kernels, "sequence_mask", lambda a, b: reads.append(1) or real(a, b))
    monkeypatch.setattr(device, "memory_budget", lambda dev, limit=None, need=None: 40 * GiB)
    assert kernels._choose_accelerator(q, k, v, None, pos, pos, None) == ("dense", None) and reads == []
    big = 10**5
    qb = torch.empty(1, big, 3, dtype=torch.float32)
    pb = torch.arange(big, dtype=torch.float32)
    assert kernels._choose_accelerator(qb, qb, qb, None, pb, pb, None) == ("fused", True) and reads == [1]
    assert kernels._choose_accelerator(qb, qb, qb, None, pb, pb.flip(0), None) == ("stream", False)
    # a wide causal sequence: dense only without the causal mask, so the positions are read (fused)
    qw = torch.empty(1, 4096, 64, dtype=torch.float32)
    pw = torch.arange(4096, dtype=torch.float32)
    reads.clear()
    assert kernels._choose_accelerator(qw, qw, qw, None, pw, pw, None) == ("fused", True) and len(reads) == 1
    assert kernels._choose_accelerator(qw, qw, qw, None, pw, pw.flip(0), None) == ("dense", False)
    reads.clear()
    qg = qb.clone().requires_grad_(True)
    assert kernels._choose_accelerator(qg, qb, qb, None, pb, pb, None) == ("stream", None)
    assert reads == []
    # the paths agree with the choice made with the mask read
    for qp, kp in ((pb, pb), (pb, pb.flip(0))):
        kind = "causal" if kernels.sequence_mask(qp, kp) else "other"
        assert ap.choose("cuda", torch.float32, 1, big, big, 3, 3, weighted=False, positions=kind, derivatives=False,
                         transforms=False, budget=40 * GiB) == \
            kernels._choose_accelerator(qb, qb, qb, None, qp, kp, None)[0]


def test_the_budget_is_read_only_where_the_dense_path_is_considered():
    """Reading the budget asks the driver (about 0.4 ms on an H200): a call no dense path is considered for
    (fused or streamed whatever the memory) must not read it; one that is considered reads it once."""
    reads = []

    def budget():
        reads.append(1)
        return 40 * GiB

    assert _choose(10**5, budget=budget) == "fused" and reads == []
    assert _choose(10**4, budget=budget, derivatives=True) == "stream" and reads == []
    assert _choose(10**4, budget=budget, positions="causal") == "fused" and reads == []
    assert _choose(1000, budget=budget) == "dense" and reads == [1]
    assert _choose(10**4, budget=budget) == "rows" and reads == [1, 1]   # the rows path is a dense path


def test_memory_budget_asks_the_driver_only_for_large_needs(monkeypatch):
    """On CUDA the budget is min(framework limit, free + torch's unused cache); a need of at most
    ALWAYS_FREE bytes is not weighed against the device's free memory (the driver query costs more than a
    small call), but still against the framework's limit."""
    drv = FakeDriver(monkeypatch, free=5 * 2**30, reserved=3 * 2**30, allocated=2**30)
    limit = 100 * 2**30
    assert device.memory_budget("cuda", limit, need=device.ALWAYS_FREE) == limit and drv.queries == []
    assert device.memory_budget("cuda", limit, need=device.ALWAYS_FREE + 1) == 7 * 2**30 and len(drv.queries) == 1
    assert device.memory_budget("cuda", 2**30, need=2**20) == 2**30 and len(drv.queries) == 1
    # a framework limit below the need caps the budget
    assert device.memory_budget("cuda", 2**20, need=2**21) == 2**20


# ---------------------------------------------------------------- SDPA with a padded head (runs on CPU too)


def _inputs(seed, n=40, e=3, c=3, weighted=True, positions=None):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, n, e, generator=g, dtype=DT), torch.randn(2, n, e, generator=g, dtype=DT)
    v = torch.randn(2, n, c, generator=g, dtype=DT)
    lw = None
    if weighted:
        lw = torch.log_softmax(torch.randn(n, generator=g, dtype=DT), 0)
        lw[[1, 7]] = -math.inf
    qp = kp = None
    if positions == "causal":
        qp = kp = torch.arange(1, n + 1, dtype=DT) / n
    elif positions == "other":
        qp, kp = torch.rand(n, generator=g, dtype=DT), torch.rand(n, generator=g, dtype=DT)
        qp[0] = -1.0
    return q, k, v, lw, qp, kp


@pytest.mark.parametrize("e, c", [(3, 3), (3, 5), (64, 64), (7, 2)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("positions", [None, "causal", "other"])
def test_padded_sdpa_equals_dense(e, c, weighted, positions):
    args = _inputs(1, e=e, c=c, weighted=weighted, positions=positions)
    ref = attend(*args, method="dense")
    _close(streaming.fused_attend(*args, align=ap.FUSED_ALIGN), ref)
    if positions == "causal" and weighted:
        lw = args[3].clone()
        lw[:5] = -math.inf  # the first queries see only zero-mass keys: their rows are zeros
        args = args[:3] + (lw,) + args[4:]
        out = streaming.fused_attend(*args, align=ap.FUSED_ALIGN)
        assert torch.all(out[..., :5, :] == 0)
        _close(out, attend(*args, method="dense"))


def test_no_fused_kernel_falls_back_to_the_streamed_kernel(monkeypatch):
    """Where torch finds no fused kernel (math excluded), the call streams instead of failing or
    materializing the scores; any other error propagates."""
    args = _inputs(2, positions="causal")

    def refuse(*a, **kw):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(streaming, "fused_attend", refuse)
    streamed = []
    stream = streaming.stream_attend
    monkeypatch.setattr(streaming, "stream_attend", lambda *a, **kw: streamed.append(1) or stream(*a, **kw))
    _close(kernels.fused_or_stream(*args), attend(*args, method="dense"))
    assert streamed

    def broken(*a, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(streaming, "fused_attend", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        kernels.fused_or_stream(*args)


def test_fused_or_stream_runs_sdpa_without_its_math_kernel_on_cpu():
    """On CPU torch's flash kernel takes the padded call: the result equals dense (and the math kernel,
    excluded, is not needed)."""
    args = _inputs(3, e=3, c=3, positions="causal")
    _close(kernels.fused_or_stream(*args), attend(*args, method="dense"))


def test_stream_engine_argument_is_checked():
    q = torch.randn(5, 3, dtype=DT)
    with pytest.raises(ValueError, match="engine"):
        streaming.stream_attend(q, q, q, engine="cuda")
    _close(streaming.stream_attend(q, q, q, engine="tiles"), attend(q, q, q, method="dense"))


def _numpy_attention(q, k, v, lw, qp, kp):
    """Weighted masked attention written out row by row in numpy (float64): rows with no visible key of
    positive weight are zeros."""
    import numpy as np

    q, k, v = q.numpy(), k.numpy(), v.numpy()
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for b in np.ndindex(q.shape[:-2]):
        for i in range(q.shape[-2]):
            s = k[b] @ q[b][i]
            keep = np.ones(k.shape[-2], bool)
            if lw is not None:
                keep &= np.isfinite(lw.numpy())
                s = s + np.where(keep, lw.numpy(), 0.0)
            if qp is not None:
                keep &= kp.numpy() <= qp.numpy()[i]
            if keep.any():
                w = np.exp(s[keep] - s[keep].max())
                out[b][i] = (w / w.sum()) @ v[b][keep]
    return torch.from_numpy(out)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("positions", [None, "other"])
@pytest.mark.parametrize("rows", [1, 7, 40, None])
def test_rows_path_equals_the_attention_written_out(weighted, positions, rows, monkeypatch):
    """The "rows" path (dense blocks of rows against all keys), a block size not dividing n included, against
    numpy; through attend(method="auto") when the accelerator choice takes it; rows without a visible key of
    positive weight (the first query is placed before every key) are zeros, with finite gradients."""
    q, k, v, lw, qp, kp = _inputs(2, weighted=weighted, positions=positions)
    ref = _numpy_attention(q, k, v, lw, qp, kp)
    _close(kernels.rows_attend(q, k, v, lw, qp, kp, rows=rows), ref, tol=1e-12)
    no_queries = kernels.rows_attend(q[:, :0], k, v, lw, None if qp is None else qp[:0], kp, rows=rows)
    assert no_queries.shape == (2, 0, 3)
    monkeypatch.setattr(kernels, "_choose", lambda *a: ("rows", None))
    monkeypatch.setattr(ap, "ROW_ENTRIES", 2 * 40 * 7)   # 7 rows per block
    qg = q.clone().requires_grad_(True)
    out = attend(qg, k, v, lw, qp, kp)
    _close(out.detach(), ref, tol=1e-12)
    out.sum().backward()
    assert torch.isfinite(qg.grad).all()
    if positions == "other":
        assert torch.equal(out[:, 0].detach(), torch.zeros(2, 3, dtype=DT))


@pytest.mark.parametrize("first", [False, True])
def test_small_heads_leave_the_memory_efficient_kernel_only_when_asked(monkeypatch, first):
    """accelerator_paths.SMALL_HEADS_FIRST (on since measured on an H200): an ``auto`` streamed call on an accelerator
    sends the passes the mask allows to torch's memory-efficient kernel (plan.fused), except, once it is on, those of
    small heads on the Triton engine. Meta tensors stand in for an accelerator; the plan is read where the call would
    run."""
    from meanfield import streamed_attention as streaming

    monkeypatch.setattr(ap, "SMALL_HEADS_FIRST", first)
    f32, f64 = torch.float32, torch.float64
    assert ap.efficient_first("cuda", f32, 3, 3, "triton") is not first
    assert ap.efficient_first("cuda", f32, 3, 5, "triton") and ap.efficient_first("cuda", f64, 3, 3, "triton")
    assert ap.efficient_first("cuda", f32, 3, 3, "tiles") and not ap.efficient_first("cpu", f32, 3, 3, "triton")
    plans = []

    class Stop(Exception):
        pass

    def capture(*args):
        plans.append(args[-1])
        raise Stop

    monkeypatch.setattr(streaming, "_resolve_engine", lambda engine, q, v: "triton" if engine is None else engine)
    monkeypatch.setattr(streaming.StreamAttention, "apply", capture)
    for e, c in ((3, 3), (3, 8)):
        q, k, v = (torch.empty(*shape, device="meta") for shape in ((40, e), (50, e), (50, c)))
        with pytest.raises(Stop):
            streaming.stream_attend(q, k, v, block_size=(16, 16))
        with pytest.raises(Stop):
            streaming.stream_attend(q, k, v, block_size=(16, 16), engine="triton")   # forced: never fused
    assert [p.fused for p in plans] == [not first, False, True, False]


def test_small_heads_stream_in_the_small_kernels_above_the_dense_path(monkeypatch):
    """On an H200 (2026-11-29, benchmarks/gpu.md, "small"; d = 3, float32, every mask) the small-head Triton kernels
    were 2.6-3.8x faster than the best of SDPA (padded), its backward and the matrix-product kernels at N = 1e4, and
    6-9x at 1e5 and 1e6, where auto took the row blocks or SDPA: with them every auto call above the dense path
    streams, whatever the mask; below it stays dense; heads they do not take keep the map measured before."""
    def pick(n, small, **kw):
        return ap.choose("cuda", torch.float32, 1, n, n, 3, 3, budget=40 * GiB, transforms=False,
                         small_kernels=small, **{"weighted": False, "positions": "none", "derivatives": False, **kw})

    for n in (2000, 10**4, 10**5, 10**6):
        for positions, weighted in itertools.product(("none", "causal", "other"), (False, True)):
            assert pick(n, True, positions=positions, weighted=weighted) == "stream", (n, positions, weighted)
    assert pick(1000, True) == "dense" and pick(1000, True, derivatives=True) == "dense"
    assert pick(10**4, False) == "rows" and pick(10**5, False) == "fused"
    assert pick(10**5, False, positions="causal") == "fused"
    # which calls run in them: an accelerator where Triton runs, no torch.func transform, at most 3 features of q
    # and of v, float32 or a half type
    yes = dict(triton=True, transforms=False)
    for e, c, dtype in ((3, 3, torch.float32), (1, 1, torch.float32), (2, 3, torch.float16), (3, 1, torch.bfloat16)):
        assert ap.small_kernels("cuda", dtype, e, c, **yes), (e, c, dtype)
    assert not ap.small_kernels("cuda", torch.float32, 4, 3, **yes)
    assert not ap.small_kernels("cuda", torch.float32, 3, 4, **yes)
    assert not ap.small_kernels("cuda", torch.float64, 3, 3, **yes)
    assert not ap.small_kernels("cuda", torch.float32, 3, 3, triton=False, transforms=False)
    assert not ap.small_kernels("cuda", torch.float32, 3, 3, triton=True, transforms=True)
    assert not ap.small_kernels("cpu", torch.float32, 3, 3, **yes)
    monkeypatch.setattr(ap, "SMALL_HEADS_FIRST", False)
    assert not ap.small_kernels("cuda", torch.float32, 3, 3, **yes)


def test_auto_on_an_accelerator_sends_small_heads_to_the_small_kernels(monkeypatch):
    """kernels.choose on meta tensors (an accelerator without a GPU) where Triton would run: d = 3 in float32 streams
    from the end of the dense path on, d = 5 keeps the row blocks; a forward pass that the series could take waits
    for SERIES_THRESHOLD_SMALL_HEADS entries (about N = 38700; the small-head kernels beat the series below about
    N = 3.5e4 on the H200) instead of SERIES_THRESHOLD_ACCELERATOR (about 32768) before reading the plan."""
    from meanfield import series_attention

    monkeypatch.setattr(device, "triton_runs", lambda device_type: device_type != "cpu")
    monkeypatch.setattr(device, "memory_budget", lambda dev, limit=None, need=None: 40 * GiB)
    planned = []
    monkeypatch.setattr(series_attention, "plan", lambda *a, **kw: planned.append(a[0].shape[-2]))

    def meta(n, e):
        return tuple(torch.empty(n, e, device="meta") for _ in range(3))

    assert kernels.small_kernels(*meta(10, 3)[:2]) and not kernels.small_kernels(*meta(10, 5)[:2])
    assert not kernels.small_kernels(torch.empty(10, 3), torch.empty(10, 3))   # the CPU keeps its map
    assert kernels.choose(*meta(10**4, 3)) == "stream" and kernels.choose(*meta(10**4, 5)) == "rows"
    assert kernels.choose(*meta(1000, 3)) == "dense"
    q, k, v = meta(36_000, 3)   # 1.3e9 score entries: between the two series thresholds
    assert kernels.choose(q, k, v) == "stream" and planned == []
    q5, k5, v5 = meta(36_000, 5)
    kernels.choose(q5, k5, v5)
    assert planned == [36_000]   # a head the small kernels do not take: the series is considered
    assert kernels.choose(*meta(40_000, 3)) == "stream" and planned == [36_000, 40_000]
    monkeypatch.setattr(ap, "SMALL_HEADS_FIRST", False)
    assert not kernels.small_kernels(q, v) and kernels.choose(*meta(10**4, 3)) == "rows"


def test_a_small_call_on_an_accelerator_does_not_ask_whether_its_head_is_small(monkeypatch):
    """Routing cost: whether a head runs in the small-head kernels (Triton's presence, the engine, the widths: most of
    auto's routing of a call at N = 1e3, 57 us on meta tensors on one CPU thread, 14 us without it) matters only
    above the dense path and above the series' floors. A dense call never asks it; a streamed one below the floors
    asks once (it was asked twice per call: by the series' floor and by the path)."""
    monkeypatch.setattr(device, "triton_runs", lambda device_type: device_type != "cpu")
    monkeypatch.setattr(device, "memory_budget", lambda dev, limit=None, need=None: 40 * GiB)
    asked = []
    real = kernels.small_kernels
    monkeypatch.setattr(kernels, "small_kernels", lambda q, v: asked.append(q.shape[-2]) or real(q, v))

    def meta(n, e=3):
        return tuple(torch.empty(n, e, device="meta") for _ in range(3))

    for args in (meta(1000), meta(1000, 64), meta(1000) + (torch.empty(1000, device="meta"),)):
        assert kernels.choose(*args) == "dense"
    assert asked == []
    assert kernels.choose(*meta(10**4)) == "stream" and asked == [10**4]
    asked.clear()
    assert kernels.choose(*meta(36_000)) == "stream" and asked == [36_000, 36_000]   # the series' floor, then the path


def test_accelerator_tiles_count_the_vmap_levels_of_forward_backward_and_jvp(monkeypatch):
    """Review 46: tiles sized by the memory budget counted one sample under torch.func.vmap, so a vmapped tile was B
    times over it (64 GiB temporaries against a 40 GiB budget at N = 1e5). The forward counts the levels around
    it; a backward or JVP under more levels than its forward (jacrev, jacfwd) is tiled again (meta tensors:
    the accelerator branch without a GPU)."""
    seen = []
    real = ap.tile_shape
    monkeypatch.setattr(ap, "tile_shape", lambda *a: seen.append(a[0]) or real(*a))
    f = lambda x: attend(x, x, x, method="stream")
    torch.func.vmap(f)(torch.empty(64, 10_000, 3, device="meta"))
    assert seen == [64]
    x = torch.empty(10_000, 3, device="meta")
    _, pullback = torch.func.vjp(f, x)
    torch.func.vmap(pullback)(torch.empty(32, 10_000, 3, device="meta"))
    assert seen == [64, 1, 32]
    torch.func.vmap(lambda t: torch.func.jvp(f, (x,), (t,)))(torch.empty(16, 10_000, 3, device="meta"))
    assert seen[-1] == 16


def test_tiles_again_under_jacrev_and_jacfwd_give_the_dense_jacobians(monkeypatch):
    """The retiled plans (a small budget: many tiles, which keys are visible read again from the positions) give
    the Jacobians of the dense reference, weighted, with positions."""
    from meanfield import attention_tiles as tiles

    g = torch.Generator().manual_seed(0)
    m, n = 37, 41
    q, k, v = (torch.randn(r, 3, generator=g, dtype=torch.float64) for r in (m, n, n))
    lw = torch.randn(n, generator=g, dtype=torch.float64)
    qp, kp = torch.rand(m, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64)
    qp[0] = -1.0   # a query that sees no key: a zero row
    seen = []
    real = ap.tile_shape
    monkeypatch.setattr(ap, "tile_shape", lambda *a: seen.append(a) or real(*a))
    monkeypatch.setattr(device, "memory_budget", lambda dev: 2**14)   # tiles of a few keys
    plan = dataclasses.replace(tiles.tile_plan(qp[None], kp[None], m, n, m, n), sized_for=1)

    def streamed(q, k, v):
        return streaming.StreamAttention.apply(q[None], k[None], v[None], lw[None], qp[None], kp[None], plan)[0][0]

    def dense(q, k, v):
        hidden = kp[None, :] > qp[:, None]
        alive = ~hidden.all(-1, keepdim=True)
        s = (q @ k.T + lw).masked_fill(hidden & alive, -math.inf)   # a dead row: any finite softmax, then 0
        return torch.softmax(s, -1) * alive @ v

    for jac in (torch.func.jacrev, torch.func.jacfwd):
        seen.clear()
        got, want = jac(streamed, argnums=(0, 1, 2))(q, k, v), jac(dense, argnums=(0, 1, 2))(q, k, v)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        bq, bk = real(*seen[0])
        assert seen[0][0] > 1 and bq * bk < m * n   # tiled again for the vmapped batch, in several tiles


def test_triton_only_where_its_int32_indices_reach(monkeypatch):
    """Review 46 F4: the Triton kernels index a batch entry in int32; a strided head of a multi-head layout (row
    stride 768) passes 2^31 at N = 2.8e6, where offsets would wrap. Such tensors go to the tile loops (meta
    tensors: nothing computed); a contiguous d = 3 cloud of 1e6 tokens stays on Triton."""
    calls = []
    fake = type("FakeTriton", (), {"forward": staticmethod(lambda *a: calls.append("triton") or (None, None))})
    monkeypatch.setattr(streaming, "_triton", lambda: fake)
    monkeypatch.setattr(streaming.tiles, "forward_tiles", lambda *a: calls.append("tiles") or (None, None))
    plan = streaming.tiles.Plan(64, 10**6, engine="triton")
    small = torch.empty(1, 10**6, 3, device="meta")
    streaming._forward(small, small, small, None, None, None, plan)
    heads = torch.empty(1, 3 * 10**6, 768, device="meta")[..., :64]   # one head of 12 in a fused projection
    streaming._forward(heads, heads, heads, None, None, None, plan)
    assert calls == ["triton", "tiles"]
    assert streaming._int32_spans(torch.empty(1, 2 * 10**6, 768, device="meta")[..., :64])
    # an output wider than its queries: 8e8 queries of 2 features (1.6e9 entries, in reach) but 2.4e9 output entries
    # (a review of 2026-11-29: rows * c wrapped in the kernels' int32 offsets)
    calls.clear()
    q, k, v = (torch.empty(1, *shape, device="meta") for shape in ((8 * 10**8, 2), (1, 2), (1, 3)))
    streaming._forward(q, k, v, None, None, None, plan)
    streaming._forward(q, k, v[..., :2], None, None, None, plan)
    assert calls == ["tiles", "triton"]
