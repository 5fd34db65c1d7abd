"""Attention operators on sequences and on measures (docs/math.md sections 1, 2 and 5).

Three operators implement the protocol of :mod:`meanfield.operator` (one primitive, ``evaluate``):

* :class:`SelfAttention`: scores s_ij = <A x_i, x_j>, f(X)_i = sum_j softmax_j(s_ij) V x_j
  (Castin et al. 2024, Definition 2.1); masked (causal) variant f^m.
* :class:`MultiHeadAttention`: f_MH(X) = concat_h f^h(X) W_O^T + b (docs/math.md section 1).
* :class:`L2SelfAttention`: the L2 attention of Kim et al. (2021), with tied queries and keys.

Each one acts

* on sequences: ``op.sequence(X)`` maps X (..., n, d) to (..., n, d_out) (leading batch dims);
  masked operators use positions i/n, i.e. keys j <= i;
* on measures: ``op(mu)`` is the pushforward F(mu) = (Gamma_mu)_# mu (weights enter the softmax
  as additive log-weights, positions are kept); ``op.velocity(mu, x)`` is Gamma_mu(x).

Every operator computes through :func:`meanfield.kernels.attend`, which works in log-sum-exp
form, so adversarial inputs with gamma R^2 ~ 1e4 give finite outputs.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from particles.validation import as_tensor, check_bool, check_ndim, float_dtype, to_arguments, torch_dtype

from .kernel_inputs import seen_positions, silence_blind_rows
from .kernels import attend
from .operator import AttentionOperator
from .parameters import Head, Parameters

__all__ = ["SelfAttention", "MultiHeadAttention", "L2SelfAttention"]


def _same_dtype(value, name, dtype, like: str | None):
    """A float tensor parameter must have the operator's dtype (set by ``like``) unless ``dtype=`` was given:
    converting it silently would lose precision (float64 -> float32) or change the requested one."""
    if like is None:
        return
    convert = f"{name}.to({dtype})"
    if isinstance(value, np.ndarray | np.generic) and value.dtype.kind == "f":
        # a float numpy array wider than the operator's dtype would be rounded (float64 values next to float32
        # parameters): refused as a tensor is. A narrower one converts exactly (numpy input makes float64
        # operators, float32 arrays included); lists and integer arrays take the operator's dtype
        given = torch_dtype(value.dtype)
        if torch.finfo(given).eps >= torch.finfo(dtype).eps:
            return
        convert = f"{name}.astype(np.{str(dtype).removeprefix('torch.')})"
        value = torch.empty(0, dtype=given)   # (its dtype, for the check and message below)
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        owner = f"{like}'" if like.endswith("s") else f"{like}'s"
        other = ("the heads (head.to(dtype=...))" if like == "the heads"
                 else f"pass dtype= to convert every parameter (e.g. dtype={value.dtype})")
        raise TypeError(f"{name}: dtype {value.dtype} differs from {owner} {dtype}; convert it ({convert}) "
                        f"or {other}")


def _matrix(value, name, dtype, device=None, shape=None, like=None):
    _same_dtype(value, name, dtype, like)
    t = as_tensor(value, name, dtype=dtype, device=device)
    check_ndim(t, name, 2, "a matrix")
    if t.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty matrix, got shape {tuple(t.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, t.shape)):
            if want is not None and want != got:
                raise ValueError(f"{name}: expected shape {tuple('*' if s is None else s for s in shape)}, "
                                 f"got {tuple(t.shape)} (axis {axis} differs)")
    return t


def _vector(value, name, size, dtype, device, like=None):
    if value is None:
        return None
    _same_dtype(value, name, dtype, like)
    t = as_tensor(value, name, dtype=dtype, device=device)
    check_ndim(t, name, 1, "a vector")
    if t.shape[0] != size:
        raise ValueError(f"{name}: expected {size} entries, got {t.shape[0]}")
    return t


def _add_value_bias(out, b_V, log_weights, x_positions, key_positions):
    """``out + b_V`` on the rows of queries that see a key of positive weight. The value bias passes through
    sum_j P_ij (V x_j + b_V) because a row of P sums to one; a query that sees no key (before every key, or
    every key of weight zero) has a zero head (docs/math.md section 2), so no b_V either: the layer then gives
    its output bias, as torch's MultiheadAttention adapter does."""
    return silence_blind_rows(out + b_V, log_weights, x_positions, key_positions)


