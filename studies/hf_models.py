"""Real attention layers: BERT and GPT-2 from Hugging Face ``transformers``, on real text.

What this module gives:

* models: :func:`load_model` (a local checkpoint directory or a hub name; offline it fails fast
  with a message naming what was missing) and :func:`random_model` (randomly initialized from
  ``BertConfig()`` / ``GPT2Config()`` defaults, i.e. the ``bert-base`` and ``gpt2`` shapes, or tiny
  shapes for tests; BERT also as a causal decoder). Always ``attn_implementation="eager"``,
  safetensors preferred, never ``trust_remote_code``, float64 by default, in eval mode.
* text: :func:`default_corpus` (English prose that ships with Python: docstrings of a fixed list
  of standard-library modules), :func:`read_text`, and :class:`HashTokenizer`, a deterministic
  word-level tokenizer for randomly initialized models (it downloads nothing).
* :func:`capture_attention_inputs`: forward pre-hooks recording what each attention module
  really receives (GPT-2: the output of ``ln_1``; BERT: the embeddings or the previous layer).
* :func:`attention_function`: one layer's attention as a plain function X (n, d) -> (n, d) with
  the mask the model really uses, built explicitly (a module called alone gets no causal mask).
  For BERT the function is ``output.dense(self(X))``: the multi-head map before the residual
  connection and LayerNorm; for GPT-2 it is ``attn`` (c_attn ... c_proj) itself.
* :func:`extract_layer`: per-head parameters from both layouts (BERT ``Linear``, GPT-2 fused
  ``Conv1D`` with its transposed weight), as :class:`LayerParameters`, convertible to a
  ``meanfield.MultiHeadAttention`` (docs/math.md section 1: A_h = K_h^T Q_h / sqrt(k),
  f_MH = concat f^h W_O^T + b).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import re
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["random_model", "tiny_config", "load_model", "load_tokenizer", "model_kind", "is_causal",
           "num_layers", "HashTokenizer", "default_corpus", "CORPUS_SOURCES", "read_text", "encode",
           "capture_attention_inputs", "causal_mask", "attention_function", "extract_layer",
           "LayerParameters", "ModelNotAvailableError"]

KINDS = ("gpt2", "bert")


class ModelNotAvailableError(OSError):
    """A checkpoint could not be found locally and the hub cannot be reached."""


# ---------------------------------------------------------------------- models
def _config(kind: str, *, tiny: bool, is_decoder: bool, overrides: dict):
    from transformers import BertConfig, GPT2Config

    if kind == "gpt2":
        base = dict(n_embd=32, n_layer=2, n_head=4, n_positions=128, vocab_size=512, bos_token_id=511,
                    eos_token_id=511) if tiny else {}
        if is_decoder:
            raise ValueError("is_decoder: GPT-2 is always causal; is_decoder applies to BERT only")
        cfg = GPT2Config(**{**base, **overrides})
    elif kind == "bert":
        base = (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=128, vocab_size=512) if tiny else {})
        cfg = BertConfig(**{**base, "is_decoder": is_decoder, **overrides})
    else:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    cfg._attn_implementation = "eager"
    return cfg


def tiny_config(kind: str, *, is_decoder: bool = False, **overrides):
    """A tiny GPT-2 / BERT config (d = 32, 4 heads, 2 layers) with the real architecture."""
    return _config(kind, tiny=True, is_decoder=is_decoder, overrides=overrides)


def random_model(kind: str = "gpt2", *, size: str = "full", is_decoder: bool = False, seed: int = 0,
                 dtype: torch.dtype = torch.float64, device=None, **overrides):
    """A randomly initialized ``GPT2Model`` / ``BertModel`` (eval mode, eager attention).

    ``size="full"`` uses the config defaults (``gpt2``: d = 768, 12 layers, 12 heads, 1024
    positions; ``bert-base``: d = 768, 12 layers, 12 heads, 512 positions); ``size="tiny"`` the
    shapes of :func:`tiny_config`. ``is_decoder=True`` makes BERT causal (BERT as a decoder).
    Weights follow the library's own initializer under ``torch.manual_seed(seed)`` (on the CPU,
    then moved to ``device``, so a seed gives the same weights everywhere).
    """
    from transformers import BertModel, GPT2Model

    if size not in ("full", "tiny"):
        raise ValueError(f"size: expected 'full' or 'tiny', got {size!r}")
    cfg = _config(kind, tiny=size == "tiny", is_decoder=is_decoder, overrides=overrides)
    cls = GPT2Model if kind == "gpt2" else BertModel
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = cls(cfg) if kind == "gpt2" else cls(cfg, add_pooling_layer=False)
    finally:
        torch.random.set_rng_state(state)
    return model.to(device=device, dtype=dtype).eval()


def _hub_reachable(timeout: float = 2.0) -> bool:
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _offline(local_files_only) -> bool:
    if local_files_only is not None:
        return bool(local_files_only)
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    return not _hub_reachable()


def load_model(name_or_path: str | os.PathLike, *, dtype: torch.dtype = torch.float64, device=None,
               is_decoder=None, local_files_only: bool | None = None):
    """``AutoModel.from_pretrained`` for a GPT-2 or BERT checkpoint, ready for analysis.

    ``name_or_path``: a local directory (config.json + weights) or a hub name. Loaded with
    ``attn_implementation="eager"``, ``use_safetensors`` when the directory has safetensors
    weights, never ``trust_remote_code``; converted to ``dtype``; eval mode. ``is_decoder=True``
    loads BERT as a causal decoder; ``device`` places the model (CPU by default). The hub is used
    only when reachable and ``HF_HUB_OFFLINE`` is unset (``local_files_only`` overrides the
    detection); otherwise only local files and the cache are tried, and a missing model raises
    :class:`ModelNotAvailableError` saying what was missing.
    """
    from transformers import AutoConfig, AutoModel

    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path):
        raise TypeError(f"name_or_path: expected a directory or hub name, got {name_or_path!r}")
    path = Path(name_or_path)
    local = path.is_dir()
    if not local and (path.is_absolute() or str(name_or_path).startswith((".", "~"))):
        raise ModelNotAvailableError(f"name_or_path: no checkpoint directory at {str(path)!r}")
    if local and not (path / "config.json").is_file():
        raise ModelNotAvailableError(f"name_or_path: directory {str(path)!r} has no config.json")
    offline = True if local else _offline(local_files_only)
    try:
        cfg = AutoConfig.from_pretrained(name_or_path, local_files_only=offline, trust_remote_code=False)
    except OSError as exc:
        where = (f"directory {str(path)!r} has no config.json" if local else
                 f"{str(name_or_path)!r} is not in the local Hugging Face cache and the hub is not reachable"
                 if offline else f"could not fetch {str(name_or_path)!r} from the hub")
        raise ModelNotAvailableError(f"name_or_path: model not available: {where} ({exc.__class__.__name__}). "
                                     "Pass a local checkpoint directory, or use random_model().") from exc
    if cfg.model_type not in KINDS:
        raise ValueError(f"name_or_path: model_type {cfg.model_type!r} is not supported (expected {KINDS})")
    kwargs = dict(attn_implementation="eager", local_files_only=offline, trust_remote_code=False)
    if is_decoder is not None:
        if cfg.model_type != "bert":
            raise ValueError("is_decoder: applies to BERT only (GPT-2 is always causal)")
        kwargs["is_decoder"] = bool(is_decoder)
    if local:
        has_st = any(path.glob("*.safetensors"))
        if not has_st and not any(path.glob("*.bin")):
            raise ModelNotAvailableError(f"name_or_path: directory {str(path)!r} has a config.json but no weights "
                                         "(model.safetensors or pytorch_model.bin)")
        kwargs["use_safetensors"] = has_st
    try:
        model = AutoModel.from_pretrained(name_or_path, **kwargs)
    except OSError as exc:
        raise ModelNotAvailableError(f"name_or_path: weights of {str(name_or_path)!r} not available "
                                     f"({exc})") from exc
    return model.to(device=device, dtype=dtype).eval()


def load_tokenizer(name_or_path, *, local_files_only: bool | None = None):
    """The checkpoint's own tokenizer (``AutoTokenizer``, same offline rules as :func:`load_model`)."""
    from transformers import AutoTokenizer

    offline = True if Path(name_or_path).is_dir() else _offline(local_files_only)
    try:
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=offline, trust_remote_code=False)
    except OSError as exc:
        raise ModelNotAvailableError(f"name_or_path: tokenizer of {str(name_or_path)!r} not available ({exc})") from exc


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
    if not isinstance(layer, int) or not -L <= layer < L:
        raise ValueError(f"layer: expected an integer in [0, {L}), got {layer!r}")
    return layer % L


