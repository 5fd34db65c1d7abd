"""The Lipschitz bounds of *How Smooth Is Attention?* (Castin, Ablin, Peyre, ICML 2024) as plain functions.

Every function takes matrices as numpy arrays or torch tensors and returns a Python float
(docs/math.md section 5). Spectral norms ``||.||_2`` throughout. Conventions: scores
``s_ij = <A x_i, x_j>``, values ``V x_j`` with ``V`` of shape (d_out, d), tokens in the ball B_R.
Every name below is importable from here (``meanfield.bounds.sqrt_n_upper``); each lives in a module of one regime:

* :mod:`~meanfield.bounds.sqrt_n`: :func:`sqrt_n_upper` (Thm 3.3 / 4.3), :func:`sqrt_n_lower` (Prop 3.4), and the
  same from gamma, the regime's radius and length;
* :mod:`~meanfield.bounds.mean_field`: :func:`mean_field_upper` (Thm 3.5; unmasked only: Theorem 4.4's stated masked
  version fails, see :func:`cesaro_norm`), :func:`two_dirac_lower` (Prop 3.6, asymptotic), :func:`two_dirac_ratio`
  (its factor 1 + 1/(gamma R^2));
* :mod:`~meanfield.bounds.large_radius`: :func:`large_radius_limit` (Thm 3.7 / 4.5), :func:`argmax_indices`,
  :func:`score_gap`;
* :mod:`~meanfield.bounds.multihead`: :func:`multihead_upper` (Lemma 3.8), biases: :func:`absorb_key_bias` (a key bias
  as one more coordinate), :func:`augmented_head_norms`, :func:`biased_multihead_upper`; the best bound known for a
  whole operator, from its parameters, is :func:`meanfield.operator_upper`;
* :mod:`~meanfield.bounds.l2_attention`: :func:`l2_attention_upper` (Kim et al. Thm 3.2, corrected);
* :mod:`~meanfield.bounds.eigen`: the eigen-structure of A, :func:`gamma`, :func:`gamma_info`, :func:`eigen_cases`;
* :mod:`~meanfield.bounds.mass_splitting`: :func:`query_term_norms`, :func:`split_constant` (docs/math.md section
  4.7);
* :mod:`~meanfield.bounds.numerics`: :func:`spectral_norm`, :class:`BoundOverflowWarning`.

Bounds containing ``exp(c R^2)`` accept ``log=True`` and then return the natural logarithm of the
bound, finite while its exponent is (c R^2 below about 1.8e308: R up to about 1e153 for c = 2). Their plain
value is ``math.inf`` only when the true number exceeds the float64 range (about 1.8e308), and then with a
:class:`BoundOverflowWarning` that gives the logarithm; so is a logarithm that overflows; never NaN.
"""

from __future__ import annotations

from .eigen import GammaInfo, eigen_cases, gamma, gamma_info, gamma_info_factored
from .l2_attention import l2_attention_upper, lambert_phi_inverse
from .large_radius import argmax_indices, large_radius_limit, large_radius_sup, score_gap
from .mass_splitting import query_term_norms, split_constant
from .mean_field import (
    cesaro_norm,
    mean_field_upper,
    two_dirac_lower,
    two_dirac_lower_from_gamma,
    two_dirac_ratio,
    two_dirac_ratio_from_gamma,
)
from .multihead import absorb_key_bias, augmented_head_norms, biased_multihead_upper, multihead_upper
from .numerics import BoundOverflowWarning, spectral_norm
from .sqrt_n import sqrt_n_lower, sqrt_n_lower_from_gamma, sqrt_n_regime_length, sqrt_n_regime_radius, sqrt_n_upper

__all__ = [
    "BoundOverflowWarning",
    "GammaInfo",
    "absorb_key_bias",
    "argmax_indices",
    "augmented_head_norms",
    "biased_multihead_upper",
    "cesaro_norm",
    "gamma",
    "gamma_info",
    "eigen_cases",
    "gamma_info_factored",
    "l2_attention_upper",
    "large_radius_limit",
    "large_radius_sup",
    "lambert_phi_inverse",
    "mean_field_upper",
    "multihead_upper",
    "query_term_norms",
    "score_gap",
    "spectral_norm",
    "split_constant",
    "sqrt_n_lower",
    "sqrt_n_lower_from_gamma",
    "sqrt_n_regime_length",
    "sqrt_n_regime_radius",
    "sqrt_n_upper",
    "two_dirac_lower",
    "two_dirac_lower_from_gamma",
    "two_dirac_ratio",
    "two_dirac_ratio_from_gamma",
]


def __getattr__(name: str):
    # operator_upper reads the operators' parameters: it lives in meanfield.upper, above the operators (this package
    # imports none), and an earlier spelling put it here
    if name in ("operator_upper", "UpperBound"):
        raise AttributeError(f"module 'meanfield.bounds' has no attribute {name!r}: the bound of a whole operator is "
                             f"meanfield.{name} (defined in meanfield.upper)")
    raise AttributeError(f"module 'meanfield.bounds' has no attribute {name!r}")
