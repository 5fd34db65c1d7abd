"""Hugging Face attention layers (GPT-2, BERT) as operators of the framework.

``transformers`` is imported by nobody here: the functions work on the modules a user already has
(``pip install smooth-attention[models]`` for loading them; :mod:`studies.models` loads checkpoints).

* :class:`HFAttention`: a layer's attention as an :class:`~meanfield.operator.AttentionOperator`.
  The measure's weights enter the scores as an additive mask log a_j, its positions as the causal
  part of the mask (a key at position s_j is seen by a query at t iff s_j <= t), so a real layer acts
  on measures like any operator: its W2-sense Lipschitz constant, its Lipschitz ratios, its token
  dynamics (a real layer as a PDE). The mask is always passed explicitly: a module called alone
  applies no causal mask of its own (and an SDPA module given no mask could apply one).
  Two maps: ``block=False`` (default) is the attention alone, W_O concat_h f^h(X) + b, the paper's
  object (GPT-2: ``attn`` with ``c_proj``; BERT: ``attention.output.dense(attention.self(X))``);
  ``block=True`` is the whole attention block as Hugging Face computes it (BERT:
  ``LayerNorm(X + dense(self(X)))``; GPT-2: ``X + attn(ln_1(X))``).
* :func:`extract_layer`: per-head parameters from both layouts (BERT ``Linear``, GPT-2 fused
  ``Conv1D`` with its transposed weight) as :class:`LayerParameters`, convertible to a
  :class:`~meanfield.attention.MultiHeadAttention` (docs/math.md section 1).
* :func:`capture_attention_inputs`: forward pre-hooks recording what each attention module really
  receives on a text (GPT-2: the output of ``ln_1``; BERT: the embeddings or the previous layer), or
  with ``block=True`` what the whole block receives (GPT-2: the residual stream before ``ln_1``).
* :func:`attention_function`: a layer's attention as a plain function X (..., n, d) -> (..., n, d).
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from particles.validation import broadcast_shapes, check_bool, check_device, float_dtype, to_arguments

from .kernel_inputs import silence_blind_rows
from .kernels import additive_mask
from .operator import AttentionOperator, sequence_positions
from .parameters import Head, Parameters

__all__ = ["HFAttention", "is_hf_attention", "own_mask", "model_kind", "is_causal", "num_layers", "attention_module",
           "capture_attention_inputs", "capture_layer_inputs", "capture_attention_outputs", "causal_mask",
           "container_advice", "attention_function", "extract_layer", "LayerParameters", "KINDS", "float64_scores"]

KINDS = ("gpt2", "bert")


# ---------------------------------------------------------------------- models and layers
def model_kind(model) -> str:
    """``"gpt2"`` or ``"bert"`` (from ``model.config.model_type``); anything else is a ValueError."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in KINDS:
        raise ValueError(f"model: expected a GPT-2 or BERT model from transformers, got model_type {kind!r}")
    return kind


def is_causal(model) -> bool:
    """Whether the model's self-attention is causal: GPT-2 always, BERT when ``is_decoder``."""
    return model_kind(model) == "gpt2" or bool(model.config.is_decoder)


def _base(model):
    """The bare GPT2Model / BertModel inside a head model (LM head etc.)."""
    kind = model_kind(model)
    for attr in ("transformer", "bert"):
        if hasattr(model, attr) and not hasattr(model, "h" if kind == "gpt2" else "encoder"):
            return getattr(model, attr)
    return model


def _layers(model):
    base = _base(model)
    return base.h if model_kind(model) == "gpt2" else base.encoder.layer


def num_layers(model) -> int:
    return len(_layers(model))


def _check_layer(model, layer: int) -> int:
    L = num_layers(model)
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not -L <= layer < L:
        raise ValueError(f"layer: expected an integer in [0, {L}), got {layer!r}")
    return int(layer) % L


def _attention_core(model, layer: int):
    """The module whose input is the attention input: GPT2Attention, or BertSelfAttention."""
    blk = _layers(model)[_check_layer(model, layer)]
    return blk.attn if model_kind(model) == "gpt2" else blk.attention.self


