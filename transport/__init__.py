"""Optimal transport between measures: W2, entropic W2 and the conditional W2 of masked measures.

    from transport import w2, conditional_w2, solve
    w2(mu, nu)                                   # exact W2, a float (POT network simplex; sorting in d = 1)
    w2(mu, nu, "sinkhorn", reg=0.1)              # entropic, dense, POT log-domain (debiased by default)
    w2(mu, nu, "streaming", reg=0.1)             # entropic, memory O(N), eps-scaling, CPU or CUDA
    w2(mu, nu, "auto")                           # chooses by size (below)
    res = solve(mu, nu, "sinkhorn", reg=0.1)     # TransportResult: value, plan, potentials, error, ...
    conditional_w2(mu, nu)                       # Definition 4.1; math.inf if position marginals differ

``reg`` is POT's epsilon on squared distances (GeomLoss's ``blur`` for p = 2: blur^2 = reg / 2). Choose it
against the squared diameter of the supports: the iterations to a given tol grow about like diameter^2 / reg
(the default tol, 1e-7 of marginal L1 error, is tight). On the 64-point spheres of radius 2 of the README
(diameter^2 = 16), reg = 0.1 converges in about 700 iterations, where reg = 1e-2 misses tol after 10000.
Every method's options and defaults are in one table, :data:`DEFAULTS`; an option that does not
apply to the chosen method is an error. Which method up to which size (N = M atoms; figures in
benchmarks/transport.md):

* "exact": d = 1 at any N (sorting); otherwise up to N ~ 2000-5000 (network simplex, about
  48 N M bytes, superquadratic time). "auto" uses it while N * M <= 4e6.
* "sinkhorn": dense N x M matrices, N up to ~5000 (about 10 matrices of N M entries).
* "streaming": N from ~10^3 to 10^5 on CPU (time O(N M) per iteration, memory O(N + M)),
  10^6 on a GPU. "auto" switches to it above 4e6 pairs, with reg = (0.05 * diameter)^2 unless
  given.

A dense method that would exceed the memory limit (``memory_limit=`` or
``$SMOOTH_ATTENTION_MEMORY_LIMIT``, default 8 GiB) raises MemoryLimitError before allocating,
naming the size and "streaming". Entropic values: debias=True (default) reports sqrt of the
Sinkhorn divergence S_eps = OT_eps(mu, nu) - (OT_eps(mu, mu) + OT_eps(nu, nu)) / 2 (zero for
mu = nu, -> W2^2 as reg -> 0); debias=False sqrt of <pi_eps, C> (an upper bound on W2). A solve
that does not reach its marginal tolerance raises :class:`ConvergenceError` carrying the result
(``on_failure="warn"``: a RuntimeWarning, and the result with ``converged=False``), as
:func:`meanfield.local_lipschitz` does. Values are floats, or 0-d tensors with gradients when
points require grad.

Precision (docs/math.md sections 3.1-3.2): exact W2 is computed in float64 whatever the dtype, on a
cost matrix whose close pairs are recomputed from their differences x_i - y_j. An entropic solve of
float32 measures runs in float32 only where float32 resolves its plan (squared diameter / reg <= tol /
6e-8), and its marginal error is then measured again in float64 (a float32 solve that misses tol
there continues in float64); elsewhere it runs in float64. :attr:`TransportResult.precision` says which
dtype ran.
"""



def _require_own_particles() -> None:
    """The name ``particles`` is also an unrelated package on PyPI (a sequential Monte Carlo library):
    if one shadows smooth-attention's, say so here rather than fail deep inside."""
    import importlib
    import importlib.util

    fix = ("Install smooth-attention in its own virtual environment (python3 -m venv .venv && . .venv/bin/activate "
           "&& pip install -e /path/to/smooth-attention), or uninstall the other package (pip uninstall particles) "
           "or remove its folder from sys.path / PYTHONPATH.")
    try:
        module = importlib.import_module("particles")
    except ImportError as exc:
        spec = importlib.util.find_spec("particles")
        where = spec.origin if spec is not None else "not found"
        raise ImportError(f"particles: importing the module Python finds as 'particles' ({where}) failed ({exc}); "
                          "if it is not smooth-attention's own particles package, an unrelated package of the same "
                          f"name shadows it. {fix}", name="particles") from exc
    if getattr(module, "__smooth_attention__", None) != "smooth-attention":
        raise ImportError(f"particles: the module Python imports as 'particles' ({getattr(module, '__file__', None)}) "
                          "is not smooth-attention's own particles package (it lacks the marker attribute "
                          f"'__smooth_attention__'): an unrelated package of the same name shadows it. {fix}",
                          name="particles")


_require_own_particles()

from particles._version import __version__ as __version__  # noqa: E402
from particles.validation import ConvergenceError, MemoryLimitError  # noqa: E402

from .api import AUTO_BLUR, AUTO_EXACT_MAX_PAIRS, ROUTINES, solve, w2  # noqa: E402
from .conditional import conditional_w2  # noqa: E402
from .options import DEFAULTS, METHODS, TOL  # noqa: E402
from .result import TransportResult  # noqa: E402
from .streaming_sinkhorn import symmetric_potential  # noqa: E402

__smooth_attention__ = "smooth-attention"  # marker: this is smooth-attention's transport

__all__ = ["w2", "solve", "conditional_w2", "TransportResult", "symmetric_potential", "ConvergenceError",
           "MemoryLimitError", "METHODS", "DEFAULTS", "TOL", "ROUTINES", "AUTO_EXACT_MAX_PAIRS", "AUTO_BLUR"]