class SelfAttention(AttentionOperator):
    """Single-head self-attention f(X)_i = sum_j softmax_j(<A x_i, x_j>) V x_j (docs/math.md section 1).

    Parameters
    ----------
    A : ``(d, d)``
        Score matrix, s_ij = <A x_i, x_j> = x_j^T A x_i (A = K^T Q / sqrt(k)).
    V : ``(d_out, d)``
        Value matrix (may be rectangular).
    masked : bool
        Causal attention f^m: query i sees keys j <= i (on measures: positions s_j <= s_i).
    key_bias : ``(d,)`` or None
        c adding <c, x_j> to every score s_ij (what a query bias b_Q becomes: c = K^T b_Q / sqrt(k)).
    value_bias : ``(d_out,)`` or None
        b added to every output (P is row-stochastic, so b_V passes through unchanged); a query that sees
        no key of positive weight has a zero output, without b (docs/math.md section 2).
    dtype : torch.dtype or None
        Convert the parameters (default: float64 for numpy input and lists, a float tensor's own dtype; the
        other float tensor parameters must have it, a float numpy parameter must not be wider, lists and
        integer arrays take it).
    """

    def __init__(self, A, V, masked=False, *, key_bias=None, value_bias=None, dtype=None):
        dtype = float_dtype(dtype)
        A = _matrix(A, "A", dtype)
        if A.shape[0] != A.shape[1]:
            raise ValueError(f"A: expected a square (d, d) matrix, got shape {tuple(A.shape)}")
        self._init(A, None, V, masked, key_bias, value_bias, None if dtype is not None else "A")

    def _init(self, Qf, Kf, V, masked, key_bias, value_bias, like):
        # scores are <q_i, k_j> with q = X Qf^T and k = X Kf^T (k = X when Kf is None): the factored
        # form keeps a GPT-2 head at k = 64 columns instead of a dense 768 x 768 A.
        check_bool(masked, "masked")
        d = Qf.shape[1]
        self._Qf, self._Kf = Qf, Kf
        self._V = _matrix(V, "V", Qf.dtype, Qf.device, shape=(None, d), like=like)
        self._c = _vector(key_bias, "key_bias", d, Qf.dtype, Qf.device, like)
        self._bV = _vector(value_bias, "value_bias", self._V.shape[0], Qf.dtype, Qf.device, like)
        self.masked = masked

    @classmethod
    def from_qkv(cls, Q, K, V, b_Q=None, b_K=None, b_V=None, scale=None, masked=False, *, dtype=None):
        """Attention with softmax_j(scale <Q x_i + b_Q, K x_j + b_K>) and values V x_j + b_V.

        Q, K are (k, d), V is (d_out, d); ``scale`` defaults to 1/sqrt(k), so A = scale K^T Q.
        Expanding the score, b_K only adds terms independent of j (no effect on the softmax, it is
        checked and dropped); b_Q adds scale <K^T b_Q, x_j> (a key bias); b_V is added to every
        output because each row of P sums to one.
        """
        dtype = float_dtype(dtype)
        like = None if dtype is not None else "Q"
        Q = _matrix(Q, "Q", dtype)
        K = _matrix(K, "K", Q.dtype, Q.device, shape=Q.shape, like=like)
        k = Q.shape[0]
        if scale is None:
            scale = 1.0 / math.sqrt(k)
        if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
            # a string, a bool or a tensor (whose graph float() would drop) is refused by name
            raise TypeError(f"scale: expected a real number, got {type(scale).__name__} {scale!r}")
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale: expected a finite number, got {scale}")
        _vector(b_K, "b_K", k, Q.dtype, Q.device, like)  # validated: it does not change the operator
        bQ = _vector(b_Q, "b_Q", k, Q.dtype, Q.device, like)
        c = None if bQ is None else scale * (K.T @ bQ)
        obj = cls.__new__(cls)
        obj._init(scale * Q, K, V, masked, c, b_V, like)
        return obj

    @classmethod
    def from_head(cls, head: Head, masked: bool = False) -> SelfAttention:
        """The operator of one dot-product head of a :class:`~meanfield.parameters.Parameters` record."""
        if head.kind != "dot":
            raise ValueError(f"head: expected a dot-product head, got kind {head.kind!r}")
        obj = cls.__new__(cls)
        obj._init(head.scale * head.Q, head.K, head.V, masked, head.key_bias, head.value_bias, None)
        return obj

    def parameters(self, d: int | None = None) -> Parameters:
        """One dot-product head: Q = A, K = I (or the factors K, scale Q of ``from_qkv``), scale 1."""
        K = torch.eye(self.d_in, dtype=self.dtype, device=self.device) if self._Kf is None else self._Kf
        return Parameters((Head(self._Qf, K, self._V, self._c, self._bV, 1.0, "dot"),), masked=self.masked)

    # -------------------------------------------------------------- properties
    @property
    def A(self) -> torch.Tensor:
        """The (d, d) score matrix, s_ij = <A x_i, x_j>."""
        return self._Qf if self._Kf is None else self._Kf.T @ self._Qf

    @property
    def V(self) -> torch.Tensor:
        return self._V

    @property
    def key_bias(self) -> torch.Tensor | None:
        return self._c

    @property
    def value_bias(self) -> torch.Tensor | None:
        return self._bV

    @property
    def d_in(self) -> int:
        return self._Qf.shape[1]

    @property
    def d_out(self) -> int:
        return self._V.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._Qf.dtype

    @property
    def device(self) -> torch.device:
        return self._Qf.device

    def to(self, device=None, dtype=None) -> SelfAttention:
        """The same operator with parameters on another device and/or dtype."""
        device, dtype = to_arguments(device, dtype)
        dtype = float_dtype(dtype)
        mv = lambda t: None if t is None else t.to(device=device, dtype=dtype)
        obj = SelfAttention.__new__(SelfAttention)
        obj._Qf, obj._Kf, obj._V, obj._c, obj._bV = map(mv, (self._Qf, self._Kf, self._V, self._c, self._bV))
        obj.masked = self.masked
        return obj

    def __repr__(self) -> str:
        kind = "masked, " if self.masked else ""
        return f"SelfAttention({kind}d_in={self.d_in}, d_out={self.d_out}, dtype={self.dtype})"

    # -------------------------------------------------------------- computation
    def _qkv(self, xq, xk, log_weights):
        """Queries, keys, values and the additive key scores (log-weights + <c, x_j>)."""
        q = xq @ self._Qf.T
        k = xk if self._Kf is None else xk @ self._Kf.T
        v = xk @ self._V.T
        lw = log_weights
        if self._c is not None:
            ck = xk @ self._c
            lw = ck if lw is None else lw + ck
        return q, k, v, lw

    def evaluate(self, x, keys, log_weights=None, x_positions=None, key_positions=None):
        q, k, v, lw = self._qkv(x, keys, log_weights)
        out = attend(q, k, v, lw, x_positions, key_positions)
        return out if self._bV is None else _add_value_bias(out, self._bV, log_weights, x_positions, key_positions)