def attention_module(model, layer: int):
    """Layer ``layer``'s attention module: ``GPT2Attention`` or ``BertAttention``."""
    blk = _layers(model)[_check_layer(model, layer)]
    return blk.attn if model_kind(model) == "gpt2" else blk.attention


def _kind_of_module(module) -> str | None:
    """"gpt2" (GPT2Attention), "bert" (BertAttention), "bert_self" (BertSelfAttention) or None."""
    if all(hasattr(module, a) for a in ("c_attn", "c_proj", "num_heads", "head_dim")):
        return "gpt2"
    if hasattr(module, "self") and hasattr(getattr(module, "output", None), "dense"):
        return "bert" if _kind_of_module(module.self) == "bert_self" else None
    if all(hasattr(module, a) for a in ("query", "key", "value", "num_attention_heads")):
        return "bert_self"
    return None


def own_mask(module) -> bool:
    """Whether a GPT-2 or BERT attention module is causal in its model: GPT-2's attention always (its
    ``is_causal``), BERT's when the model is a decoder."""
    kind = _kind_of_module(module)
    if kind is None:
        raise TypeError(f"module: expected a GPT2Attention, BertAttention or BertSelfAttention module, "
                        f"got {type(module).__name__}")
    core = module.self if kind == "bert" else module
    if kind == "gpt2":
        return bool(getattr(core, "is_causal", True))
    return bool(getattr(core, "is_causal", getattr(core, "is_decoder", False)))


def is_hf_attention(module) -> bool:
    """Whether ``module`` is a GPT-2 or BERT self-attention module this adapter wraps."""
    return isinstance(module, torch.nn.Module) and _kind_of_module(module) is not None


def container_advice(module) -> str | None:
    """What to pass instead of a Hugging Face module that holds attention but is not an attention layer (a
    whole model, a GPT-2 block, a BERT layer, a stack of them), in one sentence; None for other modules.

    Such a module takes token ids or returns a tuple, so wrapped as a callable on points it would fail
    inside torch (or compute something else than attention)."""
    name = type(module).__name__
    kind = getattr(getattr(module, "config", None), "model_type", None)
    if not callable(getattr(module, "get_input_embeddings", None)):   # a part of a model, not a model
        kind = None
    if kind in KINDS:
        return (f"a whole {name} is a model (token ids in, hidden states out), not an attention layer; pass one "
                "layer: HFAttention.from_model(model, layer) (block=True for its attention block with the "
                "LayerNorm), or meanfield.hf.attention_function(model, layer)")
    if kind is not None:
        return f"{name} is a {kind!r} model; only GPT-2 and BERT attention layers are supported ({KINDS})"
    if _kind_of_module(getattr(module, "attn", None)) == "gpt2" and hasattr(module, "ln_1"):
        return (f"a GPT-2 block ({name}) holds attention, LayerNorms and an MLP; pass its attention "
                "(as_operator(block.attn)), or the attention block with its LayerNorm: "
                "HFAttention.from_model(model, layer, block=True)")
    if _kind_of_module(getattr(module, "attention", None)) == "bert":
        return (f"a BERT layer ({name}) holds attention and a feed-forward part; pass its attention "
                "(as_operator(layer.attention)), or HFAttention.from_model(model, layer, block=True)")
    for stack in (module, getattr(module, "h", None), getattr(module, "layer", None)):
        if isinstance(stack, torch.nn.ModuleList) and len(stack) and (container_advice(stack[0]) is not None
                                                                     or is_hf_attention(stack[0])):
            return (f"{name} is a stack of {len(stack)} layers, not one attention layer; pass one layer: "
                    "HFAttention.from_model(model, layer)")
    return None


