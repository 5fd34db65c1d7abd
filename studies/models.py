"""Models and text for the real-model studies: loading BERT / GPT-2 checkpoints, corpus, tokenizers.

The layers themselves become operators in :mod:`meanfield.hf` (:class:`~meanfield.hf.HFAttention`,
:func:`~meanfield.hf.extract_layer`, :func:`~meanfield.hf.capture_attention_inputs`); this module only
brings models and text in:

* models: :func:`load_model` (a local checkpoint directory or a hub name; offline it fails fast
  with a message naming what was missing) and :func:`random_model` (randomly initialized from
  ``BertConfig()`` / ``GPT2Config()`` defaults, i.e. the ``bert-base`` and ``gpt2`` shapes, or tiny
  shapes for tests; BERT also as a causal decoder). Always ``attn_implementation="eager"``,
  safetensors only (pickles on request), never ``trust_remote_code``, float64 by default, in
  eval mode. :func:`load_tokenizer` gives the checkpoint's own tokenizer and refuses a folder
  without tokenizer files. Pretrained weights shipped as a package: :mod:`studies.pretrained`.
* text: :func:`default_corpus` (English prose from the docstrings of a fixed list of Python
  3.11.7's standard-library modules, shipped as package data so that every Python version reads the
  same text; :func:`build_python_corpus` rebuilt it), :func:`read_text` (a user's own text), and
  :class:`HashTokenizer`, a deterministic word-level tokenizer for randomly initialized models (it
  downloads nothing); :func:`encode`.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import math
import os
import re
import socket
from pathlib import Path

import torch

from meanfield.hf import KINDS
from particles.validation import check_bool, check_device, resolve_dtype

__all__ = ["random_model", "tiny_config", "load_model", "check_checkpoint", "check_safetensors", "load_tokenizer",
           "tokenizer_files", "TOKENIZER_FILES",
           "HashTokenizer", "default_corpus", "build_python_corpus", "CORPUS_SOURCES", "CORPUS_FILE",
           "CORPUS_NOTICE", "CORPUS_PYTHON", "CORPUS_SHA256", "read_text", "encode", "ModelNotAvailableError",
           "KINDS"]


class ModelNotAvailableError(OSError):
    """A checkpoint could not be found locally and the hub cannot be reached."""


# ---------------------------------------------------------------------- models
def _config(kind: str, *, tiny: bool, is_decoder: bool, overrides: dict):
    from transformers import BertConfig, GPT2Config

    is_decoder = check_bool(is_decoder, "is_decoder")

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


class _quiet_transformers:
    """Silence transformers' per-tensor loading bar (the run has its own progress lines)."""

    def __enter__(self):
        from transformers.utils import logging as tlog

        self._was = tlog.is_progress_bar_enabled()
        tlog.disable_progress_bar()

    def __exit__(self, *exc):
        from transformers.utils import logging as tlog

        if self._was:
            tlog.enable_progress_bar()


