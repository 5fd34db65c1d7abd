"""Attention operators on sequences and measures, local Lipschitz constants, bounds and dynamics.

Public names are loaded lazily from the submodules that hold them::

    operator     AttentionOperator (the protocol: evaluate + parameters)
    adapters     as_operator, CallableOperator, TorchMultiheadAttention (what users pass, as operators)
    parameters   Parameters, Head: what an operator is made of (op.parameters())
    attention    SelfAttention, MultiHeadAttention, L2SelfAttention
    isotropic    IsotropicAttention (A = beta I, V = I: the sphere models of Geshkovski et al.)
    hf           HFAttention (Hugging Face attention layers as operators), extract_layer, ...
    lipschitz    local_lipschitz, lipschitz_ratio, LipschitzEstimate, TOL (the default tolerance by dtype)
    jacobian     the Jacobian products J u, J^T w behind local_lipschitz
    krylov       its solvers: Lanczos, power iteration, dense
    bounds       the paper's bounds as functions (``meanfield.bounds``)
    upper        operator_upper: the best bound known for a whole operator, from its parameters
    adversarial  witnesses of the lower bounds (``meanfield.adversarial``)
    dynamics     simulate (token dynamics, Transformers as PDEs), Trajectory
    integrators  Euler, RK4, torchdiffeq's adaptive methods
    geometry     Euclidean, Sphere (where tokens live during the dynamics)
    kernels      attend (the weighted, causal, log-sum-exp attention kernel)
    worst_case   worst_case_sequence, worst_case_measure, plain_gradient_ascent, WorstCaseResult,
                 SearchOptions (certified brackets on the Lipschitz constant on a ball)
    starts       the search's starting inputs (witnesses, hubs, random)
    ascent       the certified projected ascent it runs (knows nothing of attention)
    sigma_gradient  the gradient of a local constant in the input (``meanfield.sigma_gradient.sigma_gradient``)
    splitting    split_lipschitz (mass splitting, closed form), query_jacobians
    io           save_trajectory, load_trajectory, save_estimate, load_estimate (.npz, never pickle)

Measures are saved with :func:`particles.save_measure` / :func:`particles.load_measure`.
"""

from __future__ import annotations

import importlib

from ._packages import DISTRIBUTION as __smooth_attention__  # noqa: F401  (marker: this is smooth-attention's)
from ._packages import require_own

# a foreign package named particles or transport (PyPI has both) would otherwise fail deep inside
require_own("particles")
require_own("transport")

_NAMES = {
    "AttentionOperator": "operator",
    "as_operator": "adapters",
    "CallableOperator": "adapters",
    "TorchMultiheadAttention": "adapters",
    "IsotropicAttention": "isotropic",
    "SphereAttention": "isotropic",
    "HFAttention": "hf",
    "Euclidean": "geometry",
    "Sphere": "geometry",
    "ConvergenceError": "lipschitz",
    "SelfAttention": "attention",
    "MultiHeadAttention": "attention",
    "L2SelfAttention": "attention",
    "local_lipschitz": "lipschitz",
    "lipschitz_ratio": "lipschitz",
    "LipschitzEstimate": "lipschitz",
    "simulate": "dynamics",
    "Trajectory": "dynamics",
    "attend": "kernels",
    "save_trajectory": "io",
    "load_trajectory": "io",
    "save_estimate": "io",
    "load_estimate": "io",
    "worst_case_sequence": "worst_case",
    "worst_case_measure": "worst_case",
    "plain_gradient_ascent": "worst_case",
    "WorstCaseResult": "worst_case",
    "SearchOptions": "worst_case",
    "Parameters": "parameters",
    "Head": "parameters",
    "operator_upper": "upper",
    "UpperBound": "upper",
    "split_lipschitz": "splitting",
}
_SUBMODULES = {"operator", "adapters", "parameters", "attention", "isotropic", "hf", "lipschitz", "jacobian",
               "krylov", "bounds", "upper", "adversarial", "starts", "ascent", "dynamics", "integrators",
               "geometry", "kernels", "clustering", "io", "worst_case", "splitting", "sigma_gradient"}

__all__ = sorted(_NAMES) + sorted(_SUBMODULES)


def __getattr__(name: str):
    if name == "__version__":
        from particles._version import __version__

        return __version__
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'meanfield' has no attribute {name!r}")


def __dir__():
    return __all__