# ---------------------------------------------------------------------- the operator
class HFAttention(AttentionOperator):
    """A Hugging Face GPT-2 / BERT attention layer as an operator (module docstring).

    By default (``block=False``) the map is the attention alone, W_O concat_h f^h(X) + b, the paper's object: for a
    ``BertAttention`` that is ``module.output.dense(module.self(X))``, **not** ``module(X)``, which adds the residual
    and the LayerNorm (``block=True`` is that map). The repr says which of the two an operator is.

    Parameters
    ----------
    module : GPT2Attention, BertAttention or BertSelfAttention
        In eval mode (dropout would make the map random). ``BertSelfAttention`` alone is the
        concatenation of the heads, without W_O.
    masked : bool or None
        Causal attention: sequences use positions i/n, measures their own positions. None (the default):
        the module's own mask (:func:`own_mask`: GPT-2's attention is causal, BERT's in a decoder).
        To compare with the module called directly, give it the mask: a GPT2Attention called without an
        attention mask applies none (transformers' own models pass it), so ``module(X)`` is the non-causal
        map of a causal layer (:func:`causal_mask` builds the additive mask). A query that sees no key of
        positive weight gives zero heads (the output projection's bias), as in
        :class:`meanfield.MultiHeadAttention`, not the module's average over every key.
        A GPT-2 layer with ``reorder_and_upcast_attn=True`` (float32 scores) computing in float64 computes its
        scores in float64 (:class:`float64_scores`; transformers' own float64 forward raises there).
    block : bool
        The whole attention block instead of the attention alone (module docstring); needs
        ``BertAttention`` or, for GPT-2, the ``ln_1`` of the block (``from_model`` gives it).
    ln : the GPT-2 block's ``ln_1`` (used when ``block=True``).
    name : str or None
        What the repr calls the layer (None: the module's class name; :meth:`from_model` gives the model's kind and
        the layer's index).
    """

    def __init__(self, module, *, masked: bool | None = None, block: bool = False, ln=None, name: str | None = None):
        kind = _kind_of_module(module) if isinstance(module, torch.nn.Module) else None
        if kind is None:
            raise TypeError(f"module: expected a GPT2Attention, BertAttention or BertSelfAttention module, "
                            f"got {type(module).__name__}")
        masked, block = check_bool(masked, "masked", allow_none=True), check_bool(block, "block")
        core = module.self if kind == "bert" else module
        if getattr(module, "is_cross_attention", False) or "Cross" in type(core).__name__:
            raise ValueError(f"module: {type(core).__name__} is cross-attention (queries from one sequence, keys "
                             "from an encoder's), not self-attention")
        if masked is None:
            masked = own_mask(module)
        if block and kind == "bert_self":
            raise ValueError("block: the block needs BertAttention (self + output with its LayerNorm), "
                             "not BertSelfAttention")
        if block and kind == "gpt2" and ln is None:
            raise ValueError("ln: block=True on GPT-2 needs the block's ln_1 (use HFAttention.from_model)")
        self.module, self.kind, self.masked, self.block, self.ln = module, kind, masked, block, ln
        self._cast = (None, None)   # (device, dtype) the parameters are converted to at every call (``to``)
        self.name = name or type(module).__name__
        self._core = core
        self._d = (module.embed_dim if kind == "gpt2" else
                   self._core.query.in_features)
        self._d_out = self._d if kind != "bert_self" else self._core.all_head_size

    def _call(self, mod, *args, **kwargs):
        """mod(*args, **kwargs) with its parameters detached: the operator is a fixed map of its inputs,
        so Jacobians and trajectories never build graphs over the model's weights. The parameters are read
        at every call: in-place updates, replaced weights and a moved module are all seen."""
        # read at every call (a few microseconds): a weight replaced after the operator was built (an
        # ablation), or the module moved with model.to(...), is what the operator computes with
        device, dtype = self._cast
        frozen = {n: _converted(t.detach(), device, dtype) for n, t in (*mod.named_parameters(), *mod.named_buffers())}
        return torch.func.functional_call(mod, frozen, args, kwargs)

    def to(self, device=None, dtype=None) -> HFAttention:
        """The same layer computing on ``device`` in ``dtype``: the module is shared, not copied, and its parameters
        are converted at every call (they are read at every call anyway). What a float32 layer's certified constant
        is checked with, in float64 (:func:`meanfield.local_lipschitz`)."""
        device, dtype = to_arguments(device, dtype)
        dtype, device = float_dtype(dtype), check_device(device)
        twin = copy.copy(self)
        twin._cast = (device if device is not None else self._cast[0], dtype if dtype is not None else self._cast[1])
        return twin

    @classmethod
    def from_model(cls, model, layer: int, *, masked: bool | None = None, block: bool = False) -> HFAttention:
        """Layer ``layer`` of a GPT-2 / BERT model; ``masked`` defaults to the model's own mask (causal
        for GPT-2 and for BERT as a decoder). ``masked=False`` on GPT-2 (or True on a BERT encoder) is
        the ablation with the same weights."""
        kind = model_kind(model)
        layer = _check_layer(model, layer)
        masked = is_causal(model) if masked is None else masked
        ln = _layers(model)[layer].ln_1 if kind == "gpt2" else None
        what = "block" if block else "attention"
        return cls(attention_module(model, layer), masked=masked, block=block, ln=ln,
                   name=f"{kind} layer {layer} {what}{' (causal)' if masked else ''}")

    d_in = property(lambda self: self._d)
    d_out = property(lambda self: self._d_out)
    dtype = property(lambda self: self._cast[1] or next(self.module.parameters()).dtype)
    device = property(lambda self: self._cast[0] or next(self.module.parameters()).device)
    #: no float32 twin for the mixed-precision Lanczos of float64 inputs (unmeasured on these layers); the float64
    #: twin that certifies float32 inputs is used
    mixed_precision = False

    def __repr__(self) -> str:
        what = ("the whole block" if self.block else "the heads concatenated, no W_O" if self.kind == "bert_self"
                else "the attention alone, W_O concat_h f^h + b")
        return f"HFAttention({self.name}, {what}, masked={self.masked}, block={self.block})"

    def parameters(self, d: int | None = None) -> Parameters:
        """The layer's record (:mod:`meanfield.parameters`): per head Q_h, K_h, V_h, the key bias
        scale K_h^T b_Q (what the query bias becomes), the value bias and the scale; W_O and the output
        bias (``BertSelfAttention`` alone: none, the heads are concatenated). The whole block carries a
        caveat (LayerNorm and residual: no bound applies). The raw weights, biases included, are
        :func:`extract_layer`'s."""
        raw = _extract(self.module, self.kind, masked=self.masked, layer=-1)
        heads = tuple(Head(raw.Q[h], raw.K[h], raw.V[h], raw.scale * (raw.K[h].T @ raw.b_Q[h]), raw.b_V[h],
                           raw.scale, "dot") for h in range(raw.num_heads))
        caveat = ("the whole block (LayerNorm and residual) around the attention: no bound of the paper applies"
                  if self.block else None)
        legacy = {"Q": raw.Q, "K": raw.K, "V": raw.V, "b_Q": raw.b_Q, "b_K": raw.b_K, "b_V": raw.b_V,
                  "scale": raw.scale, "layer": raw.layer, "to_meanfield": raw.to_meanfield}
        return Parameters(heads, raw.W_O, raw.bias, self.masked, caveat, legacy)

    def _check_eval(self):
        """Training mode is refused where it makes the map random: a dropout of p > 0 (GPT-2 and BERT apply theirs
        through nn.Dropout modules, whose p their attention reads too). With every dropout at 0 the map is
        deterministic, as for torch's MultiheadAttention adapter."""
        mods = [self.module] + ([self.ln] if self.ln is not None else [])
        if not any(m.training for m in mods):
            return
        p = max((d.p for m in mods for d in m.modules()
                 if isinstance(d, torch.nn.modules.dropout._DropoutNd) and d.training), default=0.0)
        if p > 0:
            raise ValueError(f"module: is in training mode with dropout p = {p:g} (a random map); call model.eval(), "
                             "or build the model with its dropout probabilities at 0")

    def _heads(self, hidden, mask):
        """The attention alone on ``hidden`` (b, N, d) with the additive ``mask`` (b or 1, 1, N, N)."""
        with float64_scores([self._core], hidden.dtype):
            y = self._call(self._core, hidden, attention_mask=mask)[0]
        return self._call(self.module.output.dense, y) if self.kind == "bert" else y

    def _output_bias(self):
        """What the attention outputs where every head gives zero: the output projection's bias (GPT-2's
        ``c_proj``, BERT's ``output.dense``); None (zeros) for ``BertSelfAttention`` alone."""
        proj = {"gpt2": lambda: self.module.c_proj, "bert": lambda: self.module.output.dense}.get(self.kind)
        return None if proj is None else getattr(proj(), "bias", None)

    def evaluate(self, x, keys, log_weights=None, x_positions=None, key_positions=None):
        self._check_eval()
        lead = x.shape[:-2]
        m, n = x.shape[-2], keys.shape[-2]
        same = x is keys
        xb = x.reshape(-1, m, self._d)
        kb = keys.expand(*lead, n, self._d).reshape(-1, n, self._d)
        if self.block and self.kind == "gpt2":
            qa, ka = self._call(self.ln, xb), (None if same else self._call(self.ln, kb))
        else:
            qa, ka = xb, (None if same else kb)
        zeros = torch.zeros(n, dtype=x.dtype, device=x.device) if log_weights is None else None
        lw = log_weights if log_weights is not None else zeros
        if same:
            hidden = qa
            mask = additive_mask(m, n, lw, x_positions, key_positions, x.dtype, x.device)
        else:
            # a self-attention module takes one sequence: keys first, then the queries, which see
            # only the keys (their own columns are masked out)
            hidden = torch.cat([ka, qa], dim=-2)
            kp = key_positions
            top = additive_mask(n, n, lw, kp, kp, x.dtype, x.device)
            bottom = additive_mask(m, n, lw, x_positions, kp, x.dtype, x.device)
            low = torch.finfo(x.dtype).min
            bshape = broadcast_shapes(top.shape[:-2], bottom.shape[:-2])
            left = torch.cat([top.expand(*bshape, n, n), bottom.expand(*bshape, m, n)], dim=-2)
            right = torch.full((*bshape, n + m, m), low, dtype=x.dtype, device=x.device)
            mask = torch.cat([left, right], dim=-1)
        mask = mask.reshape(-1, 1, *mask.shape[-2:])
        out = self._heads(hidden, mask)
        if not same:
            out = out[..., n:, :]
        # a query that sees no key of positive weight: its heads give zero (the framework's rule, as in
        # MultiHeadAttention), where the module's finite mask averaged every key, later ones included
        out = silence_blind_rows(out.reshape(*lead, m, -1), log_weights, x_positions, key_positions,
                                 self._output_bias()).reshape(-1, m, out.shape[-1])
        if self.block:
            if self.kind == "bert":
                out = self._call(self.module.output.LayerNorm, out + xb)
            else:
                out = xb + out
        return out.reshape(*lead, m, self._d_out)