def load_model(name_or_path: str | os.PathLike, *, dtype: torch.dtype = torch.float64, device=None,
               is_decoder=None, local_files_only: bool | None = None, allow_pickle: bool = False):
    """``AutoModel.from_pretrained`` for a GPT-2 or BERT checkpoint, ready for analysis.

    ``name_or_path``: a local directory (config.json + weights) or a hub name. Loaded with
    ``attn_implementation="eager"``, safetensors weights only (pickled ``pytorch_model.bin``
    weights are refused unless ``allow_pickle=True``), never ``trust_remote_code``; converted to
    ``dtype``; eval mode. ``is_decoder=True`` loads BERT as a causal decoder; ``device`` places
    the model (CPU by default). A local directory never touches the network; a hub name uses the
    hub only when reachable and ``HF_HUB_OFFLINE`` is unset (``local_files_only`` overrides the
    detection); otherwise only the local cache is tried, and a missing model raises
    :class:`ModelNotAvailableError` saying what was missing. Weights that lack tensors the config needs
    (which transformers would initialize at random) are a ValueError listing them; only BERT's pooler, unused
    here, may be absent.
    """
    from transformers import AutoModel

    name_or_path = _expand(name_or_path)
    allow_pickle = check_bool(allow_pickle, "allow_pickle")
    is_decoder = check_bool(is_decoder, "is_decoder", allow_none=True)
    # before the weights are read: a dtype name ("float32") as everywhere in the framework, a floating dtype only
    dtype = resolve_dtype(dtype)
    if dtype is None or not dtype.is_floating_point:
        raise TypeError(f"dtype: a model needs a floating-point dtype, got {dtype}")
    device = check_device(device)
    local_files_only = check_bool(local_files_only, "local_files_only", allow_none=True)
    path = Path(name_or_path)
    local = _where(name_or_path)
    if local:
        _check_local_files(path, allow_pickle)
    offline = True if local else _offline(local_files_only)
    cfg = _config_of(name_or_path, local, offline)
    kwargs = dict(attn_implementation="eager", local_files_only=offline, trust_remote_code=False)
    if is_decoder is not None:
        if cfg.model_type != "bert":
            raise ValueError("is_decoder: applies to BERT only (GPT-2 is always causal)")
        kwargs["is_decoder"] = bool(is_decoder)
    if local:
        kwargs["use_safetensors"] = any(path.glob("*.safetensors"))
    elif not allow_pickle:
        kwargs["use_safetensors"] = True
    try:
        with _quiet_transformers():
            model, info = AutoModel.from_pretrained(name_or_path, output_loading_info=True, **kwargs)
    except OSError as exc:
        raise ModelNotAvailableError(f"name_or_path: weights of {str(name_or_path)!r} not available "
                                     f"({exc})") from exc
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - weights that do not fit the config, a library check: the input's fault
        raise ValueError(f"name_or_path: transformers cannot build {str(name_or_path)!r} from its files "
                         f"({type(exc).__name__}: {' '.join(str(exc).split())})") from exc
    # transformers fills tensors the files lack with fresh random values and only prints a report: a layer
    # measured with them would be a random layer under the checkpoint's name
    _refuse_missing(name_or_path, info.get("missing_keys", ()))
    return model.to(device=device, dtype=dtype).eval()


def _refuse_missing(name_or_path, missing) -> None:
    """ValueError naming ``name_or_path`` when the checkpoint lacks tensors the model needs (the pooler, which no
    analysis here uses and encoder-only checkpoints often omit, excepted)."""
    missing = sorted(k for k in missing if k.split(".")[0] != "pooler")
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ValueError(f"name_or_path: the weights of {str(name_or_path)!r} lack {len(missing)} tensor(s) its "
                         f"config.json needs ({shown}); transformers would fill them with random values, so the "
                         "checkpoint is refused: save the complete model with save_pretrained")


def _expected_missing(model, names) -> list[str]:
    """The parameters and persistent buffers of ``model`` (built from the config) that no tensor name of the
    checkpoint's files provides, matched as transformers matches them: the base model's prefix (``bert.``,
    ``transformer.``) stripped, the legacy LayerNorm names ``gamma`` / ``beta`` read as ``weight`` / ``bias``."""
    prefix = model.base_model_prefix + "."
    have = set()
    for name in names:
        name = name[len(prefix):] if name.startswith(prefix) else name
        parts = name.split(".")
        parts[-1] = {"gamma": "weight", "beta": "bias"}.get(parts[-1], parts[-1])
        have.add(".".join(parts))
    return [k for k in model.state_dict() if k not in have]


#: a hub repository id: "name" or "owner/name" (what is not of this form, and is not a folder, is a path)
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


