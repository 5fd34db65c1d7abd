"""The operator protocol: what every attention map of the framework is (docs/math.md section 2).

An attention operator acts on sequences (the discrete map f) and on measures (the pushforward F).
Every operator implements ONE primitive (and, to be read by the theory, :meth:`~AttentionOperator.parameters`),

    op.evaluate(x, keys, log_weights=None, x_positions=None, key_positions=None)

the attention output at query points x (..., m, d_in) against the key/value measure
sum_j a_j delta_{y_j} given by its points ``keys`` (..., n, d_in) and log-weights log a_j
(None: uniform), with positions s for masked (causal) operators: a query at position t sees the
keys with s_j <= t. Everything else is derived from it once, here:

* ``op.points_map(X, log_weights=None, positions=None)``: X -> Gamma_{mu_X}(X), the map of the
  atoms of the measure with points X and fixed weights and positions (what Jacobians differentiate);
* ``op.sequence(X)``: f(X), the points map with uniform weights (positions i/n when masked);
* ``op(mu)``: the pushforward F(mu) = (Gamma_mu)_# mu, weights and positions kept;
* ``op.velocity(mu, x, positions=None)``: Gamma_mu(x), the velocity field of the token dynamics;
* ``op.check_points`` / ``op.check_measure``: the input checks, with errors that name the argument.

Properties every operator has: ``masked``, ``d_in``, ``d_out``, ``dtype``, ``device`` and
``points_only`` (False for every operator that can weigh keys).

What an operator is made of is its :meth:`~AttentionOperator.parameters` record (:mod:`meanfield.parameters`). What
users pass becomes an operator through :func:`meanfield.adapters.as_operator` (Hugging Face layers,
``torch.nn.MultiheadAttention``, bare callables); ``meanfield.operator.as_operator`` is the same
function.
"""

from __future__ import annotations

import importlib
import warnings

import numpy as np
import torch

from particles import Measure
from particles.measure import held_positions, position_dtype
from particles.validation import as_tensor, output_checks_are_deferred, torch_dtype

__all__ = ["AttentionOperator", "sequence_positions", "WRAP_POINTS"]

#: what to do with points given where a measure is needed (the ``tensors`` advice of
#: :meth:`AttentionOperator.check_measure` for functions of measures)
WRAP_POINTS = "wrap points as particles.Measure.empirical(X), or Measure.sequence(X) for a masked operator's sequence"


def sequence_positions(n: int, like: torch.Tensor) -> torch.Tensor:
    """Positions s_i = i/n, i = 1..n: the masked measure of a sequence (docs/math.md section 2), in
    :func:`particles.measure.position_dtype` of ``like``'s dtype (float32 for half precisions, whose i/n collide)."""
    return torch.arange(1, n + 1, dtype=position_dtype(like.dtype), device=like.device) / n