class float64_scores:
    """Within this context, GPT-2 attention modules among ``modules`` that compute their scores in float32
    (``reorder_and_upcast_attn=True``, a guard for half-precision training) compute them in the working dtype
    when it is float64: transformers raises a dtype error on that path in float64 ("attn_weights does not have
    dtype torch.float32"). The map is the same in exact arithmetic (the flag only orders the scaling and picks
    the scores' precision), computed in float64 throughout, above float32. Other dtypes, and other modules, are
    left as they are; the flags are restored on exit."""

    def __init__(self, modules, dtype):
        self._mods = [m for m in modules if getattr(m, "reorder_and_upcast_attn", False)] \
            if dtype == torch.float64 else []

    def __enter__(self):
        for m in self._mods:
            m.reorder_and_upcast_attn = False

    def __exit__(self, *exc):
        for m in self._mods:
            m.reorder_and_upcast_attn = True


def _converted(t: torch.Tensor, device, dtype) -> torch.Tensor:
    """A parameter or buffer on ``device`` and, if floating, in ``dtype`` (None: unchanged)."""
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t if device is None else t.to(device)


# ---------------------------------------------------------------------- hooks and masks
def capture_attention_inputs(model, input_ids: torch.Tensor, layers: Sequence[int] | None = None,
                             *, with_mask: bool = False, block: bool = False):
    """Run ``model`` on ``input_ids`` (1, n) and return {layer: X (n, d)}, the hidden states that
    each attention module actually received (forward pre-hooks with kwargs on GPT2Attention /
    BertSelfAttention). ``with_mask=True`` also returns {layer: attention_mask it received}. A float64
    GPT-2 with ``reorder_and_upcast_attn=True`` runs with float64 scores (:class:`float64_scores`).

    ``block=True``: the input of the whole attention block instead, what
    ``HFAttention.from_model(model, layer, block=True)`` maps. For GPT-2 (pre-LayerNorm) that is the
    block's input, the residual stream before ``ln_1``, not the attention's input ``ln_1(X)``: feeding the
    attention's input to the block map would apply ``ln_1`` twice. For BERT (post-LayerNorm) both are the
    same hidden states.
    """
    with_mask, block = check_bool(with_mask, "with_mask"), check_bool(block, "block")
    xs, blocks, masks = _capture(model, input_ids, layers, block=block)
    out = blocks if block else xs
    return (out, masks) if with_mask else out


