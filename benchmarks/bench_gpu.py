"""The framework on one GPU against the fastest peers, side by side in one process.

    python benchmarks/bench_gpu.py                       # every section (about 30-60 min on an H100)
    python benchmarks/bench_gpu.py --sections table      # the issue's table only (about 10 min)
    python benchmarks/bench_gpu.py --sections grid derivatives lipschitz sinkhorn dynamics --quick

On a machine without CUDA it says so and exits (status 0) without measuring anything. Every figure is
the median of ``--repeats`` (3) timed calls after one warm-up, candidates interleaved (A, B, C, A, ...
in an order rotated at every repeat), ``torch.cuda.synchronize`` around each call, float32 unless
said; ratios are peer / ours (> 1: ours faster). A call that raises CUDA's out-of-memory error is
reported as such; a candidate whose call exceeds ``--cap`` seconds is not timed again nor run at larger
N. Sections (each writes its rows as it finishes them; results of separate runs on the same GPU are
merged in ``benchmarks/gpu.json`` and ``benchmarks/gpu.md`` is rewritten from all of them):

* ``table``: every row of the table that motivated the GPU work, same peers, same sizes (attention
  forward d = 3 / 64, the streamed path, small N, VJP and JVP at d = 64, Sinkhorn, simulate, the
  certified Lipschitz constant of a Hugging Face GPT-2 layer against power iteration);
* ``grid`` (goal: auto within 1.2x of the best peer): attention forward, N = 1e3 .. 1e6, d = 3 and 64,
  unweighted / weighted / causal sequence / arbitrary positions; peers: SDPA with the head zero-padded
  to a multiple of 8, rows in chunks of 2048 against all keys, naive dense;
* ``derivatives`` (goals: VJP within 1.5x and JVP within 2x of SDPA's backward): N = 1e4 .. 1e6, d = 64
  and 3, plain, weighted, causal, arbitrary positions;
* ``lipschitz`` (goal: N = 1e5 under 30 s, 1e6 under 10 min, the CPU's certificate): the certified
  mean-field constant of SelfAttention(A, V) on a weighted measure in d = 3;
* ``sinkhorn`` (goals: within 1.5x of GeomLoss ``tensorized`` where it fits, N = 1e6 under 60 s):
  debiased, blur 0.05 (reg = 2 blur^2 = 0.005 in squared-distance units), tol 1e-3;
* ``dynamics`` (goal: within 1.3x of a plain RK4 loop on the best kernel): simulate, rk4, 10 steps, d = 3;
* ``small`` (the small heads' FMA kernels, meanfield.triton_small_heads): the Triton kernels themselves at d = 3,
  float32, N = 1e4 .. 1e6, each mask: forward, JVP and VJP of the small-head kernels against the
  matrix-product kernels and SDPA padded (forward; backward for the derivatives);
* ``fixed`` (what a call costs besides its arithmetic, goal 2 below 1e5): the forward at N = 1e3 and 1e4,
  d = 3, each mask, and the VJP at 1e4: one synchronized call and the time per call in a loop of 20 calls
  synchronized once, ours against naive dense (SDPA's backward), with the CUDA kernel launches, host syncs
  and other runtime calls of one call of each (torch.profiler).

``--quick`` leaves out N = 1e6 (and Lipschitz's 3e5); ``--sizes 1e6`` runs only the rows at those N and keeps the
section's other rows in the store. A row at N >= 1e6 first runs at N = 1e5 (auto's path at 1e6; kernels
compile there; a warm-up and one timed call, not kept), then takes one timed call per repeat without a warm-up
call (each takes seconds; ``--repeats 1`` for a lent device), each started only if the 1e5 time, scaled as N^2,
fits the time left before the deadline; the derivatives rows there time ours against SDPA's backward only.
``--steps`` sets the RK4 steps of the dynamics rows. ``--cpu-smoke`` runs every section at tiny sizes on the CPU
(to check the script itself; its figures mean nothing) and writes to ``--out`` only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meanfield import SelfAttention, local_lipschitz, simulate  # noqa: E402
from meanfield import streamed_attention as streaming  # noqa: E402
from meanfield.kernels import attend, choose  # noqa: E402
from particles import Measure  # noqa: E402
from particles.validation import output_checks_deferred  # noqa: E402
from transport import w2  # noqa: E402

SECTIONS = ("table", "grid", "derivatives", "wide", "small", "lipschitz", "sinkhorn", "dynamics", "fixed")
OOM = "out of memory"
CHUNK_ROWS = 2048
BLUR = 0.05
SINKHORN_TOL = 1e-3
#: a candidate is skipped at a larger N when its N^2 extrapolation exceeds this many times --cap
PREDICTION_MARGIN = 4.0
#: from this N on, a row primed at a small N (Bench.prime) skips its warm-up call, and the derivatives section
#: times ours against SDPA's backward only (no engine forced, no dense reference)
BIG_N = 10**6
#: N of the row that primes a row at N >= BIG_N: auto's path there is the one at 1e6 (at 1e4 the forward pass takes
#: dense row blocks instead of SDPA or the Triton kernel), so no compilation is left for the timed call
PRIME_N = 10**5


# ---------------------------------------------------------------------- timing
class Bench:
    def __init__(self, device, repeats, cap, smoke):
        self.device, self.repeats, self.cap, self.smoke = device, repeats, cap, smoke
        self.too_slow = set()   # (context, candidate) that exceeded the cap (skipped at larger N)
        self.history = {}       # (context, candidate) -> (N, median seconds) of its last timed row
        self.peaks = {}         # candidate -> peak GiB above the inputs in its first call (CUDA) of the last row
        self.primed = {}        # (context, candidate) -> (N, seconds) of its warm-up call at a small N (prime)
        self.priming = False
        self.deadline = None    # time.monotonic() after which no row starts (--deadline)

    def left(self):
        """Seconds until --deadline (None without one)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def prime(self, row, *args, **kwargs):
        """Run ``row(*args, **kwargs)`` (a row at a small N), its result not kept: kernels compile and the
        allocator warms there, so that the same row at N >= :data:`BIG_N` may skip its warm-up call (each call
        there takes seconds; compilation is done); one call after the warm-up is timed, the time that row's
        candidates are extrapolated from (a warm-up's time holds compilation)."""
        saved = self.repeats, dict(self.history), dict(self.peaks)
        self.repeats, self.priming = 1, True
        try:
            row(*args, **kwargs)
        finally:   # (what went over --cap there stays skipped at larger N)
            self.repeats, self.history, self.peaks = saved
            self.priming = False

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _call(self, fn):
        """(seconds, result) of one synchronized call, or (None, 'out of memory')."""
        self.sync()
        t0 = time.perf_counter()
        try:
            out = fn()
            self.sync()
        except (torch.cuda.OutOfMemoryError, MemoryError):
            out = OOM
        except Exception as exc:  # one failing candidate must not cost the rest of a device lease
            if "out of memory" in str(exc).lower():
                out = OOM
            else:
                traceback.print_exc()
                first = (str(exc).strip().splitlines() or [""])[0]
                return None, f"error: {type(exc).__name__}: {first[:160]}"
        t = time.perf_counter() - t0
        if out is OOM:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return None, OOM
        return t, out

    def _first_call(self, fn, name):
        """One synchronized call; on CUDA its peak memory above what was allocated before it goes to
        ``self.peaks[name]`` (GiB)."""
        if self.device.type == "cuda":
            self.sync()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t, out = self._call(fn)
        if self.device.type == "cuda" and t is not None:
            self.peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
        return t, out

    def time(self, fns: dict, n=None, context="") -> dict:
        """name -> median seconds, 'out of memory', 'error: ...', 'over cap (X s)', 'skipped (over cap at
        smaller N)' or 'skipped (about X s predicted ...)': a candidate whose last timed N, scaled as N^2,
        predicts more than PREDICTION_MARGIN times the cap at this N is not run (the device's time is lent,
        not owned; the margin because fixed costs at the smaller N inflate the extrapolation: simulate at
        N = 1e5 on an H200 took 2.6 s where 13 s were predicted from N = 1e4)."""
        res, live, timed_first = {}, [], {}
        self.peaks = {}
        for name, fn in fns.items():
            key = (context, name)
            if fn is None:
                res[name] = "n/a"
                continue
            if key in self.too_slow:
                res[name] = "skipped (over cap at smaller N)"
                continue
            if n is not None and key in self.history:
                n0, t0 = self.history[key]
                predicted = t0 * (n / n0) ** 2
                if n > n0 and predicted > PREDICTION_MARGIN * self.cap:
                    res[name] = f"skipped (about {predicted:.0f} s predicted from N = {n0:g})"
                    continue
            if not self.priming and key in self.primed and n is not None and n >= BIG_N and self.repeats > 0:
                # warmed up at a small N (prime): this call (seconds long) is the first timed one, started only
                # if its N^2 extrapolation from the warm-up fits the time left (a killed call loses the row)
                n0, t0 = self.primed[key]
                predicted = t0 * (n / n0) ** 2
                if self.left() is not None and predicted > self.left():
                    res[name] = f"skipped (about {predicted:.0f} s predicted from N = {n0:g}; {self.left():.0f} s left)"
                    continue
                t, out = self._first_call(fn, name)
                if t is None:
                    res[name] = out
                else:
                    timed_first[name] = t
                    live.append(name)
                continue
            t, out = self._first_call(fn, name)  # warm-up (compilation, autotuning, allocator)
            if self.priming and t is not None:
                self.primed[key] = (n, t)
            if t is None:
                res[name] = out
            elif t > self.cap:
                res[name] = f"over cap ({t:.0f} s)"
                self.too_slow.add(key)
            else:
                live.append(name)
        times = {k: [timed_first[k]] if k in timed_first else [] for k in live}
        for r in range(self.repeats):
            for name in live[r % max(1, len(live)):] + live[:r % max(1, len(live))]:
                if name in res or len(times[name]) >= self.repeats:
                    continue
                t, out = self._call(fns[name])
                if t is None:
                    res[name] = out
                else:
                    times[name].append(t)
        for name in live:
            if name not in res:
                res[name] = statistics.median(times[name])
                if n is not None:
                    self.history[(context, name)] = (n, res[name])
                    if self.priming:
                        self.primed[(context, name)] = (n, res[name])
        return res


