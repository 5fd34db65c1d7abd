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

from ._common import SinkhornConvergenceWarning
from .api import AUTO_EXACT_MAX_PAIRS, METHODS, w2
from .conditional import conditional_w2
from .streaming import SinkhornResult, sinkhorn_streaming

__all__ = ["w2", "conditional_w2", "sinkhorn_streaming", "SinkhornResult", "SinkhornConvergenceWarning",
           "METHODS", "AUTO_EXACT_MAX_PAIRS"]