def _expand(name_or_path):
    """``name_or_path`` checked (a non-empty str or path), with a leading ``~`` expanded to the home folder as a
    shell would (no hub name starts with one)."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path):
        raise TypeError(f"name_or_path: expected a directory or hub name, got {name_or_path!r}")
    return os.path.expanduser(name_or_path) if str(name_or_path).startswith("~") else name_or_path


def _where(name_or_path) -> bool:
    """True for a local folder; False for a hub name; ModelNotAvailableError for a path that is not a folder."""
    path = Path(name_or_path)
    if path.is_dir():
        return True
    if path.exists():
        raise ModelNotAvailableError(f"name_or_path: {str(path)!r} is a file; give the checkpoint's folder")
    if not _HUB_NAME.fullmatch(str(name_or_path)) or str(name_or_path).startswith((".", "~")):
        raise ModelNotAvailableError(f"name_or_path: no checkpoint directory at {str(path)!r}")
    return False


def _check_local_files(path: Path, allow_pickle: bool) -> None:
    """A local folder's config.json (a JSON object of a supported model_type) and weights (safetensors, each
    well formed), checked without loading anything."""
    import json

    cfg = path / "config.json"
    if not cfg.is_file():
        raise ModelNotAvailableError(f"name_or_path: folder {str(path)!r} has no config.json")
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:   # a UnicodeDecodeError is a ValueError
        raise ValueError(f"name_or_path: {str(cfg)!r} is not a readable JSON file ({type(exc).__name__}: "
                         f"{exc})") from None
    if not isinstance(data, dict) or data.get("model_type") not in KINDS:
        kind = data.get("model_type") if isinstance(data, dict) else None
        raise ValueError(f"name_or_path: {str(cfg)!r} has model_type {kind!r}; expected one of {KINDS}")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        what = ("only pickled weights (pytorch_model.bin), refused unless allow_pickle=True: pickles can run "
                "code; convert them with save_pretrained(folder, safe_serialization=True)") \
            if any(path.glob("*.bin")) else "no weights (model.safetensors)"
        if not (allow_pickle and any(path.glob("*.bin"))):
            raise ModelNotAvailableError(f"name_or_path: folder {str(path)!r} has a config.json but {what}")
    for shard in shards:
        check_safetensors(shard)


def _config_of(name_or_path, local: bool, offline: bool):
    """``AutoConfig`` of a checkpoint, its failures said in one line (what is missing, or what transformers refuses)."""
    from transformers import AutoConfig

    name = str(name_or_path)
    try:
        cfg = AutoConfig.from_pretrained(name_or_path, local_files_only=offline, trust_remote_code=False)
    except OSError as exc:
        where = (f"folder {name!r}: its config.json cannot be read" if local else
                 f"no folder {name!r} here, and {name!r} is not in the local Hugging Face cache while the hub is "
                 "not reachable (offline)" if offline else f"could not fetch {name!r} from the hub")
        raise ModelNotAvailableError(f"name_or_path: model not available: {where} ({exc.__class__.__name__}). "
                                     "Pass a local checkpoint folder, or use random_model().") from exc
    except Exception as exc:  # noqa: BLE001 - transformers' own validation of the fields
        raise ValueError(f"name_or_path: the config.json of {name!r} is refused by transformers "
                         f"({type(exc).__name__}: {' '.join(str(exc).split())})") from exc
    if cfg.model_type not in KINDS:
        raise ValueError(f"name_or_path: model_type {cfg.model_type!r} is not supported (expected {KINDS})")
    return cfg


#: bytes per element of the safetensors dtypes a GPT-2 / BERT checkpoint may hold
_SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                       "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
#: the safetensors library's own bound on the JSON header
_SAFETENSORS_HEADER_MAX = 100_000_000


def check_safetensors(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} of a ``.safetensors`` file, read from its header alone, after checking that
    the header is well formed and that its tensors exactly cover the file (a truncated file, stray bytes, a
    header length beyond the file are a ValueError naming the file, not the library's deserialization error)."""
    import json

    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n > _SAFETENSORS_HEADER_MAX or 0 <= n < 2:
            raise ValueError(f"name_or_path: {str(path)!r} is not a safetensors file: its header length {n} is "
                             f"outside 2 to {_SAFETENSORS_HEADER_MAX} bytes (damaged, or another format)")
        if n < 0 or n > size - 8:
            raise ValueError(f"name_or_path: {str(path)!r} is truncated: {size} bytes, fewer than its own header "
                             f"declares ({max(n, 0) + 8} bytes before any tensor)")
        try:
            header = json.loads(fh.read(n).decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"name_or_path: {str(path)!r} has an unreadable safetensors header "
                             f"({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError(f"name_or_path: {str(path)!r} has a safetensors header that is not a JSON object")
    out, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            ok = (dtype in _SAFETENSORS_DTYPES and all(isinstance(s, int) and s >= 0 for s in shape)
                  and isinstance(begin, int) and isinstance(end, int)
                  and end - begin == _SAFETENSORS_DTYPES[dtype] * math.prod(shape) and begin >= 0)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"name_or_path: {str(path)!r}: tensor {name!r} has an invalid entry in the header "
                             f"({str(entry)[:120]})")
        out[name] = (dtype, shape)
        spans.append((begin, end))
    spans.sort()
    covered = 0
    for begin, end in spans:
        if begin != covered:
            raise ValueError(f"name_or_path: {str(path)!r}: the tensors' data overlap or leave a gap at byte {covered}")
        covered = end
    data = size - 8 - n
    if covered != data:
        state = "truncated" if data < covered else "followed by stray bytes"
        raise ValueError(f"name_or_path: {str(path)!r} is {state}: its header describes {covered} bytes of tensors, "
                         f"the file holds {data}")
    return out