def fmt(x):
    if isinstance(x, str):
        return x
    if x is None:
        return "-"
    if x >= 1:
        return f"{x:.2f} s"
    return f"{x * 1e3:.3g} ms"


def ratio(peer, ours):
    if isinstance(peer, float) and isinstance(ours, float) and ours > 0:
        return f"{peer / ours:.2f}x"
    return "-"


def best(res: dict, names):
    vals = [(res[n], n) for n in names if isinstance(res.get(n), float)]
    return min(vals) if vals else (None, None)


# ---------------------------------------------------------------------- attention inputs and peers
def attention_inputs(n, d, mask, device, dtype=torch.float32, seed=0, grad=False):
    """Self-attention inputs q = X A^T, k = X, v = X V^T (as tensors of their own), log-weights, positions."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    A = torch.randn(d, d, generator=g, dtype=torch.float64) / d
    V = torch.randn(d, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    q, k, v = (t.to(device=device, dtype=dtype).contiguous() for t in (X @ A.T, X, X @ V.T))
    if grad:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    lw = qp = kp = None
    if mask in ("weighted", "weighted causal"):
        lw = torch.log_softmax(torch.randn(n, generator=g, dtype=torch.float64), 0).to(device=device, dtype=dtype)
    if mask in ("causal", "weighted causal"):
        qp = kp = torch.arange(n, dtype=dtype, device=device)
    if mask == "positions":
        qp = torch.rand(n, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        kp = torch.rand(n, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    return q, k, v, lw, qp, kp


def _pad8(t):
    w = -(-t.shape[-1] // 8) * 8
    return t if t.shape[-1] == w else F.pad(t, (0, w - t.shape[-1]))


def sdpa_padded(q, k, v, lw, qp, kp, pad=True):
    """torch's SDPA, heads zero-padded to a multiple of 8 (the peer); log-weights as a mask row, or with the
    causal mask as an extra coordinate; arbitrary positions as an explicit (m, n) boolean mask."""
    c = v.shape[-1]
    causal = qp is not None and bool((qp == kp).all())
    mask = None
    if lw is not None and causal:
        q = torch.cat([q, torch.ones_like(q[:, :1])], -1)
        k = torch.cat([k, lw.unsqueeze(-1)], -1)
    elif lw is not None:
        mask = lw[None, None, None, :]
    if qp is not None and not causal:
        vis = kp[None, :] <= qp[:, None]
        mask = vis[None, None] if mask is None else mask.masked_fill(~vis[None, None], -math.inf)
    w = max(q.shape[-1], c)
    fit = lambda t: F.pad(t, (0, w - t.shape[-1])) if t.shape[-1] < w else t
    Q, K, Vv = (fit(t)[None, None] for t in (q, k, v))
    if pad:
        Q, K, Vv = _pad8(Q), _pad8(K), _pad8(Vv)
    return F.scaled_dot_product_attention(Q, K, Vv, attn_mask=mask, is_causal=causal, scale=1.0)[0, 0, :, :c]


def chunked(q, k, v, lw, qp, kp, rows=CHUNK_ROWS):
    """Rows in chunks against all keys, five lines of torch (the peer)."""
    out = []
    kT = k.T
    for i in range(0, q.shape[0], rows):
        s = q[i:i + rows] @ kT
        if lw is not None:
            s = s + lw
        if qp is not None:
            s = s.masked_fill(kp[None, :] > qp[i:i + rows, None], -math.inf)
        out.append(torch.softmax(s, -1).nan_to_num_(0.0) @ v)
    return torch.cat(out)


def naive(q, k, v, lw, qp, kp):
    s = q @ k.T
    if lw is not None:
        s = s + lw
    if qp is not None:
        s = s.masked_fill(kp[None, :] > qp[:, None], -math.inf)
    return torch.softmax(s, -1) @ v


def dense_fits(n, device, dtype=torch.float32, temporaries=3):
    if device.type != "cuda":
        return n <= 4096
    return temporaries * n * n * torch.empty((), dtype=dtype).element_size() < 0.8 * torch.cuda.mem_get_info()[0]


# ---------------------------------------------------------------------- sections
def forward_rows(b, n, d, mask, with_stream=False, with_dense=True):
    args = attention_inputs(n, d, mask, b.device)
    fns = {"ours (auto)": lambda: attend(*args)}
    if with_stream:
        fns["ours (stream)"] = lambda: attend(*args, method="stream")
    fns["SDPA padded"] = lambda: sdpa_padded(*args)
    fns["chunked dense"] = lambda: chunked(*args)
    fns["naive dense"] = (lambda: naive(*args)) if with_dense and dense_fits(n, b.device) else None
    res = b.time(fns, n, f"forward {d} {mask}")
    with torch.no_grad():
        res["info"] = {"auto's path": choose(*args), "auto's peak GiB": b.peaks.get("ours (auto)")}
    return res


#: calls per loop of the "fixed" section's throughput candidates (synchronized once, after the loop)
LOOP = 20

#: CUDA runtime calls that block the host until the device is done (one per host sync)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def runtime_calls(b, fn) -> dict:
    """The CUDA runtime calls of one call of ``fn`` (torch.profiler): kernel launches, host syncs and the
    other runtime calls by name (a driver memory query shows as cudaMemGetInfo); {} off CUDA."""
    if b.device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    b.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    launches = syncs = 0
    other = {}
    for ev in prof.key_averages():
        name = ev.key
        if not name.startswith(("cuda", "cu")) or name.startswith("cudnn"):
            continue
        if "LaunchKernel" in name:
            launches += ev.count
        elif name in SYNC_CALLS:
            syncs += ev.count
        else:
            other[name] = other.get(name, 0) + ev.count
    return {"launches": launches, "syncs": syncs,
            "other runtime calls": ", ".join(f"{k} x{v}" for k, v in sorted(other.items())) or "none"}


def fixed_rows(b, n, d, mask):
    """What a call costs besides its arithmetic (goal 2 below 1e5, goal 6 at 1e4): one synchronized call (also with
    the output check deferred: what its host sync costs a single call), and per call in a loop of LOOP calls
    synchronized once (the regime of simulate's and Lanczos's loops, where a
    host sync inside a call stops the host from queueing the next one), ours (auto) against naive dense; the
    kernel launches and host syncs of each."""
    args = attention_inputs(n, d, mask, b.device)
    ours, peer = (lambda: attend(*args)), (lambda: naive(*args))

    def loop(fn):
        def run():
            for _ in range(LOOP):
                out = fn()
            return out
        return run

    def unchecked():
        # the same call inside particles.validation.output_checks_deferred (no finiteness check, so no host
        # sync for it): what the check costs, not a candidate for the goal
        with output_checks_deferred():
            return attend(*args)

    fns = {"ours (auto)": ours, "naive dense": peer if dense_fits(n, b.device) else None,
           "ours, output check deferred": unchecked,
           f"ours (auto), per call in a loop of {LOOP}": loop(ours),
           f"ours, output check deferred, per call in a loop of {LOOP}": loop(unchecked),
           f"naive dense, per call in a loop of {LOOP}": loop(peer) if dense_fits(n, b.device) else None}
    res = b.time(fns, n, f"fixed {d} {mask}")
    for name in list(res):
        if name.endswith(f"loop of {LOOP}") and isinstance(res[name], float):
            res[name] /= LOOP
    with torch.no_grad():
        info = {"auto's path": choose(*args)}
        for who, fn in (("ours", ours), ("naive", peer if dense_fits(n, b.device) else None)):
            if fn is not None:
                info.update({f"{who} {k}": v for k, v in runtime_calls(b, fn).items()})
    res["info"] = info
    return res


def vjp_fixed_rows(b, n, d=3):
    """The same for the VJP of a recorded graph (the streamed kernel: tiles sized by the device's budget)."""
    q, k, v, lw, qp, kp = attention_inputs(n, d, "none", b.device, grad=True)
    g = torch.randn(n, v.shape[-1], device=b.device, dtype=q.dtype)
    ours_out, peer_out = attend(q, k, v), sdpa_padded(q, k, v, None, None, None)
    ours = lambda: torch.autograd.grad(ours_out, (q, k, v), g, retain_graph=True)
    peer = lambda: torch.autograd.grad(peer_out, (q, k, v), g, retain_graph=True)
    res = b.time({"ours (VJP)": ours, "SDPA backward": peer}, n, f"fixed vjp {d}")
    info = {}
    for who, fn in (("ours", ours), ("SDPA", peer)):
        info.update({f"{who} {k}": v for k, v in runtime_calls(b, fn).items()})
    res["info"] = info
    return res


def _engines(b):
    """The streamed kernel's engines to time side by side (derivatives section): which is faster where
    decides meanfield.accelerator_paths.TRITON_MAX_WIDTH."""
    from particles.device import triton_runs

    return ["tiles"] + (["triton"] if triton_runs(b.device.type) else [])


def vjp_rows(b, n, d, mask, engines=()):
    """VJP (backward only, on a recorded graph) and JVP (forward-mode, forward + tangent) of ours (auto, and
    each engine of ``engines`` forced) against SDPA's backward and dense forward-mode AD."""
    q, k, v, lw, qp, kp = attention_inputs(n, d, mask, b.device, grad=True)
    g = torch.randn(n, v.shape[-1], device=b.device, dtype=q.dtype)

    def graph(f):
        try:
            return f(q, k, v, lw, qp, kp)
        except Exception as exc:  # out of memory, or a path that fails: reported as not timed
            print(f"vjp_rows: {type(exc).__name__}: {exc}", file=sys.stderr)
            return None

    fns = {}
    paths = [("ours (VJP)", lambda *a: attend(*a)), ("SDPA backward", sdpa_padded)]
    paths += [(f"ours (VJP, {e} engine)", lambda *a, e=e: streaming.stream_attend(*a, engine=e)) for e in engines]
    for name, f in paths:
        out = graph(f)
        fns[name] = None if out is None else (lambda out=out: torch.autograd.grad(out, (q, k, v), g,
                                                                                   retain_graph=True))
    res = b.time(fns, n, f"vjp {d} {mask}")
    del fns
    # forward-mode: ours against dense forward-mode AD (torch.func.jvp of the naive kernel)
    tans = [torch.randn_like(t) for t in (q, k, v)]
    qd, kd, vd = (t.detach() for t in (q, k, v))

    def ours_jvp(engine=None):
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(p, t) for p, t in zip((qd, kd, vd), tans)]
            if engine is None:
                return forward_ad.unpack_dual(attend(*duals, lw, qp, kp)).tangent
            return forward_ad.unpack_dual(streaming.stream_attend(*duals, lw, qp, kp, engine=engine)).tangent

    dense_jvp = (lambda: torch.func.jvp(lambda a, bb, c: naive(a, bb, c, lw, qp, kp), (qd, kd, vd), tuple(tans))[1])
    fns = {"ours (JVP)": ours_jvp,
           "dense forward-mode AD": dense_jvp if dense_fits(n, b.device, temporaries=6) else None}
    fns.update({f"ours (JVP, {e} engine)": (lambda e=e: ours_jvp(e)) for e in engines})
    res.update(b.time(fns, n, f"jvp {d} {mask}"))
    return res