def capture_layer_inputs(model, input_ids: torch.Tensor, layers: Sequence[int] | None = None):
    """({layer: X}, {layer: X_block}) in one forward pass: what :func:`capture_attention_inputs` returns without
    and with ``block=True`` (for BERT the same tensors; for GPT-2 the attention's input ``ln_1(X)`` and the
    block's input ``X``), where two calls ran the model twice."""
    xs, blocks, _ = _capture(model, input_ids, layers, block=True)
    return xs, blocks


def capture_attention_outputs(model, input_ids: torch.Tensor, layers: Sequence[int] | None = None):
    """{layer: Y (n, d)}: what each layer's attention map (``HFAttention.from_model(model, layer)``) gave inside
    the model's own forward pass on ``input_ids`` (1, n), with the model's own mask: GPT-2's attention module
    output (``c_proj`` included), BERT's attention output projection ``output.dense`` (before its dropout,
    residual and LayerNorm). Forward hooks, one pass; an independent truth for the layer rebuilt from its
    extracted parameters (:meth:`LayerParameters.to_meanfield`), the mask included."""
    outs = {}
    gpt2 = model_kind(model) == "gpt2"

    def hooks(i):
        def hook(module, args, output):
            y = output[0] if isinstance(output, tuple) else output
            outs[i] = y[0].detach().clone()
        module = attention_module(model, i)
        return [(module if gpt2 else module.output.dense).register_forward_hook(hook)]

    _hooked_pass(model, input_ids, layers, hooks)
    return outs


