"""Isotropic attention: A = beta I, V = I, the interaction of the sphere models of Geshkovski,
Letrouit, Polyanskiy and Rigollet (docs/math.md section 6).

Tokens interact through the fields (before projection on the tangent spaces, when they live on the
unit sphere: ``simulate(IsotropicAttention(beta, "SA"), mu0, times, geometry="sphere")``)

* SA (self-attention):  Gamma(x) = sum_j a_j e^{beta <x, x_j>} x_j / sum_l a_l e^{beta <x, x_l>},
  i.e. attention with A = beta I and V = I;
* USA (unnormalized):   Gamma(x) = sum_j a_j e^{beta <x, x_j>} x_j, the 1/n normalization of uniform
  weights a_j = 1/n.

:func:`meanfield.simulate` moves tokens along them; ``geometry="sphere"`` keeps them on their spheres.
"Sphere" names the manifold (:class:`meanfield.geometry.Sphere`); the operator is isotropic attention
(``SphereAttention``, its name in the previous release, still works with a DeprecationWarning).
Along both flows the interaction energy
E_beta = (1/(2 beta)) sum_ij a_i a_j e^{beta <x_i, x_j>} is non-decreasing (for USA the field is
a_i^{-1} times the gradient of E_beta in x_i). With positions (``masked=True``) only atoms with
s_j <= s are seen (the causal sphere model).
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch

from particles.validation import broadcast_shapes, check_bool, check_positive_int, to_arguments

from . import kernels as _kernels
from .kernels import attend
from .operator import AttentionOperator
from .parameters import Head, Parameters

__all__ = ["IsotropicAttention", "NORMALIZATIONS", "SphereAttention", "SPHERE_MODELS", "uniform_growth_rate"]

#: The two normalizations, SA (softmax) and USA (unnormalized, the 1/n of uniform weights)
NORMALIZATIONS = ("SA", "USA")
SPHERE_MODELS = NORMALIZATIONS   # the previous release's name


class IsotropicAttention(AttentionOperator):
    """Attention with A = beta I and V = I: the SA / USA velocity fields (module docstring), as an
    operator of any dimension and dtype."""

    d_in = d_out = dtype = device = None

    def __init__(self, beta: float, normalization: str = "SA", masked: bool = False):
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not math.isfinite(beta) or beta < 0:
            raise ValueError(f"beta: expected a finite inverse temperature >= 0, got {beta!r}")
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization: expected 'SA' or 'USA', got {normalization!r}")
        check_bool(masked, "masked")
        self.beta = float(beta)
        self.normalization = normalization
        self.masked = masked

    def __repr__(self) -> str:
        return f"{type(self).__name__}(beta={self.beta}, normalization={self.normalization!r}, masked={self.masked})"

    def to(self, device=None, dtype=None) -> IsotropicAttention:
        device, dtype = to_arguments(device, dtype)
        return self  # no parameters: acts in the dtype and on the device of its inputs

    def parameters(self, d: int | None = None):
        """One head with A = beta I and V = I in dimension ``d`` (required: the model acts in every
        dimension), float64 on the CPU. USA is not a softmax average: its record carries a caveat."""
        if d is None:
            raise ValueError("d: IsotropicAttention acts in every dimension; give the token dimension, "
                             "op.parameters(d)")
        d = check_positive_int(d, "d")
        eye = torch.eye(d, dtype=torch.float64)
        caveat = None if self.normalization == "SA" else \
            "the unnormalized USA field is not a softmax average: no bound of the paper applies"
        return Parameters((Head(self.beta * eye, eye, eye, None, None, 1.0, "dot"),), masked=self.masked,
                          caveat=caveat)

    def evaluate(self, x, keys, log_weights=None, x_positions=None, key_positions=None):
        q = self.beta * x
        if self.normalization == "SA":
            return attend(q, keys, keys, log_weights, x_positions, key_positions)
        path = _kernels.default_path(q, keys, keys, log_weights, x_positions, key_positions)
        if path == "series" and x_positions is None:
            # the softmax average and its row log-sums from one series (O(N): meanfield.series_attention), where
            # auto takes the series for the average (with positions, attend names the method it cannot take)
            out, lse = _kernels.series_checked(q, keys, keys, log_weights, lse=True)
        elif path in ("stream", "fused"):
            # the same from the one pass of the streamed kernel (the fused path's kernel on a CPU), which gives the row
            # log-sums with the average: the cost of SA's field instead of that pass and a dense one (about 3x)
            out, lse = _kernels.stream_checked(q, keys, keys, log_weights, x_positions, key_positions)
        else:
            out = attend(q, keys, keys, log_weights, x_positions, key_positions)
            lse = _row_logsumexp(q, keys, log_weights, x_positions, key_positions)
        if log_weights is None:
            # no weights: the uniform a_j = 1/n of the n keys (docs/math.md section 6.3), so that the sequence
            # map is that of its empirical measure, F(m(X)) = m(f(X)) (masked: 1/n of all keys, seen or not)
            lse = lse - math.log(keys.shape[-2])
        # in the dtype of the points: the streamed kernel gives the half types' row log-sums in float32
        return (out * torch.exp(lse).unsqueeze(-1)).to(out.dtype)


def uniform_growth_rate(beta: float, normalization: str = "SA", d: int = 3) -> float:
    """The growth rate lambda_1 of the first (degree-1) mode at the uniform measure on the sphere S^{d-1}: the
    linearization of the continuity equation of the sphere models (docs/math.md section 6.6).

    The uniform measure is an equilibrium of both flows; a perturbation of density d <m, y> (whose mean is m)
    grows as m(t) = e^{lambda_1 t} m(0) to first order, with

        lambda_1 = E[e^{beta t} (1 - t^2)] / E[e^{beta t}]   (SA),      lambda_1 = E[e^{beta t} (1 - t^2)]   (USA),

    t = <x, y> for y uniform on the sphere (density proportional to (1 - t^2)^{(d - 3) / 2} on [-1, 1]). In d = 3,
    t is uniform on [-1, 1] and lambda_1 = 2 (beta coth(beta) - 1) / beta^2 (SA), 2 (beta cosh(beta) - sinh(beta)) /
    beta^3 (USA): 0.626 and 0.736 at beta = 1. The mean of N tokens drawn uniformly is of order N^{-1/2}, so they
    leave the uniform state after a time of about log(N) / (2 lambda_1).
    """
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not math.isfinite(beta) or beta < 0:
        raise ValueError(f"beta: expected a finite inverse temperature >= 0, got {beta!r}")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization: expected 'SA' or 'USA', got {normalization!r}")
    d = check_positive_int(d, "d", minimum=2)
    beta = float(beta)
    from scipy.integrate import quad

    # t = cos(theta): the law of <x, y> on S^{d-1} has density proportional to sin(theta)^(d - 2) in theta; e^{beta t}
    # is scaled by e^{-beta} (ratios and, for USA, the factor put back in logs) so that no beta overflows. The tilted
    # integrands peak at theta = 0 with a width of about beta^(-1/2): integrated up to 40 widths first (beyond, below
    # e^(-300) of the peak), where one interval of [0, pi] missed the peak from beta of about 1e4 (a review: -46% at
    # 1e6, without a warning)
    weight = lambda th: math.sin(th) ** (d - 2)
    mass = quad(weight, 0.0, math.pi)[0]
    tilt = lambda th: math.exp(-2.0 * beta * math.sin(0.5 * th) ** 2) * weight(th)   # cos - 1 without cancellation
    edge = min(math.pi, 40.0 / math.sqrt(beta)) if beta > 0 else math.pi

    def integral(f):   # relative tolerance only: the integrals are of order beta^(-1/2) and beta^(-3/2)
        inner = quad(f, 0.0, edge, limit=200, epsabs=0.0, epsrel=1e-12)[0]
        return inner + (quad(f, edge, math.pi, limit=200, epsabs=0.0, epsrel=1e-12)[0] if edge < math.pi else 0.0)

    z = integral(tilt)
    tangential = integral(lambda th: tilt(th) * math.sin(th) ** 2)
    if normalization == "SA":
        return tangential / z
    log_rate = beta + math.log(tangential / mass) if tangential > 0 else -math.inf
    return math.exp(log_rate) if log_rate < 709.0 else math.inf   # USA's rate grows like e^beta: inf beyond float64


class SphereAttention(IsotropicAttention):
    """The previous release's name of :class:`IsotropicAttention` (a DeprecationWarning when built)."""

    def __init__(self, beta: float, normalization: str = "SA", masked: bool = False):
        warnings.warn("SphereAttention is now IsotropicAttention (meanfield.isotropic): 'sphere' names the manifold "
                      "(geometry='sphere'); the old name will be removed in the next release", DeprecationWarning,
                      stacklevel=2)
        super().__init__(beta, normalization, masked)