def _attention_core(model, layer: int):
    """The module whose input is the attention input: GPT2Attention, or BertSelfAttention."""
    blk = _layers(model)[_check_layer(model, layer)]
    return blk.attn if model_kind(model) == "gpt2" else blk.attention.self


# ---------------------------------------------------------------------- text
# Fixed order; (module, attribute). Docstrings are English prose written by Python's authors.
CORPUS_SOURCES: tuple[tuple[str, str], ...] = (
    ("heapq", "__about__"), ("copy", "__doc__"), ("sched", "__doc__"), ("tempfile", "__doc__"),
    ("random", "__doc__"), ("collections", "__doc__"), ("timeit", "__doc__"), ("subprocess", "__doc__"),
    ("ftplib", "__doc__"), ("smtplib", "__doc__"), ("getopt", "__doc__"), ("csv", "__doc__"),
    ("json", "__doc__"), ("doctest", "__doc__"), ("unittest", "__doc__"), ("argparse", "__doc__"),
    ("inspect", "__doc__"), ("difflib", "__doc__"), ("string", "__doc__"), ("pprint", "__doc__"),
)


def _is_prose(paragraph: str) -> bool:
    """Keep paragraphs of running text; drop code samples, tables and ASCII art."""
    lines = paragraph.splitlines()
    if any(ln.startswith("    ") or ">>>" in ln for ln in lines):
        return False
    words = paragraph.split()
    letters = sum(c.isalpha() or c.isspace() for c in paragraph)
    return len(words) >= 8 and letters >= 0.85 * len(paragraph)