def _capture(model, input_ids, layers, *, block: bool):
    """({layer: attention input}, {layer: block input} (``block=True``; else {}), {layer: attention mask}) of one
    forward pass (forward pre-hooks with kwargs on the attention cores, and on GPT-2's blocks)."""
    xs, outer_xs, masks = {}, {}, {}
    outer = block and model_kind(model) == "gpt2"   # the block's input is not the attention's

    def hook_for(i, store, mask=True):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            store[i] = h[0].detach().clone()
            if mask:
                masks[i] = kwargs.get("attention_mask")
        return hook

    def hooks(i):
        handles = [_attention_core(model, i).register_forward_pre_hook(hook_for(i, xs), with_kwargs=True)]
        if outer:
            handles.append(_layers(model)[i].register_forward_pre_hook(hook_for(i, outer_xs, mask=False),
                                                                       with_kwargs=True))
        return handles

    _hooked_pass(model, input_ids, layers, hooks)
    blocks = outer_xs if outer else (xs if block else {})   # BERT's block input is the attention's
    return xs, blocks, masks


def _hooked_pass(model, input_ids, layers, hooks) -> None:
    """One forward pass of ``model`` on ``input_ids`` (1, n) with the hooks ``hooks(i)`` registers on each layer i
    of ``layers`` (None: all; it returns their handles), removed after; no gradients, and float64 scores where
    :class:`float64_scores` needs them. The ids and layers are checked first."""
    model_kind(model)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("input_ids: expected a LongTensor of shape (1, n)")
    _check_ids(model, input_ids)
    layers = range(num_layers(model)) if layers is None else [_check_layer(model, int(i)) for i in layers]
    cores = [_attention_core(model, i) for i in range(num_layers(model))]
    param = next(model.parameters())
    handles = []
    try:
        for i in layers:
            handles += hooks(i)
        with torch.no_grad(), float64_scores(cores, param.dtype):
            model(input_ids=input_ids.to(param.device))
    finally:
        for h in handles:
            h.remove()