def _without(module_name, fn):
    """``fn()`` with ``transport.<module_name>.ENABLED`` off: the solver before that module's change (kernel
    truncation, the coarse annealing)."""
    import importlib

    module = importlib.import_module(f"transport.{module_name}")
    module.ENABLED = False
    try:
        return fn()
    finally:
        module.ENABLED = True


def sinkhorn_problem(n, device):
    """(X, Y, reg) of the Sinkhorn rows: uniform clouds in the unit cube and its translate by 0.1, d = 3, float32;
    reg = 2 blur^2 (GeomLoss's p = 2 cost is |x - y|^2 / 2 with eps = blur^2)."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(n, 3, generator=g, dtype=torch.float64).to(device, torch.float32)
    Y = (torch.rand(n, 3, generator=g, dtype=torch.float64) + 0.1).to(device, torch.float32)
    return X, Y, 2 * BLUR**2


def sinkhorn_rows(b, n, with_peers=True):
    X, Y, reg = sinkhorn_problem(n, b.device)
    iters = 30 if b.smoke else None  # the smoke run checks the code path, not the convergence
    solve = lambda **kw: w2(Measure(X), Measure(Y), "streaming", reg=reg, squared=True, debias=True,
                            tol=SINKHORN_TOL, max_iter=iters, on_failure="warn", **kw)
    fns = {"ours (streaming)": solve,
           # the same solver with plain Sinkhorn steps (before over-relaxation): what the change gained here
           "ours, plain steps": lambda: solve(overrelaxation=1.0),
           # ... without the kernel truncation of the last eps (dense passes throughout)
           "ours, untruncated": lambda: _without("truncation", solve),
           # ... and with every annealing level on the points (no coarse start on cluster centres)
           "ours, fine annealing": lambda: _without("multiscale", solve)}
    try:
        from geomloss import SamplesLoss

        loss = SamplesLoss("sinkhorn", p=2, blur=BLUR, scaling=0.5, debias=True, backend="tensorized")
        fits = dense_fits(n, b.device, temporaries=4)
        fns["GeomLoss tensorized"] = (lambda: 2 * float(loss(X, Y))) if with_peers and fits else None
    except ImportError:
        fns["GeomLoss tensorized"] = None
    try:
        import ot

        def pot():
            M = torch.cdist(X, Y) ** 2
            a = torch.full((n,), 1.0 / n, device=b.device, dtype=X.dtype)
            P = ot.bregman.sinkhorn_log(a, a, M, reg, numItermax=iters or 10_000, stopThr=SINKHORN_TOL,
                                        warn=False)
            return float((P * M).sum())

        fns["POT sinkhorn_log dense (not debiased)"] = pot if with_peers and dense_fits(n, b.device, temporaries=4) \
            else None
    except ImportError:
        fns["POT sinkhorn_log dense (not debiased)"] = None
    return b.time(fns, n, "sinkhorn")


def dynamics_rows(b, n, d=3, steps=10, T=1.0):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(n, d, generator=g, dtype=torch.float64).to(b.device, torch.float32)
    A = (torch.randn(d, d, generator=g, dtype=torch.float64) / d).to(b.device, torch.float32)
    V = (torch.randn(d, d, generator=g, dtype=torch.float64) / math.sqrt(d)).to(b.device, torch.float32)
    op = SelfAttention(A, V)
    mu = Measure(X)
    h = T / steps

    def rk4(pad):
        def field(Y):
            return sdpa_padded(Y @ A.T, Y, Y @ V.T, None, None, None, pad=pad)

        Y = X
        for _ in range(steps):
            k1 = field(Y)
            k2 = field(Y + h / 2 * k1)
            k3 = field(Y + h / 2 * k2)
            k4 = field(Y + h * k3)
            Y = Y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return Y

    ours = lambda: simulate(op, mu, [0.0, T], method="rk4", options={"steps": steps}).final
    return b.time({"ours (simulate rk4)": ours,
                   "RK4 loop on SDPA": lambda: rk4(False), "RK4 loop on SDPA padded": lambda: rk4(True)},
                  n, f"dynamics {d}")


class Stopped(BaseException):
    """A call stopped between two Jacobian products because the next would not fit the run's time (a BaseException:
    :meth:`Bench._call` turns every Exception into an error row)."""


@contextlib.contextmanager
def product_clock(device, clock=None, stop=None):
    """Count and time (synchronized) the Jacobian products of :mod:`meanfield.jacobian` by dtype, and its graph
    recordings, into ``clock``: {"float32 products": [count, seconds], ...}. What the lipschitz rows break their
    time into (the float32 phase of the mixed Lanczos against the float64 certificate). ``stop(seconds)``, asked
    after each product or recording with the longest of them so far (the next call may be of another kind: the
    first float64 J u after the float64 recording, which records the double-backward graph, took 33.9 s at N = 1e6
    after 7.5 s), raises :class:`Stopped` when true (the next would not fit)."""
    from meanfield import jacobian

    clock = {} if clock is None else clock
    longest = [0.0]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def timed(what, fn):
        def run(self, *a, **kw):
            sync()
            t0 = time.perf_counter()
            try:
                out = fn(self, *a, **kw)
            finally:
                sync()
                seconds = time.perf_counter() - t0
                key = f"{str(self.X.dtype).replace('torch.', '')} {what}"
                entry = clock.setdefault(key, [0, 0.0])
                entry[0] += 1
                entry[1] += seconds
                if seconds > 1:   # a call of minutes says how far it got (what a killed run leaves behind)
                    print(f"  {key}: {entry[0]} in {entry[1]:.1f} s (the last {seconds:.2f} s)", file=sys.stderr,
                          flush=True)
            longest[0] = max(longest[0], seconds)
            if stop is not None and stop(longest[0]):
                raise Stopped
            return out
        return run

    saved = jacobian.Jacobian._product, jacobian.Jacobian._record
    jacobian.Jacobian._product = timed("products", saved[0])
    jacobian.Jacobian._record = timed("graph recordings", saved[1])
    try:
        yield clock
    finally:
        jacobian.Jacobian._product, jacobian.Jacobian._record = saved


def clock_info(clock) -> dict:
    return {k: f"{c} in {fmt(t)}" for k, (c, t) in sorted(clock.items())}


def lipschitz_measure(b, n, device, d=3, dtype=torch.float64, clock=None, stop=None):
    g = torch.Generator().manual_seed(n)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    V = torch.randn(d, d, generator=g, dtype=torch.float64)
    mu = Measure(X.to(device, dtype), (w / w.sum()).to(device, dtype))
    op = SelfAttention(A.to(device, dtype), V.to(device, dtype))
    b_ = Bench(device, 1, b.cap, b.smoke)
    with product_clock(device, clock, stop) as clock:
        t, est = b_._call(lambda: local_lipschitz(op, mu, tol=1e-6, on_failure="warn"))
    return t, est, clock


def gpt2_rows(b, n):
    try:
        from meanfield.hf import attention_function
        from studies.models import random_model
    except ImportError:
        return {"info": {"note": "transformers not installed"}}
    try:
        model = random_model("gpt2", size="tiny" if b.smoke else "full", dtype=torch.float32, device=b.device)
    except ImportError:
        return {"info": {"note": "transformers not installed"}}
    except Exception as exc:  # a transformers version that builds no GPT-2 here: say so, measure the rest
        return {"info": {"note": f"GPT-2 not built: {type(exc).__name__}: {exc}"[:200]}}
    f = attention_function(model, 0)
    D = model.config.n_embd
    X = torch.randn(n, D, generator=torch.Generator().manual_seed(n), dtype=torch.float32).to(b.device)
    runs = {}
    fns = {"ours (lanczos)": lambda: runs.__setitem__("ours", local_lipschitz(f, X, tol=1e-6, on_failure="warn")),
           "power iteration": lambda: runs.__setitem__("power", local_lipschitz(f, X, method="power", tol=1e-6,
                                                                                 max_iter=50 if b.smoke else 5000,
                                                                                 on_failure="warn"))}
    res = b.time(fns)
    info = res["info"] = {}
    for key in ("ours", "power"):
        if key in runs:
            info[f"{key} products"] = runs[key].applications
            info[f"{key} value"] = runs[key].value
            info[f"{key} converged"] = runs[key].converged
    if "ours" in runs and b.device.type == "cuda":
        # float32 products on the CPU may stall the certificate above tol (it says so): the value is compared
        cpu = local_lipschitz(attention_function(model.cpu(), 0), X.cpu(), tol=1e-6, on_failure="warn")
        info["CPU value"], info["CPU converged"] = cpu.value, cpu.converged
        model.to(b.device)
    return res


# ---------------------------------------------------------------------- the sections as tables
def section_table(b, quick):
    s = (lambda n: min(n, 40)) if b.smoke else (lambda n: n)
    for n in ([10**5] if quick else [10**5, 10**6]):
        r = forward_rows(b, s(n), 3, "none", with_dense=False)
        yield ("attention forward, d = 3, auto", s(n), r, "ours (auto)", ["SDPA padded"])
    r = forward_rows(b, s(10**5), 3, "weighted", with_dense=False)
    yield ("attention forward, d = 3, weighted, auto", s(10**5), r, "ours (auto)", ["SDPA padded"])
    for n in (10**4, 10**5):
        r = forward_rows(b, s(n), 3, "weighted", with_stream=True, with_dense=False)
        yield ("attention forward, d = 3, weighted, method='stream'", s(n), r, "ours (stream)",
                     ["SDPA padded", "chunked dense"])
    for n in (10**4, 10**5):
        r = forward_rows(b, s(n), 64, "none", with_stream=True, with_dense=False)
        yield [("attention forward, d = 64, method='stream'", s(n), r, "ours (stream)", ["SDPA padded"]),
               ("attention forward, d = 64, auto", s(n), r, "ours (auto)", ["SDPA padded"])]
    for d in (3, 64):
        r = forward_rows(b, s(1000), d, "none")
        yield (f"attention forward, auto, d = {d}", s(1000), r, "ours (auto)", ["naive dense", "SDPA padded"])
    for n in (10**4, 10**5):
        r = vjp_rows(b, s(n), 64, "none")
        yield [("VJP (backward), d = 64", s(n), r, "ours (VJP)", ["SDPA backward"]),
               ("JVP (forward + tangent), d = 64", s(n), r, "ours (JVP)", ["dense forward-mode AD", "SDPA backward"])]
    for n in (10**4, 3 * 10**4, 10**5, 2 * 10**5):
        if quick and n > 10**5:
            continue
        r = sinkhorn_rows(b, s(n), with_peers=n <= 3 * 10**4)
        yield (f"Sinkhorn, d = 3, blur {BLUR}, debiased, tol {SINKHORN_TOL:g}", s(n), r, "ours (streaming)",
                     ["GeomLoss tensorized", "POT sinkhorn_log dense (not debiased)"])
    for n in (10**4, 10**5):
        r = dynamics_rows(b, s(n))
        yield ("simulate, rk4, 10 steps, d = 3", s(n), r, "ours (simulate rk4)",
                     ["RK4 loop on SDPA", "RK4 loop on SDPA padded"])
    for n in (64, 256, 1024):
        r = gpt2_rows(b, 8 if b.smoke else n)
        yield ("certified Lipschitz, GPT-2-sized layer (HF, float32)", n, r, "ours (lanczos)",
                     ["power iteration"])


#: head sizes of the grid and derivatives sections (--dims)
DIMS = [3, 64]
#: sizes to run (--sizes; empty: every size of a section, those above 1e5 only without --quick)
SIZES = []
#: RK4 steps of the dynamics section (--steps)
STEPS = [10]
#: the masks the attention sections run (--masks), in this order
MASKS = ["none", "weighted", "causal", "positions"]


def masks(order=("none", "weighted", "causal", "positions")):
    """The masks of ``order`` that --masks keeps."""
    return [m for m in order if m in MASKS]


def pick(sizes, quick, quick_max=10**5):
    """The sizes of a section to run: those of --sizes among ``sizes`` when given, else ``sizes`` (without those
    above ``quick_max`` under --quick)."""
    if SIZES:
        return [n for n in sizes if n in SIZES]
    return [n for n in sizes if not (quick and n > quick_max)]


def section_grid(b, quick):
    sizes = [24, 40] if b.smoke else pick([10**3, 10**4, 10**5, 10**6], quick)
    for d in [x for x in (3, 64) if x in DIMS]:
        for mask in masks():
            for n in sizes:
                if n >= BIG_N:
                    b.prime(forward_rows, b, PRIME_N, d, mask)
                r = forward_rows(b, n, d, mask)
                yield (f"forward, d = {d}, {mask}", n, r, "ours (auto)",
                             ["SDPA padded", "chunked dense", "naive dense"])


def section_derivatives(b, quick):
    sizes = [24, 40] if b.smoke else pick([10**4, 10**5, 10**6], quick)
    for d in [x for x in (64, 3) if x in DIMS]:
        for mask in masks():
            for n in sizes:
                if n >= BIG_N:
                    # ours against SDPA's backward only: each call takes seconds here
                    b.prime(vjp_rows, b, PRIME_N, d, mask)
                r = vjp_rows(b, n, d, mask, engines=_engines(b) if n < BIG_N else ())
                yield [(f"VJP, d = {d}, {mask}", n, r, "ours (VJP)", ["SDPA backward"]),
                       (f"JVP, d = {d}, {mask}", n, r, "ours (JVP)", ["SDPA backward"])]


def section_lipschitz(b, quick):
    small = 24 if b.smoke else 10**4
    if small in pick([small], quick):
        t_gpu, est_gpu, _ = lipschitz_measure(b, small, b.device)
        t_cpu, est_cpu, _ = lipschitz_measure(b, small, torch.device("cpu"))
        info = {}
        if not isinstance(est_gpu, str) and not isinstance(est_cpu, str):
            info = {"GPU value": est_gpu.value, "CPU value": est_cpu.value,
                    "relative difference": abs(est_gpu.value - est_cpu.value) / est_cpu.value,
                    "certified rel. error (GPU)": est_gpu.error / est_gpu.value}
        yield ("certified mean-field Lipschitz, SelfAttention, d = 3, float64 (GPU vs CPU)", small,
               {"ours (GPU)": t_gpu if t_gpu is not None else OOM, "CPU": t_cpu if t_cpu is not None else OOM,
                "info": info}, "ours (GPU)", ["CPU"])
    last = None
    what = "certified mean-field Lipschitz, SelfAttention, d = 3, float64"
    sizes = [40] if b.smoke else pick([10**5, 3 * 10**5, 10**6], quick)
    if sizes:
        lipschitz_measure(b, 24 if b.smoke else 10**4, b.device)   # untimed: CUDA's start, compilation
    for n in sizes:
        if last is not None and b.left() is not None:
            # one call of minutes: started only if the N^2 extrapolation from the last size fits the time left
            predicted = last[1] * (n / last[0]) ** 2
            if predicted > b.left() - 10:
                yield (what, n, {"ours (GPU)": f"skipped (about {predicted:.0f} s predicted from N = {last[0]:g}; "
                                               f"{b.left():.0f} s left)"}, "ours (GPU)", [])
                continue
        # a call of minutes stops between two products once the next would not fit the time left, and its row says
        # how far it got (the products so far, each kind's time), where a run killed from outside leaves nothing
        clock, t0 = {}, time.perf_counter()
        try:
            t, est, clock = lipschitz_measure(b, n, b.device, clock=clock,
                                              stop=lambda s: b.left() is not None and b.left() < 1.5 * s + 2)
        except Stopped:
            yield (what, n, {"ours (GPU)": f"stopped after {time.perf_counter() - t0:.0f} s (the next product would "
                                           f"not fit the time left)", "info": clock_info(clock)}, "ours (GPU)", [])
            return
        r = {"ours (GPU)": t if t is not None else est}   # (est: the error's text when the call failed)
        if not isinstance(est, str):
            r["info"] = {"value": est.value, "certified rel. error": est.error / est.value,
                         "converged": est.converged, "products": est.applications, **clock_info(clock)}
            last = (n, t)
        yield (what, n, r, "ours (GPU)", [])


def section_sinkhorn(b, quick):
    sizes = [24, 40] if b.smoke else pick([10**4, 2 * 10**4, 10**5, 10**6], quick)
    for n in sizes:
        r = sinkhorn_rows(b, n, with_peers=n <= 2 * 10**4 or b.smoke)
        yield (f"Sinkhorn, d = 3, blur {BLUR}, debiased, tol {SINKHORN_TOL:g}", n, r, "ours (streaming)",
                     ["GeomLoss tensorized"])


def section_dynamics(b, quick):
    # 1e4: goal 6's small calls (0.37x on 2026-11-26, before the small-head kernels took d = 3 above the dense path)
    sizes = [24, 40] if b.smoke else pick([10**4, 10**5, 10**6], quick)
    steps = STEPS[0]
    for n in sizes:
        if n >= BIG_N:
            b.prime(dynamics_rows, b, PRIME_N, steps=1)
        yield (f"simulate, rk4, {steps} steps, d = 3", n, dynamics_rows(b, n, steps=steps), "ours (simulate rk4)",
               ["RK4 loop on SDPA padded"])


def section_fixed(b, quick):
    sizes = [24, 40] if b.smoke else pick([10**3, 10**4], quick)
    for mask in masks():
        for n in sizes:
            yield (f"fixed cost, forward, d = 3, {mask}", n, fixed_rows(b, n, 3, mask), "ours (auto)",
                   ["naive dense"])
    for n in [40] if b.smoke else pick([10**4], quick):
        yield ("fixed cost, VJP, d = 3", n, vjp_fixed_rows(b, n), "ours (VJP)", ["SDPA backward"])


def _rel(got, ref):
    """Max |got - ref| over max |ref| (both moved to float64 on the CPU), or the error text."""
    if isinstance(got, str) or isinstance(ref, str):
        return got if isinstance(got, str) else ref
    got, ref = (torch.as_tensor(t).double().cpu() for t in (got, ref))
    return (got - ref).abs().max().item() / max(1e-300, ref.abs().max().item())


def wide_rows(b, n, mask, d=64, engines=("tiles", "triton")):
    """A wide head in float32: the streamed kernel's engines forced side by side (tiles: cuBLAS products per
    row block; triton: one launch per pass, float32 products in three TF32 passes) with SDPA, for the forward
    pass, the VJP (on a recorded graph) and the JVP (forward + tangent); at N <= 1e4 each engine's relative
    error against the same call in float64 (tile loops). Which is faster decides
    meanfield.accelerator_paths.TRITON_MAX_WIDTH."""
    args = attention_inputs(n, d, mask, b.device)
    q, k, v, lw, qp, kp = args
    g = torch.randn(n, v.shape[-1], device=b.device, dtype=q.dtype, generator=torch.Generator(b.device).manual_seed(2))
    tans = [torch.randn(t.shape, device=b.device, dtype=t.dtype, generator=torch.Generator(b.device).manual_seed(3 + i))
            for i, t in enumerate((q, k, v))]
    run = lambda e, *a: streaming.stream_attend(*a, engine=e)

    def jvp(e, args=args, tans=tans):
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(p, t) for p, t in zip(args[:3], tans)]
            return forward_ad.unpack_dual(run(e, *duals, *args[3:])).tangent

    def graph(e, args=args):
        prim = [t.detach().clone().requires_grad_(True) for t in args[:3]]
        return prim, run(e, *prim, *args[3:])

    res_f = b.time({**{f"{e} engine": (lambda e=e: run(e, *args)) for e in engines},
                    "SDPA padded": lambda: sdpa_padded(*args)}, n, f"wide forward {d} {mask}")
    graphs = {e: graph(e) for e in engines}
    prim_s = [t.detach().clone().requires_grad_(True) for t in args[:3]]
    out_s = sdpa_padded(*prim_s, *args[3:])
    vjp = lambda prim, out: torch.autograd.grad(out, prim, g, retain_graph=True)
    res_v = b.time({**{f"{e} engine": (lambda e=e: vjp(*graphs[e])) for e in engines},
                    "SDPA backward": lambda: vjp(prim_s, out_s)}, n, f"wide vjp {d} {mask}")
    res_j = b.time({f"{e} engine": (lambda e=e: jvp(e)) for e in engines}, n, f"wide jvp {d} {mask}")
    res_j["SDPA backward"] = res_v["SDPA backward"]
    if n <= 10**4:
        a64 = tuple(None if t is None else t.double() for t in args)
        t64 = [t.double() for t in tans]
        ref_f = run("tiles", *a64)
        ref_j = jvp("tiles", a64, t64)
        p64, o64 = graph("tiles", a64)
        ref_v = torch.autograd.grad(o64, p64, g.double())
        for e in engines:
            for res, got, ref in ((res_f, lambda e=e: run(e, *args), ref_f), (res_j, lambda e=e: jvp(e), ref_j),
                                  (res_v, lambda e=e: vjp(*graphs[e]), ref_v)):
                try:
                    out = got()
                    err = max(_rel(a, r) for a, r in zip(out, ref)) if isinstance(out, tuple) else _rel(out, ref)
                except Exception as exc:  # noqa: BLE001 - a failing engine is a result
                    err = f"error: {type(exc).__name__}"
                res.setdefault("info", {})[f"{e} rel. error"] = err
    return res_f, res_v, res_j


def section_wide(b, quick):
    sizes = [24, 40] if b.smoke else pick([10**4, 10**5], quick)
    engines = ["tiles"] + (["triton"] if "triton" in _engines(b) else [])
    for mask in masks(("none", "positions", "causal", "weighted")):
        for n in sizes:
            f, v, j = wide_rows(b, n, mask, engines=engines)
            yield [(f"{what}, d = 64, {mask}, by engine", n, r, f"{engines[-1]} engine",
                    [peer, "tiles engine"] if engines[-1] != "tiles" else [peer])
                   for what, r, peer in (("forward", f, "SDPA padded"), ("VJP", v, "SDPA backward"),
                                         ("JVP", j, "SDPA backward"))]


@contextlib.contextmanager
def small_kernels(on: bool):
    """The Triton kernels of heads of up to 3 features: the small heads' FMA kernels (on) or the matrix-product ones."""
    from meanfield import accelerator_paths

    saved = accelerator_paths.SMALL_HEAD_FEATURES
    accelerator_paths.SMALL_HEAD_FEATURES = saved if on else None
    try:
        yield
    finally:
        accelerator_paths.SMALL_HEAD_FEATURES = saved