def check_checkpoint(name_or_path, *, tokenizer: bool = False, local_files_only: bool | None = None) -> str:
    """Check a checkpoint before anything loads it; return its model type (``"gpt2"`` or ``"bert"``).

    A local folder: config.json is JSON of a supported model type that transformers accepts and builds (on
    the meta device: no memory), its safetensors files are complete (:func:`check_safetensors`) and hold
    every tensor that model needs (by name; the pooler excepted: a ValueError listing the missing ones) and, with
    ``tokenizer=True``, tokenizer files are there. A hub name (``name`` or ``owner/name`` that is not a
    folder): its config is found in the local cache, or on the hub when it is reachable. Anything else (a
    path that is not a folder, a file) is a :class:`ModelNotAvailableError`; a malformed file a ValueError;
    both name what to change.
    """
    from transformers import AutoModel

    name_or_path = _expand(name_or_path)
    local_files_only = check_bool(local_files_only, "local_files_only", allow_none=True)
    local = _where(name_or_path)
    if local:
        _check_local_files(Path(name_or_path), allow_pickle=False)
    cfg = _config_of(name_or_path, local, True if local else _offline(local_files_only))
    if local:
        try:
            with torch.device("meta"):
                skeleton = AutoModel.from_config(cfg, attn_implementation="eager")
        except Exception as exc:  # noqa: BLE001 - an inconsistent config (heads that do not divide the width, ...)
            raise ValueError(f"name_or_path: the config.json of {str(name_or_path)!r} does not describe a model "
                             f"transformers can build ({type(exc).__name__}: {' '.join(str(exc).split())})") from exc
        names = [k for shard in sorted(Path(name_or_path).glob("*.safetensors")) for k in check_safetensors(shard)]
        _refuse_missing(name_or_path, _expected_missing(skeleton, names))
        if tokenizer and tokenizer_files(name_or_path) is None:
            wanted = " or ".join(" + ".join(files) for files in TOKENIZER_FILES)
            raise ModelNotAvailableError(f"name_or_path: checkpoint folder {str(name_or_path)!r} has no tokenizer "
                                         f"files (expected {wanted}); save the tokenizer beside the model")
    return cfg.model_type


