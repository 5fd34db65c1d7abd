"""The operator protocol: what every attention map of the framework is (docs/math.md section 2).

An attention operator acts on sequences (the discrete map f) and on measures (the pushforward F).
Every operator implements ONE primitive (and, to be read by the theory, ``parameters()``),

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

:func:`as_operator` turns what users pass into an operator: a meanfield operator (returned as
is), a Hugging Face attention layer (:mod:`meanfield.hf`), a ``torch.nn.MultiheadAttention``, or a
bare callable X (n, d) -> (n, d'). A bare callable cannot weigh its keys, so it is *points-only*:
it acts on sequences and on uniform, unpositioned measures, and a weighted or positioned measure
given to it is an error (its weights would otherwise be silently dropped).
"""

from __future__ import annotations

import torch

from particles import Measure
from particles.validation import as_tensor, check_bool

__all__ = ["AttentionOperator", "CallableOperator", "TorchMultiheadAttention", "as_operator",
           "sequence_positions"]


def sequence_positions(n: int, like: torch.Tensor) -> torch.Tensor:
    """Positions s_i = i/n, i = 1..n: the masked measure of a sequence (docs/math.md section 2)."""
    return torch.arange(1, n + 1, dtype=like.dtype, device=like.device) / n


class AttentionOperator:
    """Base class of the operator protocol (see the module docstring).

    Subclasses set ``masked`` and implement :meth:`evaluate`, ``d_in``, ``d_out``, ``dtype`` and
    ``device``; :meth:`to` is optional. ``d_in``, ``dtype`` or ``device`` may be None for an operator
    that accepts any (the sphere models act in every dimension; ``d_out`` None means d_in). They
    inherit ``points_map``, ``sequence``, ``__call__``, ``velocity`` and the input checks.
    """

    masked: bool = False
    #: True for operators that cannot weigh keys (bare callables): measures must be uniform, unpositioned
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

    def parameters(self, d: int | None = None):
        """What the operator is made of: a :class:`~meanfield.parameters.Parameters` record (per head
        Q, K, V, biases, scale and kind; W_O and the output bias), which the bounds, the worst-case
        starts and the dynamics read; None for an operator that is not made of softmax heads the
        framework can read (a bare callable: the theory then says it cannot bound it). ``d`` is the
        token dimension, needed only by operators that act in every dimension
        (:class:`~meanfield.SphereAttention`)."""
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
        """The discrete map f(X) (f^m if masked): X (..., n, d_in) -> (..., n, d_out)."""
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
            p = as_tensor(positions, "positions", dtype=x.dtype, device=x.device)
            if p.shape != lead:
                raise ValueError(f"positions: expected shape {tuple(lead)} (one per point), got {tuple(p.shape)}")
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
            X = as_tensor(X, name, dtype=self.dtype, device=self.device)
        else:
            X = as_tensor(X, name)
        if X.dim() == 0 or (self.d_in is not None and X.shape[-1] != self.d_in):
            raise ValueError(f"{name}: expected last dimension {self.d_in} (the operator's input dimension), "
                             f"got shape {tuple(X.shape)}")
        if self.dtype is not None and X.dtype != self.dtype:
            raise TypeError(f"{name}: dtype {X.dtype} differs from the operator's {self.dtype}; convert the input "
                            f"({name}.to({self.dtype})) or the operator (op.to(dtype={X.dtype}))")
        if self.device is not None and X.device != self.device:
            raise ValueError(f"{name}: on device {X.device}, the operator is on {self.device} "
                             f"(move one of them: {name}.to('{self.device}') or op.to('{X.device}'))")
        return X

    def check_measure(self, mu, name: str = "mu") -> Measure:
        """mu as a Measure this operator can act on, or a clear error naming ``name``."""
        if not isinstance(mu, Measure):
            raise TypeError(f"{name}: expected a particles.Measure, got {type(mu).__name__} "
                            "(use op.sequence(X) for tensors)")
        if self.d_in is not None and mu.dim != self.d_in:
            raise ValueError(f"{name}: atoms have dimension {mu.dim}, the operator expects {self.d_in}")
        if self.dtype is not None and mu.dtype != self.dtype:
            raise TypeError(f"{name}: dtype {mu.dtype} differs from the operator's {self.dtype}; convert the "
                            f"measure ({name}.to(dtype={self.dtype})) or the operator (op.to(dtype={mu.dtype}))")
        if self.device is not None and mu.device != self.device:
            raise ValueError(f"{name}: on device {mu.device}, the operator is on {self.device} "
                             f"(move one of them with .to(device))")
        if self.masked and mu.positions is None:
            raise ValueError(f"{name}: a masked operator needs a measure with positions "
                             "(build it with Measure.sequence(X) or positions=...)")
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
    if out.numel() and not bool(torch.isfinite(out.detach()).all()):
        raise FloatingPointError(f"{what}: the output is not finite: the attention scores overflow "
                                 f"{out.dtype} at this input (|score| beyond the dtype's range)")
    return out