def default_corpus() -> str:
    """English prose that ships with Python: the prose paragraphs of the docstrings of the
    standard-library modules in :data:`CORPUS_SOURCES`, in that order, joined by blank lines.

    Fixed for a given Python version (the docstrings are part of the interpreter), so runs are
    offline and deterministic; a study records its SHA-256 in its configuration.
    """
    paras = []
    for mod, attr in CORPUS_SOURCES:
        doc = inspect.cleandoc(getattr(importlib.import_module(mod), attr) or "")
        for p in re.split(r"\n\s*\n", doc):
            p = p.strip()
            if _is_prose(p):
                paras.append(" ".join(p.split()))
    return "\n\n".join(paras)


def read_text(text: str | None = None, path: str | os.PathLike | None = None) -> str:
    """The user's text (a string or a UTF-8 file), else :func:`default_corpus`."""
    if text is not None and path is not None:
        raise ValueError("text, path: give one of them, not both")
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"path: no text file at {str(p)!r}")
        text = p.read_text(encoding="utf-8")
    if text is None:
        return default_corpus()
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("text: is empty")
    return text


class HashTokenizer:
    """A deterministic word-level tokenizer that needs no vocabulary file.

    Text is lower-cased and split into words and single punctuation marks (regex
    ``\\w+|[^\\w\\s]``); each piece gets id ``n_special + blake2b(piece) mod (vocab_size - n_special)``
    (a cryptographic hash, so ids do not depend on ``PYTHONHASHSEED`` or the platform). Distinct
    words may share an id (hash collisions), which a randomly initialized model does not mind.
    For pretrained checkpoints use the checkpoint's own tokenizer (:func:`load_tokenizer`).
    """

    _pattern = re.compile(r"\w+|[^\w\s]")

    def __init__(self, vocab_size: int, n_special: int = 1):
        if not isinstance(vocab_size, int) or vocab_size <= n_special:
            raise ValueError(f"vocab_size: expected an integer > n_special = {n_special}, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.n_special = n_special

    def tokenize(self, text: str) -> list[str]:
        return self._pattern.findall(text.lower())

    def encode(self, text: str) -> list[int]:
        m = self.vocab_size - self.n_special
        return [self.n_special + int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little") % m
                for w in self.tokenize(text)]

    def __call__(self, text: str, return_tensors: str | None = None):
        ids = self.encode(text)
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def __repr__(self) -> str:
        return f"HashTokenizer(vocab_size={self.vocab_size}, n_special={self.n_special})"


def encode(tokenizer, text: str, n: int | None = None) -> torch.Tensor:
    """Token ids of ``text``, shape (1, n): the first ``n`` tokens (all when ``n`` is None).

    Raises ValueError when the text has fewer than ``n`` tokens (nothing is silently padded).
    """
    ids = tokenizer.encode(text) if isinstance(tokenizer, HashTokenizer) else tokenizer(text)["input_ids"]
    ids = list(ids)
    if n is not None:
        if n < 1 or len(ids) < n:
            raise ValueError(f"n: the text has {len(ids)} tokens, {n} requested")
        ids = ids[:n]
    return torch.tensor([ids], dtype=torch.long)


# ---------------------------------------------------------------------- hooks
def capture_attention_inputs(model, input_ids: torch.Tensor, layers: Sequence[int] | None = None,
                             *, with_mask: bool = False):
    """Run ``model`` on ``input_ids`` (1, n) and return {layer: X (n, d)}, the hidden states that
    each attention module actually received (forward pre-hooks with kwargs on GPT2Attention /
    BertSelfAttention). ``with_mask=True`` also returns {layer: attention_mask it received}.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("input_ids: expected a LongTensor of shape (1, n)")
    layers = range(num_layers(model)) if layers is None else [_check_layer(model, int(i)) for i in layers]
    xs, masks, handles = {}, {}, []

    def hook_for(i):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            xs[i] = h[0].detach().clone()
            masks[i] = kwargs.get("attention_mask")
        return hook

    try:
        for i in layers:
            handles.append(_attention_core(model, i).register_forward_pre_hook(hook_for(i), with_kwargs=True))
        with torch.no_grad():
            model(input_ids=input_ids.to(next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
    return (xs, masks) if with_mask else xs


# ---------------------------------------------------------------------- wrapping
def causal_mask(n: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The additive mask eager attention expects, shape (1, 1, n, n): 0 where key j <= query i,
    the dtype's most negative finite value above the diagonal (as transformers' ``eager_mask``)."""
    keep = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    mask = torch.zeros(n, n, dtype=dtype, device=device).masked_fill(~keep, torch.finfo(dtype).min)
    return mask[None, None]


def attention_function(model, layer: int, *, masked: bool | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Layer ``layer``'s multi-head self-attention as a function X (..., n, d) -> (..., n, d).

    GPT-2: ``block.attn`` (c_attn, per-head softmax, c_proj with its bias). BERT:
    ``attention.output.dense(attention.self(X))``, i.e. before the residual and LayerNorm.
    ``masked`` defaults to the model's own mask (causal for GPT-2 and BERT as a decoder), passed
    explicitly as an additive mask since a module called alone applies none; ``masked=False`` on
    GPT-2 (or ``True`` on a BERT encoder) gives the ablation with the same weights.
    """
    kind = model_kind(model)
    core = _attention_core(model, layer)
    dense = _layers(model)[_check_layer(model, layer)].attention.output.dense if kind == "bert" else None
    masked = is_causal(model) if masked is None else bool(masked)

    def f(X: torch.Tensor) -> torch.Tensor:
        if model.training:
            raise ValueError("model: is in training mode (dropout makes f random); call model.eval()")
        if not isinstance(X, torch.Tensor) or X.dim() < 2:
            raise ValueError("X: expected a tensor of shape (..., n, d)")
        lead = X.shape[:-2]
        Xb = X.reshape(-1, *X.shape[-2:])
        mask = causal_mask(X.shape[-2], X.dtype, X.device) if masked else None
        y = core(Xb, attention_mask=mask)[0]
        if dense is not None:
            y = dense(y)
        return y.reshape(*lead, *y.shape[-2:])

    f.masked = masked
    f.layer = _check_layer(model, layer)
    f.kind = kind
    return f


# ---------------------------------------------------------------------- parameters
@dataclass
class LayerParameters:
    """Per-head parameters of one attention layer (MATH.md 1), H heads of size k, width d.

    Q, K, V: (H, k, d); b_Q, b_K, b_V: (H, k); W_O: (d, H k); bias: (d,); scale: the factor on
    <q, k> (1/sqrt(k) by default, GPT-2 may add 1/(layer+1)); masked: the model's own mask.
    The layer computes f(X) = concat_h softmax((X Q_h^T + b_Q)(X K_h^T + b_K)^T scale) (X V_h^T + b_V) W_O^T + bias.
    """

    Q: torch.Tensor
    K: torch.Tensor
    V: torch.Tensor
    b_Q: torch.Tensor
    b_K: torch.Tensor
    b_V: torch.Tensor
    W_O: torch.Tensor
    bias: torch.Tensor
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

    def A(self, head: int | None = None) -> torch.Tensor:
        """A_h = scale K_h^T Q_h, (d, d); all heads stacked (H, d, d) when ``head`` is None."""
        A = self.scale * self.K.transpose(-1, -2) @ self.Q
        return A if head is None else A[head]

    def W_O_block(self, head: int) -> torch.Tensor:
        """The columns of W_O that act on head ``head``'s output, (d, k)."""
        k = self.head_dim
        return self.W_O[:, head * k:(head + 1) * k]

    def to_meanfield(self, masked: bool | None = None):
        """The layer as ``meanfield.MultiHeadAttention`` (heads from ``SelfAttention.from_qkv``)."""
        from meanfield import MultiHeadAttention, SelfAttention

        masked = self.masked if masked is None else bool(masked)
        heads = [SelfAttention.from_qkv(self.Q[h], self.K[h], self.V[h], b_Q=self.b_Q[h], b_K=self.b_K[h],
                                        b_V=self.b_V[h], scale=self.scale, masked=masked)
                 for h in range(self.num_heads)]
        return MultiHeadAttention(heads, self.W_O, bias=self.bias)


def extract_layer(model, layer: int) -> LayerParameters:
    """Per-head parameters of layer ``layer`` from BERT (``nn.Linear`` query/key/value and
    ``output.dense``, weight (out, in)) or GPT-2 (fused ``Conv1D`` c_attn, weight (in, 3 d), and
    c_proj, weight (in, out)). Copies, detached; same dtype and device as the model."""
    kind = model_kind(model)
    core = _attention_core(model, layer)
    layer = _check_layer(model, layer)
    if kind == "gpt2":
        if getattr(core, "is_cross_attention", False):
            raise ValueError("layer: cross-attention is not self-attention")
        d = core.embed_dim
        W, b = core.c_attn.weight.detach().T, core.c_attn.bias.detach()  # (3d, d): rows q | k | v
        Wq, Wk, Wv = W[:d], W[d:2 * d], W[2 * d:]
        bq, bk, bv = b[:d], b[d:2 * d], b[2 * d:]
        W_O, bias = core.c_proj.weight.detach().T, core.c_proj.bias.detach()
        H, k = core.num_heads, core.head_dim
    else:
        Wq, Wk, Wv = (m.weight.detach() for m in (core.query, core.key, core.value))
        bq, bk, bv = (m.bias.detach() for m in (core.query, core.key, core.value))
        dense = _layers(model)[layer].attention.output.dense
        W_O, bias = dense.weight.detach(), dense.bias.detach()
        H, k = core.num_attention_heads, core.attention_head_size

    def heads(M):
        return M.reshape(H, k, -1).clone() if M.dim() == 2 else M.reshape(H, k).clone()
    return LayerParameters(Q=heads(Wq), K=heads(Wk), V=heads(Wv), b_Q=heads(bq), b_K=heads(bk), b_V=heads(bv),
                           W_O=W_O.clone(), bias=bias.clone(), scale=float(core.scaling), masked=is_causal(model),
                           kind=kind, layer=layer)
