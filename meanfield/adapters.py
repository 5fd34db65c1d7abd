"""Adapters: what users pass, as an operator of the protocol (docs/math.md section 2).

:func:`as_operator` turns what users pass into an :class:`~meanfield.operator.AttentionOperator`:
a meanfield operator (returned as is), a Hugging Face attention layer (:mod:`meanfield.hf`), a
``torch.nn.MultiheadAttention`` (:class:`TorchMultiheadAttention`), or a bare callable X (n, d) ->
(n, d') (:class:`CallableOperator`). A bare callable cannot weigh its keys, so it is *points-only*:
it acts on sequences and on uniform, unpositioned measures, and a weighted or positioned measure
given to it is an error (its weights would otherwise be silently dropped); it declares no parameters,
so the theory says it cannot bound it.

This module sits above the operators (it imports :mod:`meanfield.hf`); nothing among the operators
imports it back.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from particles import Measure
from particles.validation import as_tensor, check_bool, check_device, float_dtype, to_arguments, torch_dtype

from .kernel_inputs import silence_blind_rows
from .kernels import additive_mask
from .operator import AttentionOperator
from .parameters import Head, Parameters

__all__ = ["as_operator", "CallableOperator", "TorchMultiheadAttention"]


def _floating_tensors(fn) -> list:
    """The floating parameters and buffers of ``fn`` where it is a torch.nn.Module (else none)."""
    if not isinstance(fn, torch.nn.Module):
        return []
    return [t for t in (*fn.parameters(), *fn.buffers()) if t.is_floating_point()]


class CallableOperator(AttentionOperator):
    """A bare callable X (n, d_in) -> (n, d_out) as a points-only operator.

    It maps sequences (``sequence``), uniform unpositioned measures (``op(mu)``) and is what
    :func:`meanfield.local_lipschitz` differentiates; it has no velocity field at other points and
    refuses weighted or positioned measures (see the module docstring). ``masked`` records whether
    the callable is causal (it applies its own mask; no positions are passed to it).
    ``dtype``/``device``/``d_in`` are taken from the first input it sees unless given. A ``torch.nn.Module`` that
    refuses an input of another dtype than its parameters' is named in the error (``X``), with the conversions.
    """

    points_only = True

    def __init__(self, fn, *, masked: bool = False, d_in: int | None = None, d_out: int | None = None,
                 dtype=None, device=None, name: str | None = None):
        if not callable(fn):
            raise TypeError(f"f: expected a callable on tensors, got {type(fn).__name__}")
        check_bool(masked, "masked")
        self.fn, self.masked = fn, masked
        self._d_in, self._d_out, self._dtype, self._device = d_in, d_out, dtype, device
        self.name = name or getattr(fn, "__name__", type(fn).__name__)

    @property
    def d_in(self):
        return self._d_in

    @property
    def d_out(self):
        return self._d_out

    @property
    def dtype(self):
        return self._dtype

    @property
    def device(self):
        return self._device

    def __repr__(self) -> str:
        return f"CallableOperator({self.name}, points-only)"

    def _convert(self, arg: str) -> str:
        return f" or the module ({self.name}.to({arg}))" if isinstance(self.fn, torch.nn.Module) else ""

    def bind(self, X: torch.Tensor) -> CallableOperator:
        """Fix d_in, dtype and device from an example input and d_out from one call on it."""
        if self._d_in is None:
            self._d_in = X.shape[-1]
        if self._dtype is None:
            self._dtype = X.dtype
        if self._device is None:
            self._device = X.device
        if self._d_out is None:
            with torch.no_grad():
                self._d_out = self.call(X.reshape(-1, *X.shape[-2:])[0] if X.dim() > 2 else X).shape[-1]
        return self

    def call(self, Y: torch.Tensor) -> torch.Tensor:
        try:
            out = self.fn(Y)
        except RuntimeError as exc:
            dtypes = sorted({str(t.dtype) for t in _floating_tensors(self.fn)})
            if "dtype" not in str(exc).lower() or not dtypes or str(Y.dtype) in dtypes:
                raise
            # a module computing in its parameters' dtype (numpy points come as float64): torch's matmul error said
            # "mat1 and mat2 must have the same dtype", naming neither the input nor the fix
            want = dtypes[0].removeprefix("torch.")
            raise TypeError(f"X: dtype {Y.dtype} differs from the parameters of {self.name} ({', '.join(dtypes)}); "
                            f"convert the input (X.to(torch.{want}), or X.astype(np.{want}) for numpy) or the module "
                            f"({self.name}.to(dtype={Y.dtype}))") from exc
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"f: expected it to return a torch tensor, got {type(out).__name__}")
        if out.dim() < 2 or out.shape[-2] != Y.shape[-2]:
            raise ValueError(f"f: expected outputs of shape (n, d') for inputs {tuple(Y.shape)}, "
                             f"got {tuple(out.shape)}")
        return out

    def check_points(self, X, name: str = "X") -> torch.Tensor:
        if not isinstance(X, Measure) and self._d_in is None:
            # a float numpy array keeps its dtype (a float32 module given X.astype(np.float32) gets float32)
            keep = isinstance(X, np.ndarray) and X.dtype.kind == "f" and X.dtype.itemsize >= 4
            X = as_tensor(X, name, dtype=torch_dtype(X.dtype) if keep else None)
            if X.dim() >= 2:
                self.bind(X)
        return super().check_points(X, name)

    def check_measure(self, mu, name: str = "mu", **kwargs) -> Measure:
        if isinstance(mu, Measure) and self._d_in is None:
            self.bind(mu.points)
        return super().check_measure(mu, name, **kwargs)

    def points_map(self, X, log_weights=None, positions=None) -> torch.Tensor:
        if log_weights is not None:
            raise ValueError("log_weights: a points-only operator cannot weigh its keys")
        if X.dim() == 2:
            return self.call(X)
        # a bare callable may not batch: one call per sequence
        flat = X.reshape(-1, *X.shape[-2:])
        return torch.stack([self.call(Y) for Y in flat]).reshape(*X.shape[:-1], -1)

    def evaluate(self, x, keys, log_weights=None, x_positions=None, key_positions=None):
        raise TypeError(f"op: {self!r} only maps whole sequences; it cannot evaluate queries against other keys")


class TorchMultiheadAttention(AttentionOperator):
    """``torch.nn.MultiheadAttention`` as a full operator: self-attention query = key = value, the
    measure's log-weights added to the scores through ``attn_mask`` (a float mask is added before
    the softmax), positions as the causal part of that mask. ``masked`` says whether sequences and
    positioned measures are causal."""

    def __init__(self, module, *, masked: bool = False):
        if not isinstance(module, torch.nn.MultiheadAttention):
            raise TypeError(f"module: expected torch.nn.MultiheadAttention, got {type(module).__name__}")
        # the structure first: a cross-attention module is refused whatever its mode
        if not module._qkv_same_embed_dim:
            raise ValueError(f"module: kdim = {module.kdim}, vdim = {module.vdim} differ from embed_dim = "
                             f"{module.embed_dim}: cross-attention between two spaces, not self-attention on one "
                             "(build it with kdim = vdim = embed_dim, the default)")
        check_bool(masked, "masked")
        _check_deterministic(module)
        self.module, self.masked = module, masked

    d_in = property(lambda self: self.module.embed_dim)
    d_out = property(lambda self: self.module.embed_dim)
    dtype = property(lambda self: next(self.module.parameters()).dtype)
    device = property(lambda self: next(self.module.parameters()).device)

    def __repr__(self) -> str:
        return f"TorchMultiheadAttention(embed_dim={self.d_in}, heads={self.module.num_heads}, masked={self.masked})"

    def to(self, device=None, dtype=None) -> TorchMultiheadAttention:
        """The same layer on ``device`` in ``dtype``, on a copy of the module (the module given is left as it is).
        What a float32 layer's certified constant is checked with, in float64 (:func:`meanfield.local_lipschitz`):
        without it the certificate covered float32 products only, whose rounding at large radii exceeded it."""
        device, dtype = to_arguments(device, dtype)
        dtype, device = float_dtype(dtype), check_device(device)
        if (dtype is None or dtype == self.dtype) and (device is None or torch.device(device) == self.device):
            return self
        twin = copy.deepcopy(self.module).to(device=device, dtype=dtype)
        return TorchMultiheadAttention(twin, masked=self.masked)

    def parameters(self, d: int | None = None):
        """Per head: Q, K, V from ``in_proj_weight`` (rows q | k | v, head h the rows h k..(h+1) k),
        scale 1/sqrt(k), key bias scale K^T b_q, value bias b_v; W_O = ``out_proj.weight``."""
        m = self.module
        caveat = None
        if not m._qkv_same_embed_dim or m.bias_k is not None or m.add_zero_attn:
            caveat = "torch MultiheadAttention with kdim/vdim, bias_k/bias_v or add_zero_attn"
        if not m._qkv_same_embed_dim:
            return None
        E, H = m.embed_dim, m.num_heads
        k = E // H
        W = m.in_proj_weight.detach()
        b = m.in_proj_bias.detach() if m.in_proj_bias is not None else None
        heads = []
        for h in range(H):
            rows = slice(h * k, (h + 1) * k)
            Q, K, V = W[:E][rows], W[E:2 * E][rows], W[2 * E:][rows]
            scale = 1.0 / k ** 0.5
            c = None if b is None else scale * (K.T @ b[:E][rows])
            heads.append(Head(Q, K, V, c, None if b is None else b[2 * E:][rows], scale, "dot"))
        out_b = m.out_proj.bias.detach() if m.out_proj.bias is not None else None
        return Parameters(tuple(heads), m.out_proj.weight.detach(), out_b, self.masked, caveat)

    def evaluate(self, x, keys, log_weights=None, x_positions=None, key_positions=None):
        lead = x.shape[:-2]
        m, n = x.shape[-2], keys.shape[-2]
        xb = x.reshape(-1, m, self.d_in)
        kb = keys.expand(*lead, n, self.d_in).reshape(-1, n, self.d_in)
        mask = additive_mask(m, n, log_weights, x_positions, key_positions, x.dtype, x.device)
        if mask is not None:
            # (b, m, n) -> (b * heads, m, n), the layout nn.MultiheadAttention takes for a 3-D mask
            mask = mask.expand(xb.shape[0], m, n).repeat_interleave(self.module.num_heads, dim=0)
        _check_deterministic(self.module)   # its mode is read at every call, as its weights are
        bf = self.module.batch_first
        q, k = (xb, kb) if bf else (xb.transpose(0, 1), kb.transpose(0, 1))
        # the operator is a fixed map of its inputs: no graph over the module's weights, read at every call
        # (a weight replaced after the operator was built is seen)
        frozen = {n: t.detach() for n, t in (*self.module.named_parameters(), *self.module.named_buffers())}
        out = torch.func.functional_call(self.module, frozen, (q, k, k),
                                         {"attn_mask": mask, "need_weights": False})[0]
        out = (out if bf else out.transpose(0, 1)).reshape(*lead, m, self.d_out)
        # a query that sees no key of positive weight: zero heads, the output projection's bias
        return silence_blind_rows(out, log_weights, x_positions, key_positions, self.module.out_proj.bias)


def _check_deterministic(module) -> None:
    """A module in training mode is random only through a positive dropout: refuse that one, naming it.

    (``nn.MultiheadAttention`` in training mode with ``dropout = 0``, the default, computes the same map as
    in eval mode.)"""
    if module.training and module.dropout > 0:
        raise ValueError(f"module: is in training mode with dropout = {module.dropout} (a random map); call "
                         "module.eval(), or build it with dropout=0.0")


def as_operator(f, *, masked: bool | None = None) -> AttentionOperator:
    """Any attention the framework accepts, as an :class:`AttentionOperator`.

    * a meanfield operator (SelfAttention, MultiHeadAttention, L2SelfAttention, IsotropicAttention,
      a Hugging Face layer already wrapped, ...) is returned as is (``masked`` must agree);
    * a Hugging Face attention module (GPT-2 ``GPT2Attention``, BERT ``BertAttention`` or
      ``BertSelfAttention``) becomes a :class:`meanfield.hf.HFAttention` of the attention alone,
      W_O concat_h f^h + b (weights as additive log-weights, positions as the causal mask): for a
      ``BertAttention`` that is ``output.dense(self(X))``, without the residual and the LayerNorm that
      ``module(X)`` adds (``HFAttention(module, block=True)`` is the module's own map); ``masked`` defaults to
      the module's own mask (:func:`meanfield.hf.own_mask`: causal for GPT-2's attention, for BERT's in a
      decoder), False being the ablation with the same weights;
    * a ``torch.nn.MultiheadAttention`` becomes a :class:`TorchMultiheadAttention` (self-attention:
      ``kdim = vdim = embed_dim``);
    * a Hugging Face module that holds attention but is not a layer (a whole model, a GPT-2 block, a BERT
      layer) is refused with what to pass instead (:func:`meanfield.hf.container_advice`);
    * any other callable X (n, d) -> (n, d') becomes a points-only :class:`CallableOperator`.
    """
    masked = check_bool(masked, "masked", allow_none=True)
    if isinstance(f, AttentionOperator):
        if masked is not None and masked != f.masked:
            raise ValueError(f"masked: {masked} contradicts the operator's own masked={f.masked}")
        return f
    if isinstance(f, torch.nn.MultiheadAttention):
        return TorchMultiheadAttention(f, masked=bool(masked))
    if isinstance(f, torch.nn.Module):
        from . import hf

        if hf.is_hf_attention(f):
            return hf.HFAttention(f, masked=masked)
        advice = hf.container_advice(f)
        if advice is not None:
            raise TypeError(f"f: {advice}")
    if callable(f):
        return CallableOperator(f, masked=bool(masked) if masked is not None else getattr(f, "masked", False))
    raise TypeError(f"f: expected an attention operator, a Hugging Face attention layer, a "
                    f"torch.nn.MultiheadAttention or a callable on tensors, got {type(f).__name__}")