class AttentionOperator:
    """Base class of the operator protocol (see the module docstring).

    Subclasses set ``masked`` and implement :meth:`evaluate`, ``d_in``, ``d_out``, ``dtype`` and
    ``device``; :meth:`to` is optional. ``d_in``, ``dtype`` or ``device`` may be None for an operator
    that accepts any (the sphere models act in every dimension; ``d_out`` None means d_in). They
    inherit ``points_map``, ``sequence``, ``__call__``, ``velocity`` and the input checks.
    """

    masked: bool = False
    #: True for operators that cannot weigh keys (bare callables), whose measures must be uniform and unpositioned
    points_only: bool = False

    # -------------------------------------------------------------- the protocol
    @property
    def d_in(self) -> int:
        raise NotImplementedError

    @property
    def d_out(self) -> int:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def evaluate(self, x, keys, log_weights=None, x_positions=None, key_positions=None) -> torch.Tensor:
        """Attention of the queries ``x`` (..., m, d_in) against the weighted keys (..., n, d_in):
        sum_j softmax_j(score(x_i, y_j) + log a_j) value(y_j), over j with s_j <= t_i when masked.

        No validation (the derived maps check their inputs once); must be differentiable in x and
        keys (torch.func transforms run through it). Returns (..., m, d_out).
        """
        raise NotImplementedError

    def to(self, device=None, dtype=None) -> AttentionOperator:
        raise NotImplementedError(f"{type(self).__name__} cannot change device or dtype")

    def _convert(self, arg: str) -> str:
        """How to convert this operator, for error messages (``arg``: "dtype=torch.float64" or "'cuda'"): its
        own ``to`` where it has one, else its wrapped module's (adapters read the module's dtype and device
        at every call), else nothing to suggest."""
        if type(self).to is not AttentionOperator.to:
            return f" or the operator (op.to({arg}))"
        if isinstance(getattr(self, "module", None), torch.nn.Module):
            return f" or the wrapped module (module.to({arg}))"
        return ""

    def parameters(self, d: int | None = None):
        """What the operator is made of: a :class:`~meanfield.parameters.Parameters` record (per head
        Q, K, V, biases, scale and kind; W_O and the output bias), which the bounds, the worst-case
        starts and the dynamics read; None for an operator that is not made of softmax heads the
        framework can read (a bare callable: the theory then says it cannot bound it). ``d`` is the
        token dimension, needed only by operators that act in every dimension
        (:class:`~meanfield.isotropic.IsotropicAttention`)."""
        return None

    # -------------------------------------------------------------- derived maps
    def points_map(self, X, log_weights=None, positions=None) -> torch.Tensor:
        """X (..., n, d_in) -> Gamma_mu(X) (..., n, d_out) for the measure mu with atoms X, the given
        log-weights (None: uniform) and, for masked operators, positions.

        No validation: the Lipschitz estimators differentiate through it with weights and positions
        held fixed (Lemma C.5, docs/math.md section 4).
        """
        pos = positions if self.masked else None
        return self.evaluate(X, X, log_weights, pos, pos)

    def sequence(self, X) -> torch.Tensor:
        """The discrete map f(X) (f^m if masked): X (..., n, d_in) -> (..., n, d_out).

        X: a tensor of the operator's dtype and device; a floating tensor or numpy array of another dtype is a
        TypeError (converting float64 values to a float32 operator would lose precision silently, so the
        conversion is yours: ``X.to(op.dtype)``, or ``op.to(dtype)`` for operators that convert). Inputs that
        carry no floating dtype (integer tensors and arrays, nested lists) take the operator's."""
        X = self.check_points(X, "X")
        if X.dim() < 2:
            raise ValueError(f"X: expected a sequence of shape (..., n, {self.d_in}), got {tuple(X.shape)}")
        if X.shape[-2] == 0:
            raise ValueError(f"X: an empty sequence (n = 0) of shape {tuple(X.shape)}")
        pos = sequence_positions(X.shape[-2], X) if self.masked else None
        return _finite(self.points_map(X, None, pos), "op.sequence(X)")

    def __call__(self, mu) -> Measure:
        """The pushforward measure F(mu) = (Gamma_mu)_# mu; weights and positions are kept."""
        mu = self.check_measure(mu, "mu")
        out = _finite(self.points_map(mu.points, self._log_weights_of(mu), mu.positions), "op(mu)")
        return Measure._trusted(out, mu.weights, mu.log_weights, mu.positions)

    def velocity(self, mu, x, positions=None) -> torch.Tensor:
        """Gamma_mu(x) for points x (..., d_in) (masked: Gamma_mu(s, x) with query positions s);
        shape (..., d_out)."""
        mu = self.check_measure(mu, "mu")
        x = self.check_points(x, "x")
        if x.dim() < 1:
            raise ValueError(f"x: expected points of shape (..., {self.d_in}), got a scalar")
        if x.shape[-1] != mu.dim:
            raise ValueError(f"x: expected points of dimension {mu.dim} (the measure's), got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        xq = x.reshape(-1, x.shape[-1])
        q_pos = k_pos = None
        if self.masked:
            if positions is None:
                raise ValueError("positions: a masked operator needs the query positions s of the points x")
            p = held_positions(as_tensor(positions, "positions", device=x.device), position_dtype(x.dtype))
            if p.shape != lead:
                raise ValueError(f"positions: expected shape {tuple(lead)} (one per point), got {tuple(p.shape)}")
            if p.numel() and bool(((p < 0) | (p > 1)).any()):
                raise ValueError("positions: must lie in [0, 1], as a measure's do "
                                 f"(got range [{float(p.min()):.3g}, {float(p.max()):.3g}])")
            q_pos, k_pos = p.reshape(-1), mu.positions
        elif positions is not None:
            raise ValueError("positions: only masked operators take query positions")
        if self.points_only:
            raise TypeError(f"op: {self!r} is points-only (a bare callable on sequences); it has no velocity "
                            "field at arbitrary points. Wrap a meanfield operator or a Hugging Face layer")
        out = self.evaluate(xq, mu.points, self._log_weights_of(mu), q_pos, k_pos)
        return _finite(out, "op.velocity(mu, x)").reshape(*lead, out.shape[-1])

    # -------------------------------------------------------------- checks
    def check_points(self, X, name: str = "X") -> torch.Tensor:
        """X as a tensor of this operator's dtype and device with last dimension d_in, or a clear error."""
        if isinstance(X, Measure):
            raise TypeError(f"{name}: expected a tensor of points, got a Measure "
                            "(call the operator on measures: op(mu))")
        if not isinstance(X, torch.Tensor):
            # lists and integer arrays carry no float dtype: they take the operator's; a float numpy array must
            # have it, as a tensor must (float64 values given to a float32 operator would lose precision)
            if isinstance(X, np.ndarray | np.generic) and X.dtype.kind == "f" and self.dtype is not None \
                    and torch_dtype(X.dtype) != self.dtype:
                want = str(self.dtype).removeprefix("torch.")
                raise TypeError(f"{name}: numpy dtype {X.dtype} differs from the operator's {self.dtype}; convert the "
                                f"input ({name}.astype(np.{want}))"
                                f"{self._convert(f'dtype=torch.{X.dtype}')}")
            X = as_tensor(X, name, dtype=self.dtype, device=self.device)
        elif not X.is_floating_point() and not X.is_complex() and X.dtype != torch.bool:
            # an integer tensor carries no float dtype either: it takes the operator's, as a list of integers does
            X = as_tensor(X, name, dtype=self.dtype)
        else:
            X = as_tensor(X, name)
        if X.dim() == 0 or (self.d_in is not None and X.shape[-1] != self.d_in):
            raise ValueError(f"{name}: expected last dimension {self.d_in} (the operator's input dimension), "
                             f"got shape {tuple(X.shape)}")
        if self.dtype is not None and X.dtype != self.dtype:
            raise TypeError(f"{name}: dtype {X.dtype} differs from the operator's {self.dtype}; convert the input "
                            f"({name}.to({self.dtype})){self._convert(f'dtype={X.dtype}')}")
        if self.device is not None and X.device != self.device:
            raise ValueError(f"{name}: on device {X.device}, the operator is on {self.device} "
                             f"(move the input: {name}.to('{self.device}'){self._convert(repr(str(X.device)))})")
        return X

    def check_measure(self, mu, name: str = "mu", *, tensors: str = "use op.sequence(X) for tensors") -> Measure:
        """mu as a Measure this operator can act on, or a clear error naming ``name`` (``tensors``: what to do with a
        tensor instead, said in that error)."""
        if not isinstance(mu, Measure):
            raise TypeError(f"{name}: expected a particles.Measure, got {type(mu).__name__} ({tensors})")
        if self.d_in is not None and mu.dim != self.d_in:
            raise ValueError(f"{name}: atoms have dimension {mu.dim}, the operator expects {self.d_in}")
        if self.dtype is not None and mu.dtype != self.dtype:
            raise TypeError(f"{name}: dtype {mu.dtype} differs from the operator's {self.dtype}; convert the "
                            f"measure ({name}.to(dtype={self.dtype})){self._convert(f'dtype={mu.dtype}')}")
        if self.device is not None and mu.device != self.device:
            raise ValueError(f"{name}: on device {mu.device}, the operator is on {self.device} "
                             f"(move one of them with .to(device))")
        if self.masked and mu.positions is None:
            raise ValueError(f"{name}: a masked operator needs a measure with positions "
                             "(build it with Measure.sequence(X) or positions=...)")
        if not self.masked and mu.positions is not None and not self.points_only:
            # as transport.w2 does for masked measures: a result that ignores what the measure carries says so
            warnings.warn(f"{name}: the measure's positions are not read: {type(self).__name__} is unmasked (every "
                          f"atom attends to every atom, whatever its position). Pass {name}.unmasked() to drop them "
                          "on purpose, or build the operator with masked=True", UserWarning, stacklevel=3)
        if self.points_only:
            if mu.positions is not None:
                raise ValueError(f"{name}: {self!r} is points-only (a bare callable): it cannot read the positions "
                                 "of a masked measure. Use a meanfield operator, a Hugging Face layer, or a "
                                 "sequence tensor")
            if not _uniform(mu):
                raise ValueError(f"{name}: {self!r} is points-only (a bare callable): it cannot put the measure's "
                                 "weights in its softmax, and dropping them would give a wrong answer. Use a "
                                 "meanfield operator or a Hugging Face layer (as_operator), or a uniform measure")
        return mu

    def _log_weights_of(self, mu: Measure):
        # a uniform measure with positions i/n is a sequence: points-only operators get no weights
        return None if self.points_only else mu.log_weights


def _uniform(mu: Measure) -> bool:
    lw = mu.log_weights.detach()
    return bool((lw - lw[0]).abs().max() <= 1e-12 * max(1.0, abs(float(lw[0]))))


def _finite(out: torch.Tensor, what: str) -> torch.Tensor:
    if output_checks_are_deferred():
        return out
    if out.numel() and not bool(torch.isfinite(out.detach()).all()):
        raise FloatingPointError(f"{what}: the output is not finite: the attention scores overflow "
                                 f"{out.dtype} at this input (|score| beyond the dtype's range), or, for a field "
                                 "that is not a softmax average (USA's sum_j a_j e^(beta <x_i, x_j>) x_j), the "
                                 "field itself does")
    return out


def __getattr__(name: str):
    # the adapters moved to meanfield.adapters, which imports the Hugging Face wrapper (itself an operator);
    # the previous paths work for one more release
    if name in ("as_operator", "CallableOperator", "TorchMultiheadAttention", "additive_mask"):
        home = "kernels" if name == "additive_mask" else "adapters"
        warnings.warn(f"meanfield.operator.{name} moved to meanfield.{home}.{name}"
                      + ("" if home == "kernels" else f" (also meanfield.{name})")
                      + "; the old path will be removed in the next release", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(f"meanfield.{home}"), name)
    raise AttributeError(f"module 'meanfield.operator' has no attribute {name!r}")