def _check_ids(model, input_ids: torch.Tensor) -> None:
    """Token ids the model's embeddings can look up: integers in [0, vocab_size), at most its positions."""
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise TypeError(f"input_ids: expected integer token ids (torch.long), got {input_ids.dtype}")
    cfg = model.config
    n, max_pos = input_ids.shape[1], getattr(cfg, "n_positions", None) or cfg.max_position_embeddings
    if not 1 <= n <= max_pos:
        raise ValueError(f"input_ids: {n} tokens; the model takes 1 to {max_pos} (its position embeddings)")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= cfg.vocab_size:
        raise ValueError(f"input_ids: ids must lie in [0, {cfg.vocab_size}) (the model's vocabulary), got the range "
                         f"[{lo}, {hi}]; encode the text with the model's own tokenizer")


def causal_mask(n: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The additive mask eager attention expects, shape (1, 1, n, n): 0 where key j <= query i,
    the dtype's most negative finite value above the diagonal (as transformers' ``eager_mask``)."""
    pos = sequence_positions(n, torch.zeros(0, dtype=dtype, device=device))
    return additive_mask(n, n, torch.zeros(n, dtype=dtype, device=device), pos, pos, dtype, device)[None, None]


def attention_function(model, layer: int, *, masked: bool | None = None, block: bool = False
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Layer ``layer``'s attention as a plain function X (..., n, d) -> (..., n, d): the sequence map of
    :meth:`HFAttention.from_model(model, layer, masked=masked, block=block) <HFAttention.from_model>`,
    with attributes ``masked``, ``layer``, ``kind`` and ``operator``."""
    op = HFAttention.from_model(model, layer, masked=masked, block=block)

    def f(X: torch.Tensor) -> torch.Tensor:
        if not isinstance(X, torch.Tensor) or X.dim() < 2:
            raise ValueError("X: expected a tensor of shape (..., n, d)")
        return op.sequence(X)

    f.masked, f.layer, f.kind, f.operator = op.masked, _check_layer(model, layer), op.kind, op
    return f


