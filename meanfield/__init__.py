"""Attention operators on sequences and measures, local Lipschitz constants, bounds and dynamics.

Public names are loaded lazily from the submodules that hold them:

================================  ======================================================================================
:mod:`~meanfield.operator`        :class:`AttentionOperator` (the protocol: evaluate + parameters)
:mod:`~meanfield.adapters`        :func:`as_operator`, :class:`CallableOperator`, :class:`TorchMultiheadAttention` (what
                                  users pass, as operators)
:mod:`~meanfield.parameters`      :class:`Parameters`, :class:`Head`: what an operator is made of (``op.parameters()``)
:mod:`~meanfield.attention`       :class:`SelfAttention`, :class:`MultiHeadAttention`, :class:`L2SelfAttention`
:mod:`~meanfield.isotropic`       :class:`IsotropicAttention` (A = beta I, V = I: the sphere models of
                                  Geshkovski et al.)
:mod:`~meanfield.hf`              :class:`HFAttention` (Hugging Face attention layers as operators),
                                  :func:`~meanfield.hf.extract_layer`, ...
:mod:`~meanfield.lipschitz`       :func:`local_lipschitz`, :func:`lipschitz_ratio`, :class:`LipschitzEstimate`,
                                  :data:`~meanfield.lipschitz.TOL` (the default tolerance by dtype)
:mod:`~meanfield.jacobian`        the Jacobian products J u, J^T w behind :func:`local_lipschitz`
:mod:`~meanfield.krylov`          its solvers: Lanczos, power iteration, dense
:mod:`~meanfield.bounds`          the paper's bounds as functions
:mod:`~meanfield.upper`           :func:`operator_upper`: the best bound known for a whole operator, from its parameters
:mod:`~meanfield.adversarial`     witnesses of the lower bounds
:mod:`~meanfield.dynamics`        :func:`simulate` (token dynamics, Transformers as PDEs), :class:`Trajectory`
:mod:`~meanfield.integrators`     Euler, RK4, torchdiffeq's adaptive methods
:mod:`~meanfield.geometry`        :class:`Euclidean`, :class:`Sphere` (where tokens live during the dynamics)
:mod:`~meanfield.kernels`         :func:`attend` (the weighted, causal, log-sum-exp attention kernel)
:mod:`~meanfield.worst_case`      :func:`worst_case_sequence`, :func:`worst_case_measure`,
                                  :func:`plain_gradient_ascent`, :class:`WorstCaseResult`, :class:`SearchOptions`
                                  (certified brackets on the Lipschitz constant on a ball)
:mod:`~meanfield.starts`          the search's starting inputs (witnesses, hubs, random)
:mod:`~meanfield.ascent`          the certified projected ascent it runs (knows nothing of attention)
:mod:`~meanfield.sigma_gradient`  the gradient of a local constant in the input
                                  (:func:`~meanfield.sigma_gradient.sigma_gradient`)
:mod:`~meanfield.splitting`       :func:`split_lipschitz` (mass splitting, closed form),
                                  :func:`~meanfield.splitting.query_jacobians`
:mod:`~meanfield.io`              :func:`save_trajectory`, :func:`load_trajectory`, :func:`save_estimate`,
                                  :func:`load_estimate` (.npz, never pickle)
================================  ======================================================================================

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
