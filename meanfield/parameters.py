"""What an attention operator is made of: the record ``op.parameters()`` returns (docs/math.md section 1).

The operator protocol (:mod:`meanfield.operator`) says what an operator *does* (``evaluate``); the
theory needs what it *is*: per head the query, key and value maps, biases and scale, then the
output matrix. Every operator of the framework returns one :class:`Parameters` record, and the
bounds (:mod:`meanfield.upper`), the worst-case starts (:mod:`meanfield.starts`) and the dynamics'
rescaling read only that record, never the operator's class. A new operator is one class:
``evaluate`` plus ``parameters``. Operators that are not made of softmax heads (a bare callable)
return None, and the theory then says it cannot bound them.

A head of kind ``"dot"`` (Vaswani et al.; Castin et al. section 2) maps queries x and keys y to::

    scores   scale <Q x, K y> + <c, y>          (c: the key bias; a query bias b_Q gives c = scale K^T b_Q,
                                                 a key bias b_K adds a term in x alone: no effect)
    values   V y + b_V

so that its score matrix is A = scale K^T Q (s_ij = <A x_i, x_j> + <c, x_j>). A head of kind
``"l2"`` (Kim et al. 2021, tied queries and keys) has scores ``-scale |Q x - Q y|^2`` and values
``V (scale Q^T Q) y``; the bilinear part of its scores is A = 2 scale Q^T Q. The layer is::

    f(X) = concat_h head_h(X) W_O^T + bias        (W_O None: plain concatenation; one head: the head)
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass, field

import torch

from particles.validation import check_bool, to_arguments

__all__ = ["Head", "Parameters", "KINDS"]

KINDS = ("dot", "l2")


@dataclass(frozen=True)
class Head:
    """One attention head (module docstring).

    Every tensor is a floating-point tensor of finite entries and of the shape below; anything else is
    an error naming the field (a record is what the bounds read: nothing is coerced).

    Attributes
    ----------
    Q : torch.Tensor
        The (k, d) query map.
    K : torch.Tensor
        The (k, d) key map (for ``"l2"``, K is Q: tied, and a different K is an error).
    V : torch.Tensor
        The (k_v, d) value map.
    key_bias : torch.Tensor or None
        The vector c (d,) of the score term <c, y>.
    value_bias : torch.Tensor or None
        Added to every value, (k_v,) (a query that sees no key has a zero head, without it).
    scale : float
        The factor on <Q x, K y>.
    kind : str
        "dot" or "l2".
    """

    Q: torch.Tensor
    K: torch.Tensor
    V: torch.Tensor
    key_bias: torch.Tensor | None = None
    value_bias: torch.Tensor | None = None
    scale: float = 1.0
    kind: str = "dot"

    def __post_init__(self):
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        for name in ("Q", "K", "V", "key_bias", "value_bias"):
            t = getattr(self, name)
            if t is None and name in ("key_bias", "value_bias"):
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
        if self.Q.dim() != 2 or self.K.shape != self.Q.shape:
            raise ValueError(f"Q, K: expected two (k, d) matrices of one shape, got {tuple(self.Q.shape)} and "
                             f"{tuple(self.K.shape)}")
        if self.V.dim() != 2 or self.V.shape[1] != self.Q.shape[1]:
            raise ValueError(f"V: expected a (k_v, {self.Q.shape[1]}) matrix, got {tuple(self.V.shape)}")
        for name, size in (("key_bias", self.Q.shape[1]), ("value_bias", self.V.shape[0])):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (size,):
                raise ValueError(f"{name}: expected a vector of {size} entries, got shape {tuple(t.shape)}")
        for name in ("Q", "K", "V", "key_bias", "value_bias"):
            t = getattr(self, name)
            if t is not None and not bool(torch.isfinite(t.detach()).all()):
                raise ValueError(f"{name}: contains NaN or infinite entries")
        if isinstance(self.scale, bool) or not isinstance(self.scale, numbers.Real):
            raise TypeError(f"scale: expected a real number, got {type(self.scale).__name__} {self.scale!r}")
        if not math.isfinite(self.scale):
            raise ValueError(f"scale: expected a finite number, got {self.scale}")
        if self.kind == "l2" and not torch.equal(self.K, self.Q):
            raise ValueError("K: an L2 head ties queries and keys (scores -scale |Q x - Q y|^2); expected K equal "
                             "to Q, got a different matrix")

    @property
    def dim(self) -> int:
        """The token dimension d."""
        return self.Q.shape[1]

    @property
    def A(self) -> torch.Tensor:
        """The (d, d) bilinear part of the scores, s(x, y) = <A x, y> + (terms in x alone or y alone)."""
        if self.kind == "l2":
            return 2.0 * self.scale * (self.Q.T @ self.Q)
        return self.scale * (self.K.T @ self.Q)

    @property
    def value_map(self) -> torch.Tensor:
        """The (k_v, d) linear map from a key to its value (V, or V scale Q^T Q for L2 heads)."""
        if self.kind == "l2":
            return self.V @ (self.scale * (self.Q.T @ self.Q))
        return self.V

    def to(self, device=None, dtype=None) -> Head:
        device, dtype = to_arguments(device, dtype)
        mv = lambda t: None if t is None else t.to(device=device, dtype=dtype)
        return Head(mv(self.Q), mv(self.K), mv(self.V), mv(self.key_bias), mv(self.value_bias), self.scale,
                    self.kind)


@dataclass(frozen=True)
class Parameters:
    """The parameters of one attention operator (module docstring).

    Attributes
    ----------
    heads : tuple of Head
        The heads, in the order of the concatenation.
    W_O : torch.Tensor or None
        (d_out, sum_h k_v_h); None: plain concatenation (for one head, the head itself).
    bias : torch.Tensor or None
        (d_out,), added to every output.
    masked : bool
        Whether the operator is causal (True or False only).
    caveat : str or None
        None when the operator is exactly this attention; otherwise why it is not (the whole Hugging
        Face block with its LayerNorm and residual, the unnormalized USA model, ...): the bounds then
        do not apply, but the heads still describe its attention (worst-case starts).
    """

    heads: tuple[Head, ...]
    W_O: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    masked: bool = False
    caveat: str | None = None
    _legacy: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.heads, Head) or not hasattr(self.heads, "__iter__"):
            raise TypeError(f"heads: expected a sequence of Head records, got {type(self.heads).__name__}")
        object.__setattr__(self, "heads", tuple(self.heads))
        if not self.heads:
            raise ValueError("heads: expected at least one head")
        for h, head in enumerate(self.heads):
            if not isinstance(head, Head):
                raise TypeError(f"heads[{h}]: expected a Head, got {type(head).__name__}")
            if head.dim != self.heads[0].dim:
                raise ValueError(f"heads[{h}]: token dimension {head.dim} differs from heads[0]'s "
                                 f"{self.heads[0].dim} (every head reads the same tokens)")
        object.__setattr__(self, "masked", check_bool(self.masked, "masked"))
        if self.caveat is not None and not isinstance(self.caveat, str):
            raise TypeError(f"caveat: expected None or a string, got {type(self.caveat).__name__}")
        width = sum(h.V.shape[0] for h in self.heads)
        for name in ("W_O", "bias"):
            t = getattr(self, name)
            if t is not None and not (isinstance(t, torch.Tensor) and t.is_floating_point()):
                got = f"a tensor of dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"{name}: expected None or a floating-point torch tensor, got {got}")
        if self.W_O is not None and (self.W_O.dim() != 2 or self.W_O.shape[1] != width):
            raise ValueError(f"W_O: expected (d_out, {width}) for heads of value sizes "
                             f"{[h.V.shape[0] for h in self.heads]}, got {tuple(self.W_O.shape)}")
        d_out = width if self.W_O is None else self.W_O.shape[0]
        if self.bias is not None and tuple(self.bias.shape) != (d_out,):
            raise ValueError(f"bias: expected a vector of d_out = {d_out} entries, got shape {tuple(self.bias.shape)}")
        for name in ("W_O", "bias"):
            t = getattr(self, name)
            if t is not None and not bool(torch.isfinite(t.detach()).all()):
                raise ValueError(f"{name}: contains NaN or infinite entries")

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def dim(self) -> int:
        """The token dimension d."""
        return self.heads[0].dim

    @property
    def kind(self) -> str:
        """"dot" or "l2" when every head has that kind, else "mixed"."""
        kinds = {h.kind for h in self.heads}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def A(self, head: int | None = None) -> torch.Tensor:
        """The score matrix A_h of head ``head`` (d, d), or all of them stacked (H, d, d)."""
        if head is None:
            return torch.stack([h.A for h in self.heads])
        return self.heads[head].A

    def W_O_block(self, head: int) -> torch.Tensor:
        """The columns of W_O that act on head ``head``'s output, (d_out, k_v) (the identity block when
        W_O is None)."""
        sizes = [h.V.shape[0] for h in self.heads]
        start = sum(sizes[:head])
        if self.W_O is None:
            eye = torch.eye(sum(sizes), dtype=self.heads[0].Q.dtype, device=self.heads[0].Q.device)
            return eye[:, start:start + sizes[head]]
        return self.W_O[:, start:start + sizes[head]]

    def to(self, device=None, dtype=None) -> Parameters:
        device, dtype = to_arguments(device, dtype)
        mv = lambda t: None if t is None else t.to(device=device, dtype=dtype)
        return Parameters(tuple(h.to(device, dtype) for h in self.heads), mv(self.W_O), mv(self.bias), self.masked,
                          self.caveat)

    # ------------------------------------------------------------------ deprecated spellings
    def __getattr__(self, name):
        # HFAttention.parameters() used to return meanfield.hf.LayerParameters, with stacked tensors
        if name in ("Q", "K", "V", "b_V", "scale", "b_Q", "b_K", "layer", "to_meanfield"):
            legacy = object.__getattribute__(self, "_legacy")
            if name in legacy:
                instead = ("meanfield.MultiHeadAttention.from_parameters(p)" if name == "to_meanfield"
                           else f"p.heads[h].{name}")
                warnings.warn(f"Parameters.{name}: a field of the LayerParameters an HFAttention layer used to return, "
                              f"deprecated here; use {instead} (or meanfield.hf.extract_layer(model, layer) for the "
                              "raw weights)", DeprecationWarning, stacklevel=2)
                return legacy[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