def small_rows(b, n, mask, d=3):
    """The Triton kernels themselves at d = 3 in float32 (meanfield.triton_attention's forward, JVP and VJP on
    (1, N, 3) inputs): the small heads' FMA kernels against the matrix-product kernels (the head padded to
    Triton's smallest product) and SDPA with the head padded to 8 (its forward; its backward for the VJP and
    the JVP); at N <= 1e4 each kernel's relative error against the float64 kernels. Which is faster decides
    meanfield.accelerator_paths.SMALL_HEAD_FEATURES (and whether small heads should leave SDPA for Triton)."""
    from meanfield import triton_attention as ta

    q, k, v, lw, qp, kp = attention_inputs(n, d, mask, b.device)
    causal = mask == "causal"
    three = [None if t is None else t.unsqueeze(0) for t in (q, k, v, lw, qp, kp)]
    gen = torch.Generator(b.device)
    g = torch.randn(three[2].shape, device=b.device, dtype=q.dtype, generator=gen.manual_seed(2))
    tans = [torch.randn(t.shape, device=b.device, dtype=t.dtype, generator=gen.manual_seed(3 + i))
            for i, t in enumerate(three[:3])]
    kinds = {"small-head kernels": True, "matrix-product kernels": False}

    def fwd(on, a=three):
        with small_kernels(on):
            return ta.forward(*a, causal)

    saved = {kind: fwd(on) for kind, on in kinds.items()}

    def jvp(on, a=three, t=tans, kind=None):
        out, lse = saved[kind] if kind else fwd(on, a)
        with small_kernels(on):
            return ta.jvp(*a, causal, out, lse, *t, None)[0]

    def vjp(on, a=three, gg=g, kind=None):
        out, lse = saved[kind] if kind else fwd(on, a)
        with small_kernels(on):
            return ta.backward(*a, causal, out, lse, gg, None, (True, True, True, False))[:3]

    prim_s = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out_s = sdpa_padded(*prim_s, lw, qp, kp) if mask != "positions" else None
    sdpa_bwd = (lambda: torch.autograd.grad(out_s, prim_s, g[0], retain_graph=True)) if out_s is not None else None
    res_f = b.time({**{kind: (lambda on=on: fwd(on)) for kind, on in kinds.items()},
                    # (with arbitrary positions SDPA needs an (N, N) mask: not a peer at this scale)
                    "SDPA padded": (lambda: sdpa_padded(q, k, v, lw, qp, kp)) if out_s is not None else None},
                   n, f"small forward {d} {mask}")
    res_j = b.time({**{kind: (lambda on=on, kind=kind: jvp(on, kind=kind)) for kind, on in kinds.items()},
                    "SDPA backward": sdpa_bwd}, n, f"small jvp {d} {mask}")
    res_v = b.time({**{kind: (lambda on=on, kind=kind: vjp(on, kind=kind)) for kind, on in kinds.items()},
                    "SDPA backward": sdpa_bwd}, n, f"small vjp {d} {mask}")
    if n <= 10**4:
        a64 = [None if t is None else t.double() for t in three]
        t64, g64 = [t.double() for t in tans], g.double()
        ref_f = fwd(False, a64)[0]
        ref_j = jvp(False, a64, t64)
        ref_v = vjp(False, a64, g64)
        for kind, on in kinds.items():
            res_f.setdefault("info", {})[f"{kind} rel. error"] = _rel(saved[kind][0], ref_f)
            res_j.setdefault("info", {})[f"{kind} rel. error"] = _rel(jvp(on, kind=kind), ref_j)
            res_v.setdefault("info", {})[f"{kind} rel. error"] = max(_rel(a, r) for a, r in zip(vjp(on, kind=kind),
                                                                                                ref_v))
    return res_f, res_j, res_v