class MultiHeadAttention(AttentionOperator):
    """Multi-head attention f_MH(X) = concat_h f^h(X) W_O^T + bias (docs/math.md section 1).

    Two ways to build it::

        MultiHeadAttention(heads, W_O, bias=None)                     # heads: SelfAttention operators
        MultiHeadAttention([A1, A2], [V1, V2], W_O=W_O, masked=False) # score and value matrices per head

    ``heads`` is a list of :class:`SelfAttention` sharing the input dimension d and the masking
    (V^h of shape (k_h, d)); with matrices, head h is ``SelfAttention(A_h, V_h, masked=masked)``.
    ``W_O`` is (d_out, sum_h k_h), applied as W_O^T (torch.nn.Linear's layout; :class:`L2SelfAttention` follows
    Kim et al. and takes the transpose, (H k_v, D_out)); ``bias`` is (d_out,). Heads with the same shapes are evaluated
    together in one batched kernel call.
    """

    def __init__(self, heads, *args, W_O=None, bias=None, masked=None, dtype=None):
        heads, W_O, bias = self._heads_from(heads, args, W_O, bias, masked, dtype)
        if W_O is None:
            raise TypeError("W_O: the output matrix (d_out, sum of the heads' value sizes) is required")
        for h, head in enumerate(heads):
            if head.d_in != heads[0].d_in:
                raise ValueError(f"heads[{h}]: input dimension {head.d_in} differs from heads[0]'s {heads[0].d_in}")
            if head.masked != heads[0].masked:
                raise ValueError(f"heads[{h}]: masked={head.masked} differs from heads[0] (all heads must agree)")
            if head.dtype != heads[0].dtype:
                raise TypeError(f"heads[{h}]: dtype {head.dtype} differs from heads[0]'s {heads[0].dtype}; convert the "
                                f"heads to one dtype (heads[{h}].to(dtype={heads[0].dtype}))")
            if head.device != heads[0].device:
                raise ValueError(f"heads[{h}]: device {head.device} differs from heads[0]'s {heads[0].device}; move "
                                 f"the heads to one device (heads[{h}].to({str(heads[0].device)!r}))")
        self.heads = heads
        self.masked = heads[0].masked
        width = sum(h.d_out for h in heads)
        self._W_O = _matrix(W_O, "W_O", heads[0].dtype, heads[0].device, shape=(None, width), like="the heads")
        self._b = _vector(bias, "bias", self._W_O.shape[0], heads[0].dtype, heads[0].device, "the heads")
        # heads evaluated in one kernel call when they have the same shapes
        self._stack = self._stackable()

    @classmethod
    def from_parameters(cls, p: Parameters, masked: bool | None = None) -> SelfAttention | MultiHeadAttention:
        """The operator of a :class:`~meanfield.parameters.Parameters` record of dot-product heads: a
        MultiHeadAttention (a SelfAttention for one head without W_O and bias). ``masked`` defaults to
        the record's."""
        if p.kind != "dot":
            raise ValueError("p: only dot-product heads convert to SelfAttention (L2 heads: meanfield.L2SelfAttention)")
        masked = p.masked if masked is None else check_bool(masked, "masked")
        heads = [SelfAttention.from_head(h, masked=masked) for h in p.heads]
        if p.W_O is None and len(heads) == 1 and p.bias is None:
            return heads[0]
        W_O = p.W_O if p.W_O is not None else torch.eye(sum(h.V.shape[0] for h in p.heads), dtype=p.heads[0].Q.dtype,
                                                       device=p.heads[0].Q.device)
        return cls(heads, W_O, bias=p.bias)

    @staticmethod
    def _heads_from(heads, args, W_O, bias, masked, dtype):
        """(list of SelfAttention heads, W_O, bias) from either construction form (class docstring)."""
        if isinstance(heads, (SelfAttention, torch.Tensor, np.ndarray)) or not hasattr(heads, "__iter__"):
            raise TypeError("heads: expected a list of SelfAttention operators, or a list of score matrices "
                            "[A1, A2, ...] followed by the value matrices [V1, V2, ...] (then W_O=...)")
        heads = list(heads)
        if not heads:
            raise ValueError("heads: expected at least one head")
        if all(isinstance(h, SelfAttention) for h in heads):
            if len(args) > 2:
                raise TypeError(f"MultiHeadAttention(heads, W_O, bias): {2 + len(args)} positional arguments given")
            if masked is not None or dtype is not None:
                raise TypeError("masked, dtype: set them on the SelfAttention heads (or use the matrix form "
                                "MultiHeadAttention([A1, A2], [V1, V2], W_O=..., masked=...))")
            given = list(args) + [None] * (2 - len(args))
            for name, pos, kw in (("W_O", given[0], W_O), ("bias", given[1], bias)):
                if pos is not None and kw is not None:
                    raise TypeError(f"{name}: given twice (positionally and by keyword)")
            return heads, given[0] if W_O is None else W_O, given[1] if bias is None else bias
        for h, head in enumerate(heads):
            if isinstance(head, SelfAttention):
                raise TypeError(f"heads[{h}]: mixes a SelfAttention with matrices; give all heads one way")
        if len(args) != 1:
            raise TypeError("heads: matrices given as heads; the form is MultiHeadAttention([A1, A2, ...], "
                            "[V1, V2, ...], W_O=..., bias=None, masked=False) with one value matrix per head")
        values = args[0]
        if isinstance(values, torch.Tensor) and values.dim() == 3:
            values = list(values)
        values = list(values) if hasattr(values, "__iter__") else None
        if values is None or len(values) != len(heads):
            raise ValueError(f"V: expected one value matrix per head ({len(heads)}), got "
                             f"{'none' if values is None else len(values)}")
        masked = False if masked is None else check_bool(masked, "masked")
        return [SelfAttention(A, V, masked=masked, dtype=dtype) for A, V in zip(heads, values)], W_O, bias

    def _stackable(self):
        h0 = self.heads[0]
        same = all(h._Qf.shape == h0._Qf.shape and (h._Kf is None) == (h0._Kf is None)
                   and (h._Kf is None or h._Kf.shape == h0._Kf.shape) and h.d_out == h0.d_out
                   for h in self.heads)
        if not same:
            return None
        Qs = torch.stack([h._Qf for h in self.heads])
        Ks = None if h0._Kf is None else torch.stack([h._Kf for h in self.heads])
        Vs = torch.stack([h._V for h in self.heads])
        cs = None
        if any(h._c is not None for h in self.heads):
            cs = torch.stack([h._c if h._c is not None else torch.zeros_like(h0._Qf[0]) for h in self.heads])
        bVs = None
        if any(h._bV is not None for h in self.heads):
            bVs = torch.cat([h._bV if h._bV is not None else torch.zeros_like(h._V[:, 0]) for h in self.heads])
        # one (rows, d) matrix for queries, keys, values and key-bias scores of every head: a single GEMM
        # per call is several times faster on CPU than per-projection einsums over a head axis
        blocks = [Qs.flatten(0, 1)] + ([] if Ks is None else [Ks.flatten(0, 1)]) + [Vs.flatten(0, 1)]
        blocks += [] if cs is None else [cs]
        fused = torch.cat(blocks)
        return Qs, Ks, Vs, cs, bVs, fused

    @property
    def W_O(self) -> torch.Tensor:
        return self._W_O

    @property
    def bias(self) -> torch.Tensor | None:
        return self._b

    def parameters(self, d: int | None = None) -> Parameters:
        """The heads' records, W_O and the output bias."""
        return Parameters(tuple(h.parameters().heads[0] for h in self.heads), self._W_O, self._b, self.masked)

    @property
    def d_in(self) -> int:
        return self.heads[0].d_in

    @property
    def d_out(self) -> int:
        return self._W_O.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._W_O.dtype

    @property
    def device(self) -> torch.device:
        return self._W_O.device

    def to(self, device=None, dtype=None) -> MultiHeadAttention:
        device, dtype = to_arguments(device, dtype)
        mv = lambda t: None if t is None else t.to(device=device, dtype=float_dtype(dtype))
        return MultiHeadAttention([h.to(device, dtype) for h in self.heads], mv(self._W_O), mv(self._b))

    def __repr__(self) -> str:
        kind = "masked, " if self.masked else ""
        return f"MultiHeadAttention({kind}heads={len(self.heads)}, d_in={self.d_in}, d_out={self.d_out})"

    def evaluate(self, x, keys, log_weights=None, x_positions=None, key_positions=None):
        if self._stack is None:
            outs = [h.evaluate(x, keys, log_weights, x_positions, key_positions) for h in self.heads]
            concat = torch.cat(outs, dim=-1)
        else:
            Qs, Ks, Vs, cs, bVs, fused = self._stack
            H, kq, kv = Qs.shape[0], Qs.shape[1], Vs.shape[1]

            def heads(t, size):  # (..., n, H * size) -> (..., H, n, size): attend batches over heads
                return t.unflatten(-1, (H, size)).transpose(-3, -2)

            if x is keys:
                proj = keys @ fused.T
                q, rest = proj[..., : H * kq], proj[..., H * kq:]
            else:
                q, rest = x @ fused[: H * kq].T, keys @ fused[H * kq:].T
            q = heads(q, kq)
            if Ks is None:
                k = keys.unsqueeze(-3)
            else:
                k, rest = heads(rest[..., : H * kq], kq), rest[..., H * kq:]
            v = heads(rest[..., : H * kv], kv)
            lw = None if log_weights is None else log_weights.unsqueeze(-2)
            if cs is not None:
                ck = rest[..., H * kv:].transpose(-1, -2)  # (..., H, n): <c_h, x_j>
                lw = ck if lw is None else lw + ck
            qp = None if x_positions is None else x_positions.unsqueeze(-2)
            kp = None if key_positions is None else key_positions.unsqueeze(-2)
            out = attend(q, k, v, lw, qp, kp)  # (..., H, m, k_v)
            concat = out.transpose(-3, -2).reshape(*out.shape[:-3], out.shape[-2], -1)
            if bVs is not None:
                concat = _add_value_bias(concat, bVs, log_weights, x_positions, key_positions)
        out = concat @ self._W_O.T
        return out if self._b is None else out + self._b