#: Files from which transformers builds a GPT-2 / BERT tokenizer, any one of these sets being enough.
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.txt",), ("vocab.json", "merges.txt"))


def tokenizer_files(folder) -> tuple[str, ...] | None:
    """The first set of :data:`TOKENIZER_FILES` present in ``folder``, or None when it has none."""
    folder = Path(folder)
    for files in TOKENIZER_FILES:
        if all((folder / f).is_file() for f in files):
            return files
    return None


def load_tokenizer(name_or_path, *, local_files_only: bool | None = None):
    """The checkpoint's own tokenizer (``AutoTokenizer``, same offline rules as :func:`load_model`).

    A local folder without tokenizer files (a model saved with ``save_pretrained`` alone) is a
    :class:`ModelNotAvailableError` naming the files it lacks, never an empty tokenizer: save the
    tokenizer beside the model (``tokenizer.save_pretrained(folder)``). A tokenizer whose
    vocabulary is empty is refused the same way.
    """
    from transformers import AutoTokenizer

    name_or_path = _expand(name_or_path)
    local_files_only = check_bool(local_files_only, "local_files_only", allow_none=True)
    local = _where(name_or_path)
    if local and tokenizer_files(name_or_path) is None:
        wanted = " or ".join(" + ".join(files) for files in TOKENIZER_FILES)
        raise ModelNotAvailableError(
            f"name_or_path: checkpoint folder {str(name_or_path)!r} has no tokenizer files (expected {wanted}); "
            "a model saved with save_pretrained alone lacks them: save its tokenizer into the same folder with "
            "tokenizer.save_pretrained(folder)")
    offline = True if local else _offline(local_files_only)
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=offline, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ModelNotAvailableError(f"name_or_path: tokenizer of {str(name_or_path)!r} not available ({exc})") from exc
    if len(tok) == 0:
        raise ModelNotAvailableError(f"name_or_path: the tokenizer of {str(name_or_path)!r} has an empty vocabulary")
    return tok


# ---------------------------------------------------------------------- text
#: The default corpus, shipped with the package (prose of Python docstrings), pinned so that two Python
#: versions measure the same tokens (its source and the PSF license: :data:`CORPUS_NOTICE`)
CORPUS_FILE = Path(__file__).resolve().parent / "data" / "python_docstrings.txt"
#: The notice of the shipped corpus, which says where its text comes from and under which license (PSF)
CORPUS_NOTICE = CORPUS_FILE.with_name("python_docstrings.NOTICE.txt")
#: The Python release whose docstrings the shipped corpus holds
CORPUS_PYTHON = "3.11.7"
#: The SHA-256 of the shipped corpus (UTF-8)
CORPUS_SHA256 = "e0aaab8d8bd6e6efe0a0db72bf130d10f9bbf4819e6a5da5a5cd20a1d099af83"

#: The (module, attribute) pairs whose docstrings make the corpus, in a fixed order (English prose
#: written by Python's authors)
CORPUS_SOURCES: tuple[tuple[str, str], ...] = (
    ("heapq", "__about__"), ("copy", "__doc__"), ("sched", "__doc__"), ("tempfile", "__doc__"),
    ("random", "__doc__"), ("collections", "__doc__"), ("timeit", "__doc__"), ("subprocess", "__doc__"),
    ("ftplib", "__doc__"), ("smtplib", "__doc__"), ("getopt", "__doc__"), ("csv", "__doc__"),
    ("json", "__doc__"), ("doctest", "__doc__"), ("unittest", "__doc__"), ("argparse", "__doc__"),
    ("inspect", "__doc__"), ("difflib", "__doc__"), ("string", "__doc__"), ("pprint", "__doc__"),
    # enough text for ten non-overlapping sequences of 512 WordPiece tokens (Section 5.1's protocol)
    ("socketserver", "__doc__"), ("fileinput", "__doc__"), ("pdb", "__doc__"), ("site", "__doc__"),
    ("cmd", "__doc__"), ("pydoc", "__doc__"), ("io", "__doc__"), ("struct", "__doc__"), ("shelve", "__doc__"),
    ("os", "__doc__"), ("ast", "__doc__"), ("statistics", "__doc__"), ("typing", "__doc__"),
)