#: score entries :func:`_row_logsumexp` holds at once (rows of queries against every key)
LSE_BLOCK = 2**22


def _row_logsumexp(q, k, log_weights, q_pos, k_pos, block: int | None = None) -> torch.Tensor:
    """log sum_j exp(<q_i, k_j> + log a_j) over visible keys, in row blocks: ``block`` rows (None: as many as
    keep a block within :data:`LSE_BLOCK` score entries, batch included), memory O(LSE_BLOCK + n). A fixed
    2048 rows took 2048 x n entries: 3.2 GB at n = 1e5 in float64, 16 GB for 4096 queries against 1e6 keys."""
    if block is None:
        batch = math.prod(broadcast_shapes(q.shape[:-2], k.shape[:-2]))
        block = max(1, LSE_BLOCK // max(1, batch * k.shape[-2]))
    rows = []
    for i0 in range(0, q.shape[-2], block):
        s = q[..., i0:i0 + block, :] @ k.transpose(-1, -2)
        if log_weights is None and q_pos is None:
            rows.append(torch.logsumexp(s, dim=-1))
            continue
        # keys of zero weight and keys after the query are masked out (masked_fill: no gradient flows to them); a
        # row that sees no key of positive weight (its output is 0, docs/math.md section 2) gets -inf without
        # passing through logsumexp of an empty row, whose derivative is 0/0: NaN gradients and tangents
        hidden = None
        if log_weights is not None:
            zero = log_weights == float("-inf")
            s = s + log_weights.masked_fill(zero, 0.0).unsqueeze(-2)
            hidden = zero.unsqueeze(-2)
        if q_pos is not None:
            later = k_pos.unsqueeze(-2) > q_pos[..., i0:i0 + block].unsqueeze(-1)
            hidden = later if hidden is None else hidden | later
        s, hidden = torch.broadcast_tensors(s, hidden)   # positions may carry batch dimensions the points lack
        dead = hidden.all(dim=-1)
        s = s.masked_fill(hidden, float("-inf")).masked_fill(dead.unsqueeze(-1), 0.0)
        rows.append(torch.logsumexp(s, dim=-1).masked_fill(dead, float("-inf")))
    return torch.cat(rows, dim=-1)
