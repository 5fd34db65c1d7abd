"""Optimal transport between measures: W2, entropic W2 and the conditional W2 of masked measures.

    from transport import w2, conditional_w2
    w2(mu, nu)                                   # exact (POT network simplex; sorting in d = 1)
    w2(mu, nu, "sinkhorn", reg=1e-2)             # entropic, dense, POT log-domain (debiased by default)
    w2(mu, nu, "streaming", reg=1e-2)            # entropic, memory O(N), eps-scaling, CPU or CUDA
    w2(mu, nu, "auto")                           # chooses by size (below)
    conditional_w2(mu, nu)                       # Definition 4.1; math.inf if position marginals differ

Which method up to which size (N = M atoms; figures in benchmarks/transport.md):

* "exact": d = 1 at any N (sorting); otherwise up to N ~ 2000-5000 (network simplex, O(N^2)
  memory, superquadratic time). "auto" uses it while N * M <= 4e6.
* "sinkhorn": dense N x M matrices, N up to ~5000 (memory 8 N M bytes per matrix in float64).
* "streaming": N from ~10^3 to 10^5 on CPU (time O(N M) per iteration, memory O(N + M)),
  10^6 on a GPU. "auto" switches to it above 4e6 pairs, with reg = (0.05 * diameter)^2 unless
  given.

Entropic values: debias=True (default) reports sqrt of the Sinkhorn divergence
S_eps = OT_eps(mu, nu) - (OT_eps(mu, mu) + OT_eps(nu, nu)) / 2 (zero for mu = nu, -> W2^2 as
reg -> 0); debias=False sqrt of <pi_eps, C> (an upper bound on W2). A solve that does not reach
its marginal tolerance emits SinkhornConvergenceWarning stating the error reached (RuntimeError
with strict=True). Values are floats, or 0-d tensors with gradients when points require grad.
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

from ._common import SinkhornConvergenceWarning  # noqa: E402
from .api import AUTO_EXACT_MAX_PAIRS, METHODS, w2  # noqa: E402
from .conditional import conditional_w2  # noqa: E402
from .streaming import SinkhornResult, sinkhorn_streaming  # noqa: E402

__smooth_attention__ = "smooth-attention"  # marker: this is smooth-attention's transport

__all__ = ["w2", "conditional_w2", "sinkhorn_streaming", "SinkhornResult", "SinkhornConvergenceWarning",
           "METHODS", "AUTO_EXACT_MAX_PAIRS"]