class L2SelfAttention(AttentionOperator):
    """L2 multi-head self-attention of Kim, Papamakarios & Mnih (2021), tied queries and keys.

    Layout follows Kim et al. (rows are tokens, X of shape (N, D), weights act on the right)::

        P^h_ij = softmax_j( -|x_i^T W_Q^h - x_j^T W_Q^h|^2 / sqrt(D/H) ),
        F^h(X) = P^h X A_h,   A_h = W_Q^h W_Q^h^T / sqrt(D/H)     (D x D),
        f(X)   = [F^1(X) W_V^1, ..., F^H(X) W_V^H] W_O (+ bias).

    Through the kernel: ``-|q_i - q_j|^2 = -|q_i|^2 + 2 <q_i, q_j> - |q_j|^2`` and the first term
    cancels in the softmax, so queries are 2 q_i / sqrt(k), keys q_j and the additive key score
    is ``-|q_j|^2 / sqrt(k)``.

    Parameters
    ----------
    W_Q : ``(H, D, k)`` or ``(D, k)``
        Tied query/key weights of each head; sqrt(D/H) is taken as sqrt(k), the head size.
    W_V : ``(H, D, k_v)`` or ``(D, k_v)``
        Value weights (applied after A_h).
    W_O : ``(H k_v, D_out)`` or None
        Output weights, applied on the right (None: the identity, i.e. plain concatenation). Kim et al.'s layout,
        the transpose of :class:`MultiHeadAttention`'s ``W_O`` (``(d_out, sum_h k_h)``, applied as ``W_O^T``):
        a square matrix is accepted by both, so pass ``W.T`` when moving one from there.
    bias : ``(D_out,)`` or None
    masked : bool
        Causal variant (keys j <= i; positions for measures).
    dtype : torch.dtype or None
        Convert the parameters, as for :class:`SelfAttention` (default: float64 for numpy input and lists, a float
        tensor's own dtype, which the other float parameters must then have).
    """

    def __init__(self, W_Q, W_V, W_O=None, bias=None, masked=False, *, dtype=None):
        dtype = float_dtype(dtype)
        WQ = as_tensor(W_Q, "W_Q", dtype=dtype)
        if WQ.dim() == 2:
            WQ = WQ.unsqueeze(0)
        if WQ.dim() != 3:
            raise ValueError(f"W_Q: expected shape (H, D, k) or (D, k), got {tuple(WQ.shape)}")
        H, D, k = WQ.shape
        if H == 0 or D == 0 or k == 0:
            raise ValueError(f"W_Q: expected at least one head, input coordinate and query coordinate, got shape "
                             f"{tuple(WQ.shape)}")
        like = None if dtype is not None else "W_Q"
        _same_dtype(W_V, "W_V", WQ.dtype, like)
        WV = as_tensor(W_V, "W_V", dtype=WQ.dtype, device=WQ.device)
        if WV.dim() == 2:
            WV = WV.unsqueeze(0)
        if WV.dim() != 3 or WV.shape[:2] != (H, D):
            raise ValueError(f"W_V: expected shape ({H}, {D}, k_v) to match W_Q's (H, D), got {tuple(WV.shape)}")
        check_bool(masked, "masked")
        width = H * WV.shape[2]
        if W_O is None:
            WO = torch.eye(width, dtype=WQ.dtype, device=WQ.device)
        else:
            WO = _matrix(W_O, "W_O", WQ.dtype, WQ.device, shape=(width, None), like=like)
        self._WQ, self._WV, self._WO = WQ, WV, WO
        self._b = _vector(bias, "bias", WO.shape[1], WQ.dtype, WQ.device, like)
        self.masked = masked
        self._scale = 1.0 / math.sqrt(k)
        # value map of each head: x -> x^T A_h W_V^h
        self._AV = self._scale * WQ @ WQ.transpose(-1, -2) @ WV  # (H, D, k_v)

    @property
    def W_Q(self) -> torch.Tensor:
        return self._WQ

    @property
    def W_V(self) -> torch.Tensor:
        return self._WV

    @property
    def W_O(self) -> torch.Tensor:
        return self._WO

    @property
    def num_heads(self) -> int:
        return self._WQ.shape[0]

    def parameters(self, d: int | None = None) -> Parameters:
        """L2 heads (Q = K = W_Q^h^T, V = W_V^h^T, scale 1/sqrt(k)); W_O in the (d_out, H k_v) layout."""
        heads = tuple(Head(q.T, q.T, v.T, None, None, self._scale, "l2") for q, v in zip(self._WQ, self._WV))
        return Parameters(heads, self._WO.T, self._b, self.masked)

    @property
    def d_in(self) -> int:
        return self._WQ.shape[1]

    @property
    def d_out(self) -> int:
        return self._WO.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self._WQ.dtype

    @property
    def device(self) -> torch.device:
        return self._WQ.device

    def to(self, device=None, dtype=None) -> L2SelfAttention:
        device, dtype = to_arguments(device, dtype)
        dtype = float_dtype(dtype)
        mv = lambda t: None if t is None else t.to(device=device, dtype=dtype)
        return L2SelfAttention(mv(self._WQ), mv(self._WV), mv(self._WO), mv(self._b), self.masked)

    def __repr__(self) -> str:
        kind = "masked, " if self.masked else ""
        return f"L2SelfAttention({kind}heads={self.num_heads}, d_in={self.d_in}, d_out={self.d_out})"

    def evaluate(self, x, keys, log_weights=None, x_positions=None, key_positions=None):
        qq = torch.einsum("...md,hdk->...hmk", x, self._WQ)
        kk = torch.einsum("...nd,hdk->...hnk", keys, self._WQ)
        v = torch.einsum("...nd,hdk->...hnk", keys, self._AV)
        # -|q_i - k_j|^2 = 2 <q_i - c, k_j - c> - |k_j - c|^2 + (a term of row i alone) for any c: near the keys,
        # so that tokens far from the origin (radius R) lose no accuracy to terms of size R^2 that cancel
        # (float32 at R = 1e4 lost the weights). The value does not depend on c, nor do its derivatives. With
        # positions, c is the key of positive weight at the first position, which every query that sees a key sees
        # (the keys' mean would carry later keys into earlier outputs through rounding); else the keys' weighted
        # mean. Keys of zero weight are not in the measure: a far one (|x| = 1e6) moved c and changed the output
        c = kk.detach()
        seen = None if log_weights is None else log_weights.detach() > -math.inf
        if key_positions is None:
            if seen is None:
                c = c.mean(dim=-2, keepdim=True)
            else:
                w = torch.nan_to_num(torch.softmax(log_weights.detach(), dim=-1), nan=1.0 / c.shape[-2])
                c = (w.unsqueeze(-2).unsqueeze(-1) * c).sum(dim=-2, keepdim=True)
        else:
            first = seen_positions(key_positions.detach(), seen).argmin(dim=-1).expand(kk.shape[:-3])   # (...,)
            c = torch.gather(c, -2, first[..., None, None, None].expand(*kk.shape[:-2], 1, kk.shape[-1]))
        qq, kk = qq - c, kk - c
        key_term = -self._scale * (kk * kk).sum(-1)  # (..., H, n)
        lw = key_term if log_weights is None else key_term + log_weights.unsqueeze(-2)
        qp = None if x_positions is None else x_positions.unsqueeze(-2)
        kp = None if key_positions is None else key_positions.unsqueeze(-2)
        out = attend(2.0 * self._scale * qq, kk, v, lw, qp, kp)  # (..., H, m, k_v)
        concat = out.transpose(-3, -2).reshape(*out.shape[:-3], out.shape[-2], -1)
        out = concat @ self._WO
        return out if self._b is None else out + self._b