def _is_prose(paragraph: str) -> bool:
    """Keep paragraphs of running text; drop code samples, tables and ASCII art."""
    lines = paragraph.splitlines()
    if any(ln.startswith("    ") or ">>>" in ln for ln in lines):
        return False
    words = paragraph.split()
    letters = sum(c.isalpha() or c.isspace() for c in paragraph)
    return len(words) >= 8 and letters >= 0.85 * len(paragraph)


def build_python_corpus() -> str:
    """The prose paragraphs of the docstrings of the standard-library modules in :data:`CORPUS_SOURCES`,
    in that order, joined by blank lines, from the running Python.

    This is how :data:`CORPUS_FILE` was built (with Python :data:`CORPUS_PYTHON`); the docstrings change
    with the Python version, so the studies read the shipped file (:func:`default_corpus`), not this.
    """
    paras = []
    for mod, attr in CORPUS_SOURCES:
        doc = inspect.cleandoc(getattr(importlib.import_module(mod), attr) or "")
        for p in re.split(r"\n\s*\n", doc):
            p = p.strip()
            if _is_prose(p):
                paras.append(" ".join(p.split()))
    return "\n\n".join(paras)


def default_corpus() -> str:
    """The real-model studies' default text: English prose from the docstrings of Python
    :data:`CORPUS_PYTHON`'s standard library (:func:`build_python_corpus`), shipped with the package
    as :data:`CORPUS_FILE` (its source and the PSF license in :data:`CORPUS_NOTICE`).

    The same tokens under every Python version, offline; a study records its SHA-256 in its
    configuration. A file whose hash is not :data:`CORPUS_SHA256` (a damaged installation) is an error.
    """
    try:
        data = CORPUS_FILE.read_bytes()
    except OSError as exc:
        raise FileNotFoundError(f"the packaged corpus {CORPUS_FILE} cannot be read ({exc}); reinstall the package "
                                "or give a text (--text FILE)") from exc
    if hashlib.sha256(data).hexdigest() != CORPUS_SHA256:
        raise ValueError(f"the packaged corpus {CORPUS_FILE} is damaged (its SHA-256 is not {CORPUS_SHA256[:12]}...); "
                         "reinstall the package or give a text (--text FILE)")
    return data.decode("utf-8")


def read_text(text: str | None = None, path: str | os.PathLike | None = None) -> str:
    """The user's text (a string or a UTF-8 file), else :func:`default_corpus`."""
    if text is not None and path is not None:
        raise ValueError("text, path: give one of them, not both")
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"path: no text file at {str(p)!r}")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"path: {str(p)!r} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                             f"{exc.start})") from None
        except OSError as exc:
            raise ValueError(f"path: cannot read {str(p)!r} ({exc.strerror or exc})") from None
        if not text.strip():
            raise ValueError(f"path: {str(p)!r} is empty (no words)")
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

    The text is tokenized as one stream, without special tokens ([CLS], [SEP]), so that it can be
    cut into sequences as in the paper's Section 5.1. Raises ValueError when the text has fewer
    than ``n`` tokens (nothing is silently padded).
    """
    if isinstance(tokenizer, HashTokenizer):
        ids = tokenizer.encode(text)
    else:  # verbose=False: the whole text is longer than the model's window on purpose (it is cut later)
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    ids = list(ids)
    if n is not None:
        if n < 1 or len(ids) < n:
            raise ValueError(f"n: the text has {len(ids)} tokens, {n} requested")
        ids = ids[:n]
    return torch.tensor([ids], dtype=torch.long)