class CallableOperator(AttentionOperator):
    """A bare callable X (n, d_in) -> (n, d_out) as a points-only operator.

    It maps sequences (``sequence``), uniform unpositioned measures (``op(mu)``) and is what
    :func:`meanfield.local_lipschitz` differentiates; it has no velocity field at other points and
    refuses weighted or positioned measures (see the module docstring). ``masked`` records whether
    the callable is causal (it applies its own mask; no positions are passed to it).
    ``dtype``/``device``/``d_in`` are taken from the first input it sees unless given.
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
        out = self.fn(Y)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"f: expected it to return a torch tensor, got {type(out).__name__}")
        if out.dim() < 2 or out.shape[-2] != Y.shape[-2]:
            raise ValueError(f"f: expected outputs of shape (n, d') for inputs {tuple(Y.shape)}, "
                             f"got {tuple(out.shape)}")
        return out

    def check_points(self, X, name: str = "X") -> torch.Tensor:
        if not isinstance(X, Measure) and self._d_in is None:
            X = as_tensor(X, name)
            if X.dim() >= 2:
                self.bind(X)
        return super().check_points(X, name)

    def check_measure(self, mu, name: str = "mu") -> Measure:
        if isinstance(mu, Measure) and self._d_in is None:
            self.bind(mu.points)
        return super().check_measure(mu, name)

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
        if module.training:
            raise ValueError("module: is in training mode (dropout makes it random); call module.eval()")
        if not module._qkv_same_embed_dim:
            raise ValueError(f"module: kdim = {module.kdim}, vdim = {module.vdim} differ from embed_dim = "
                             f"{module.embed_dim}: cross-attention between two spaces, not self-attention on one "
                             "(build it with kdim = vdim = embed_dim, the default)")
        check_bool(masked, "masked")
        self.module, self.masked = module, masked
        p = next(module.parameters())
        self._dtype, self._device = p.dtype, p.device
        # the operator is a fixed map of its inputs: no graph over the module's weights
        self._frozen = {n: t.detach() for n, t in (*module.named_parameters(), *module.named_buffers())}

    d_in = property(lambda self: self.module.embed_dim)
    d_out = property(lambda self: self.module.embed_dim)
    dtype = property(lambda self: self._dtype)
    device = property(lambda self: self._device)

    def __repr__(self) -> str:
        return f"TorchMultiheadAttention(embed_dim={self.d_in}, heads={self.module.num_heads}, masked={self.masked})"

    def parameters(self, d: int | None = None):
        """Per head: Q, K, V from ``in_proj_weight`` (rows q | k | v, head h the rows h k..(h+1) k),
        scale 1/sqrt(k), key bias scale K^T b_q, value bias b_v; W_O = ``out_proj.weight``."""
        from .parameters import Head, Parameters

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
        bf = self.module.batch_first
        q, k = (xb, kb) if bf else (xb.transpose(0, 1), kb.transpose(0, 1))
        out = torch.func.functional_call(self.module, self._frozen, (q, k, k),
                                         {"attn_mask": mask, "need_weights": False})[0]
        out = out if bf else out.transpose(0, 1)
        return out.reshape(*lead, m, self.d_out)


def additive_mask(m, n, log_weights, q_pos, k_pos, dtype, device):
    """The (..., m, n) additive score mask log a_j (+ a very negative number where s_j > t_i), or None.

    Masked entries get the dtype's most negative finite value, as Hugging Face's eager attention
    does, so that no softmax row is all -inf (every query sees at least one key in a valid measure).
    """
    if log_weights is None and q_pos is None:
        return None
    low = torch.finfo(dtype).min
    mask = torch.zeros(m, n, dtype=dtype, device=device)
    if log_weights is not None:
        lw = log_weights.to(dtype)
        mask = mask + torch.where(torch.isfinite(lw), lw, torch.full_like(lw, low)).unsqueeze(-2)
    if q_pos is not None:
        visible = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
        mask = torch.where(visible, mask, torch.full_like(mask, low))
    return mask


def as_operator(f, *, masked: bool | None = None) -> AttentionOperator:
    """Any attention the framework accepts, as an :class:`AttentionOperator`.

    * a meanfield operator (SelfAttention, MultiHeadAttention, L2SelfAttention, SphereAttention,
      a Hugging Face layer already wrapped, ...) is returned as is (``masked`` must agree);
    * a Hugging Face attention module (GPT-2 ``GPT2Attention``, BERT ``BertAttention`` or
      ``BertSelfAttention``) becomes a :class:`meanfield.hf.HFAttention` (weights as additive
      log-weights, positions as the causal mask); ``masked`` defaults to False for a module given
      alone (use ``HFAttention.from_model(model, layer)`` for the model's own mask);
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
            return hf.HFAttention(f, masked=bool(masked))
        advice = hf.container_advice(f)
        if advice is not None:
            raise TypeError(f"f: {advice}")
    if callable(f):
        return CallableOperator(f, masked=bool(masked) if masked is not None else getattr(f, "masked", False))
    raise TypeError(f"f: expected an attention operator, a Hugging Face attention layer, a "
                    f"torch.nn.MultiheadAttention or a callable on tensors, got {type(f).__name__}")