# ---------------------------------------------------------------------- parameters
@dataclass
class LayerParameters:
    """Per-head parameters of one attention layer (docs/math.md section 1), H heads of size k, width d.

    The raw weights of a Hugging Face layer (:func:`extract_layer`); an operator's record for the
    theory is :meth:`HFAttention.parameters` (:class:`meanfield.parameters.Parameters`).

    Q, K, V: (H, k, d); b_Q, b_K, b_V: (H, k); W_O: (d, H k) and bias: (d,) (None for BertSelfAttention
    alone); scale: the factor on <q, k> (1/sqrt(k) by default, GPT-2 may add 1/(layer+1)); masked: the
    model's own mask.
    The layer computes f(X) = concat_h softmax((X Q_h^T + b_Q)(X K_h^T + b_K)^T scale) (X V_h^T + b_V) W_O^T + bias.
    """

    Q: torch.Tensor
    K: torch.Tensor
    V: torch.Tensor
    b_Q: torch.Tensor
    b_K: torch.Tensor
    b_V: torch.Tensor
    W_O: torch.Tensor | None
    bias: torch.Tensor | None
    scale: float
    masked: bool
    kind: str
    layer: int

    @property
    def num_heads(self) -> int:
        return self.Q.shape[0]

    @property
    def head_dim(self) -> int:
        return self.Q.shape[1]

    def A(self, head: int | None = None, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A_h = scale K_h^T Q_h, (d, d); all heads stacked (H, d, d) when ``head`` is None.

        ``dtype``: form the product in this dtype (float64 for theory checks: the product of float32
        factors rounded to float32 differs from the exact one by about 1e-7, relative, which moves a
        witness's constant by as much; :func:`meanfield.bounds.gamma_info_factored` works in float64)."""
        Q, K = (self.Q, self.K) if head is None else (self.Q[head], self.K[head])
        if dtype is not None:
            Q, K = Q.to(dtype), K.to(dtype)
        return self.scale * K.transpose(-1, -2) @ Q

    def W_O_block(self, head: int) -> torch.Tensor:
        """The columns of W_O that act on head ``head``'s output, (d, k)."""
        k = self.head_dim
        return self.W_O[:, head * k:(head + 1) * k]

    def to_meanfield(self, masked: bool | None = None):
        """The layer as :class:`meanfield.MultiHeadAttention` (heads from :meth:`meanfield.SelfAttention.from_qkv`)."""
        from .attention import MultiHeadAttention, SelfAttention

        masked = self.masked if check_bool(masked, "masked", allow_none=True) is None else masked
        heads = [SelfAttention.from_qkv(self.Q[h], self.K[h], self.V[h], b_Q=self.b_Q[h], b_K=self.b_K[h],
                                        b_V=self.b_V[h], scale=self.scale, masked=masked)
                 for h in range(self.num_heads)]
        return MultiHeadAttention(heads, self.W_O, bias=self.bias)


def _extract(module, kind: str, *, masked: bool, layer: int) -> LayerParameters:
    if kind == "gpt2":
        d = module.embed_dim
        W, b = module.c_attn.weight.detach().T, module.c_attn.bias.detach()  # (3d, d): rows q | k | v
        Wq, Wk, Wv = W[:d], W[d:2 * d], W[2 * d:]
        bq, bk, bv = b[:d], b[d:2 * d], b[2 * d:]
        W_O, bias = module.c_proj.weight.detach().T, module.c_proj.bias.detach()
        H, k, scale = module.num_heads, module.head_dim, float(module.scaling)
    else:
        # BertAttention (self + output.dense as W_O), or BertSelfAttention alone (heads concatenated)
        core = module.self if kind == "bert" else module
        Wq, Wk, Wv = (m.weight.detach() for m in (core.query, core.key, core.value))
        bq, bk, bv = (m.bias.detach() for m in (core.query, core.key, core.value))
        if kind == "bert":
            W_O, bias = module.output.dense.weight.detach(), module.output.dense.bias.detach()
        else:
            W_O = bias = None
        H, k, scale = core.num_attention_heads, core.attention_head_size, float(core.scaling)

    def heads(M):
        return M.reshape(H, k, -1).clone() if M.dim() == 2 else M.reshape(H, k).clone()
    clone = lambda t: None if t is None else t.clone()
    return LayerParameters(Q=heads(Wq), K=heads(Wk), V=heads(Wv), b_Q=heads(bq), b_K=heads(bk), b_V=heads(bv),
                           W_O=clone(W_O), bias=clone(bias), scale=scale, masked=masked, kind="gpt2" if
                           kind == "gpt2" else "bert", layer=layer)


def extract_layer(model, layer: int) -> LayerParameters:
    """Per-head parameters of layer ``layer`` from BERT (``nn.Linear`` query/key/value and
    ``output.dense``, weight (out, in)) or GPT-2 (fused ``Conv1D`` c_attn, weight (in, 3 d), and
    c_proj, weight (in, out)). Copies, detached; same dtype and device as the model."""
    kind = model_kind(model)
    layer = _check_layer(model, layer)
    module = attention_module(model, layer)
    if kind == "gpt2" and getattr(module, "is_cross_attention", False):
        raise ValueError("layer: cross-attention is not self-attention")
    return _extract(module, kind, masked=is_causal(model), layer=layer)