def section_small(b, quick):
    from particles.device import triton_runs

    if not triton_runs(b.device.type):   # no CUDA Triton (or, on CPU, no TRITON_INTERPRET=1): no rows
        return
    sizes = [24, 40] if b.smoke else pick([10**4, 10**5, 10**6], quick)
    for mask in masks(("none", "positions", "causal", "weighted")):
        for n in sizes:
            f, j, v = small_rows(b, n, mask)
            yield [(f"{what}, d = 3, {mask}, Triton kernels", n, r, "small-head kernels",
                    ["matrix-product kernels"] + ([peer] if r.get(peer) is not None else []))
                   for what, r, peer in (("forward", f, "SDPA padded"), ("JVP", j, "SDPA backward"),
                                         ("VJP", v, "SDPA backward"))]


RUNNERS = {"table": section_table, "grid": section_grid, "derivatives": section_derivatives,
           "lipschitz": section_lipschitz, "sinkhorn": section_sinkhorn, "dynamics": section_dynamics,
           "fixed": section_fixed, "wide": section_wide, "small": section_small}


# ---------------------------------------------------------------------- output
def environment(device) -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "date": datetime.datetime.now().isoformat(timespec="minutes"), "host": platform.node()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env["gpu"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB"
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = "unknown"
    else:
        env["gpu"] = "none (CPU smoke run: figures mean nothing)"
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not installed"
    try:
        env["load"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        env["load"] = "unknown"
    return env


def render_rows(rows) -> list[str]:
    lines = ["| what | N | this project | best peer measured | peer / ours | all candidates |",
             "|---|---|---|---|---|---|"]
    for what, n, r, ours_key, peers in rows:
        ours = r.get(ours_key)
        peer_val, peer = best(r, peers)
        if peer is None:
            peer_txt = "; ".join(f"{p}: {fmt(r.get(p))}" for p in peers if p in r) or "-"
        else:
            peer_txt = f"{peer}: {fmt(peer_val)}"
        others = [f"{k}: {fmt(v)}" for k, v in r.items() if k not in (ours_key, "info")]
        others += [f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}" for k, v in r.get("info", {}).items()]
        others = "; ".join(others)
        lines.append(f"| {what} | {n:g} | {fmt(ours)} | {peer_txt} | {ratio(peer_val, ours)} | {others} |")
    return lines


def write_markdown(store: dict, out: Path):
    env = store["environment"]
    commands = "; ".join(f"`{c}`" for c in store.get("commands", [])) or "`python benchmarks/bench_gpu.py`"
    lines = ["# The framework on a GPU, side by side with the fastest peers", "",
             f"Produced by {commands} (benchmarks/bench_gpu.py; sections merged from its runs on this GPU: a row is "
             "replaced only by a new measurement of the same row, and says when it was measured).", "",
             f"GPU: **{env.get('gpu')}**, driver {env.get('driver', '-')}; torch {env['torch']}, CUDA "
             f"{env['cuda']}, Triton {env['triton']}, Python {env['python']}; host {env['host']}.", "",
             "Each figure: median of the timed calls after a warm-up, all candidates of a row in one process, "
             "interleaved; float32 unless said (rows at N >= 1e6: a run at N = 1e5 first, not kept, then the timed "
             "calls without a warm-up call, as their 'measured' says). 'peer / ours' > 1 means ours is faster.", "",
             "What these figures say against the goals of the GPU work, and what changed because of them: "
             "[README.md](README.md#gpu-measured-on-one-h200).", "",
             "The studies at this scale are a separate command: `meanfield reproduce --quick --only "
             "discrete_vs_meanfield dynamics --device cuda --out runs/gpu-quick` (N up to 10^5; without `--quick` "
             "up to 10^6), which adds the at-scale claims and figures of studies/experiments/at_scale.py.", ""]
    for name in SECTIONS:
        if name not in store["sections"]:
            continue
        sec = store["sections"][name]
        lines += [f"## {name}", "", f"{sec['date']}, repeats {sec['repeats']}, load before: `{sec['load']}`", ""]
        lines += render_rows([tuple(r) for r in sec["rows"]]) + [""]
        for key in ("note", "last run"):
            if sec.get(key):
                lines += [sec[key] if key == "note" else f"Last run: {sec[key]}", ""]
    out.write_text("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="leave out N = 1e6 (and Lipschitz's 3e5)")
    ap.add_argument("--dims", type=int, nargs="+", choices=(3, 64), default=[3, 64],
                    help="head sizes of the grid and derivatives sections")
    ap.add_argument("--sizes", type=float, nargs="+", default=[],
                    help="run only these N of each section (e.g. --sizes 1e6: the rows at N = 1e6, merged with the "
                         "section's earlier rows at other N)")
    ap.add_argument("--masks", nargs="+", choices=MASKS, default=list(MASKS),
                    help="run only these masks in the grid, derivatives, fixed and wide sections (e.g. --masks "
                         "positions: the rows with arbitrary positions, merged with the section's other rows)")
    ap.add_argument("--steps", type=int, default=10, help="RK4 steps of the dynamics section")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cap", type=float, default=120.0, help="seconds: a slower call is not repeated nor scaled up")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "gpu.md")
    ap.add_argument("--json", type=Path, default=None, help="results store (default: --out with .json)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds: no row is started after this (a lent device's time runs out; what ran is kept)")
    ap.add_argument("--until", type=float, default=None,
                    help="the same as an absolute time (seconds since the epoch, `date +%%s`): counts the start-up too")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU: checks the script, measures nothing")
    a = ap.parse_args(argv)
    DIMS[:] = a.dims
    MASKS[:] = a.masks
    SIZES[:] = [int(n) for n in a.sizes]
    STEPS[:] = [a.steps]
    if not a.cpu_smoke and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here (torch.cuda.is_available() is False): nothing measured. "
              "Run it on a machine with an NVIDIA GPU and torch's CUDA build.")
        return 0
    device = torch.device("cpu" if a.cpu_smoke else "cuda")
    store_path = a.json or a.out.with_suffix(".json")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    store_path.parent.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    store = {"environment": env, "sections": {}, "commands": []}
    if store_path.exists():
        old = json.loads(store_path.read_text())
        if old.get("environment", {}).get("gpu") == env["gpu"] and old["environment"].get("torch") == env["torch"]:
            store["sections"], store["commands"] = old.get("sections", {}), old.get("commands", [])
        else:
            was = old.get("environment", {})
            print(f"WARNING: {store_path} holds results of another GPU or torch ({was.get('gpu')}, torch "
                  f"{was.get('torch')}): they are not merged with this run's, which starts the store afresh",
                  flush=True)
    bench = Bench(device, 1 if a.cpu_smoke else a.repeats, a.cap, a.cpu_smoke)
    command = ("python benchmarks/bench_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    if command not in store["commands"]:
        store["commands"].append(command)
    print(f"# bench_gpu on {env['gpu']}; torch {env['torch']}, CUDA {env['cuda']}, Triton {env['triton']}\n")
    ends = [time.monotonic() + a.deadline] if a.deadline is not None else []
    if a.until is not None:
        ends.append(time.monotonic() + (a.until - time.time()))
    deadline = min(ends) if ends else None
    bench.deadline = deadline

    def save():
        # atomically: a run killed while writing leaves the previous store whole
        tmp = store_path.with_name(store_path.name + ".tmp")
        tmp.write_text(json.dumps(store, indent=1, default=str))
        os.replace(tmp, store_path)
        write_markdown(store, a.out)

    for name in a.sections:
        load = environment(device)["load"]
        print(f"## {name}\n\nload before: `{load}`\n", flush=True)
        print("\n".join(render_rows([])), flush=True)
        # every earlier row stays until a row of the same (what, N) replaces it in place (a deadline, --quick,
        # --sizes or --dims that leaves rows out never deletes them); each row says when and how it was measured
        old = store["sections"].get(name, {"rows": [], "date": "", "repeats": "?"})
        for r in old["rows"]:
            # a row from before rows carried their own date: the section's date is only its latest run's
            r[2].setdefault("info", {}).setdefault("measured", f"not recorded (on or before {old['date'][:16]})")
        section = store["sections"][name] = {"rows": list(old["rows"]), "date": env["date"], "load": load,
                                             "repeats": bench.repeats, "note": old.get("note", "")}
        rows = RUNNERS[name](bench, a.quick)
        while True:
            if deadline is not None and time.monotonic() > deadline:
                section["last run"] = f"{env['date']}: the deadline was reached; the section's later rows were not run"
                print(f"\n{section['last run']}", flush=True)
                break
            try:
                item = next(rows, None)
            except Exception as exc:  # a row's own code failed: keep what ran, go on with the next section
                traceback.print_exc()
                section["last run"] = (f"{env['date']}: stopped by an error: {type(exc).__name__}: "
                                       f"{str(exc).splitlines()[0][:200]}")
                print(f"\n{section['last run']}", flush=True)
                break
            if item is None:
                break
            for row in item if isinstance(item, list) else [item]:   # (a list: rows measured together)
                print(render_rows([row])[-1], flush=True)  # each row as it is measured, and saved at once
                row = list(row)
                how = f"repeats {bench.repeats}"
                if row[1] >= BIG_N and not bench.smoke:
                    how = f"{bench.repeats} timed call(s), primed at N = {PRIME_N:g}, no warm-up call"
                row[2].setdefault("info", {})["measured"] = f"{env['date']}, {how}"
                same = [i for i, r in enumerate(section["rows"]) if (r[0], float(r[1])) == (row[0], float(row[1]))]
                if same:
                    section["rows"][same[0]] = row
                else:
                    section["rows"].append(row)
            save()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(flush=True)
        save()
    print(f"written: {a.out} and {store_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
