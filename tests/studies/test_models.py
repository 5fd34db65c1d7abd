"""Models and text for the real-model study (studies.models): tokenizers, corpus, checkpoint loading
(offline failures, safetensors only, folders without tokenizer files)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

import pytest
import torch

from meanfield import hf as mhf
from studies import models as hf

pytestmark = pytest.mark.usefixtures("one_thread")  # small problems: threads only contend


@pytest.fixture(scope="module")
def models(one_thread):
    return {("gpt2", False): hf.random_model("gpt2", size="tiny", seed=3),
            ("bert", False): hf.random_model("bert", size="tiny", seed=3)}


def _ids(model, n=9):
    return hf.encode(hf.HashTokenizer(model.config.vocab_size), hf.default_corpus(), n)


def test_hash_tokenizer_is_deterministic():
    tok = hf.HashTokenizer(1000)
    text = "Heaps are arrays, for which a[k] <= a[2*k+1]."
    ids = tok.encode(text)
    words = ["heaps", "are", "arrays", ",", "for", "which", "a", "[", "k", "]", "<", "=", "a", "[", "2", "*", "k",
             "+", "1", "]", "."]
    expect = [1 + int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little") % 999 for w in words]
    assert ids == expect and tok.encode(text) == ids
    assert all(1 <= i < 1000 for i in ids)
    code = ("from studies.models import HashTokenizer; "
            f"print(HashTokenizer(1000).encode({text!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"}).stdout
    assert out.strip() == str(ids)  # another process, another str-hash seed: same ids
    assert tok("a b", return_tensors="pt")["input_ids"].shape == (1, 2)
    with pytest.raises(ValueError, match="vocab_size"):
        hf.HashTokenizer(1)
    with pytest.raises(ValueError, match="n: the text has 2 tokens"):
        hf.encode(tok, "two words", 3)


def test_default_corpus_is_fixed_english_prose():
    text = hf.default_corpus()
    assert text == hf.default_corpus()
    words = text.lower().split()
    assert len(words) > 1500
    common = sum(w in {"the", "of", "and", "to", "a", "is", "in", "that", "it", "be"} for w in words)
    assert common / len(words) > 0.15  # English prose: about a quarter of words are these
    assert text.startswith("Heaps are arrays for which a[k] <= a[2*k+1] and a[k] <= a[2*k+2] for all k")
    assert "The strange invariant above is meant to be an efficient memory representation for a tournament." in text
    assert ">>>" not in text
    assert hf.read_text() == text
    assert hf.read_text("hello world") == "hello world"
    with pytest.raises(ValueError, match="text: is empty"):
        hf.read_text("  ")
    with pytest.raises(ValueError, match="path"):
        hf.read_text(path="/nonexistent/file.txt")


def test_default_corpus_is_pinned_package_data_with_its_source_and_license():
    """The corpus is a file of the package (the same tokens under every Python version), its hash is the
    recorded one, pyproject's package-data ships it with its notice, and the notice names the source,
    the Python release and the PSF license."""
    import fnmatch
    import re
    from pathlib import Path

    data = hf.CORPUS_FILE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == hf.CORPUS_SHA256
    assert hf.default_corpus() == data.decode("utf-8")
    root = Path(__file__).resolve().parents[2]
    table = (root / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    globs = re.findall(r'"([^"]+)"', re.search(r"^studies\s*=\s*\[(.*?)\]", table, re.M | re.S).group(1))
    for f in (hf.CORPUS_FILE, hf.CORPUS_NOTICE):
        rel = f.relative_to(root / "studies").as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not package data of studies"
    notice = hf.CORPUS_NOTICE.read_text(encoding="utf-8")
    for must in (f"Python {hf.CORPUS_PYTHON}", hf.CORPUS_SHA256, "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2",
                 "Copyright (c) 2001", *(f"{m}.{a}" for m, a in hf.CORPUS_SOURCES)):
        assert must in " ".join(notice.split()), must


@pytest.mark.skipif(sys.version.split()[0] != hf.CORPUS_PYTHON, reason="the docstrings differ in other Python versions")
def test_shipped_corpus_is_what_its_python_version_builds():
    assert hf.build_python_corpus() == hf.default_corpus()


def test_a_damaged_corpus_is_an_error_not_another_text(tmp_path, monkeypatch):
    bad = tmp_path / "python_docstrings.txt"
    bad.write_bytes(hf.CORPUS_FILE.read_bytes()[:-10])
    monkeypatch.setattr(hf, "CORPUS_FILE", bad)
    with pytest.raises(ValueError, match="damaged"):
        hf.default_corpus()
    monkeypatch.setattr(hf, "CORPUS_FILE", tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError, match="--text"):
        hf.default_corpus()


def test_offline_hub_name_fails_fast_and_clearly(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    with pytest.raises(hf.ModelNotAvailableError, match="'gpt2' is not in the local Hugging Face cache"):
        hf.load_model("gpt2")
    with pytest.raises(hf.ModelNotAvailableError, match="no checkpoint directory"):
        hf.load_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(hf.ModelNotAvailableError, match="has no config.json"):
        hf.load_model(tmp_path / "empty")


def test_local_checkpoint_round_trip(models, tmp_path):
    """save_pretrained (safetensors) -> load_model: same weights, eager attention, float64, eval."""
    model = models[("gpt2", False)]
    model.save_pretrained(tmp_path / "ckpt")
    loaded = hf.load_model(tmp_path / "ckpt")
    assert loaded.config._attn_implementation == "eager" and not loaded.training
    X = mhf.capture_attention_inputs(model, _ids(model), [1])[1]
    torch.testing.assert_close(mhf.attention_function(loaded, 1)(X), mhf.attention_function(model, 1)(X),
                               rtol=0, atol=0)
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    with pytest.raises(hf.ModelNotAvailableError, match="no weights"):
        hf.load_model(tmp_path / "ckpt")


def _without(folder, drop):
    """Rewrite the folder's model.safetensors without the tensors whose names satisfy ``drop``; return them."""
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    gone = sorted(k for k in state if drop(k))
    save_file({k: v for k, v in state.items() if k not in gone}, folder / "model.safetensors",
              metadata={"format": "pt"})
    return gone


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_checkpoint_lacking_attention_tensors_is_refused_not_filled_at_random(models, tmp_path, kind):
    """Weights without layer 0's attention tensors: transformers alone would load the model with those tensors
    freshly initialized (a random layer under the checkpoint's name, said only in a report on stderr). The check
    before loading and the loading itself refuse it, naming the folder and the missing tensors."""
    from transformers import AutoModel

    folder = tmp_path / kind
    models[(kind, False)].save_pretrained(folder)
    gone = _without(folder, lambda k: (".0.attn." if kind == "gpt2" else ".0.attention.") in k)
    assert gone
    # the premise: transformers itself loads this folder, filling what is missing
    _, info = AutoModel.from_pretrained(folder, attn_implementation="eager", output_loading_info=True)
    assert sorted(k for k in info["missing_keys"] if not k.startswith("pooler.")) == gone
    for call in (hf.check_checkpoint, hf.load_model):
        with pytest.raises(ValueError, match=rf"name_or_path: the weights of '{re.escape(str(folder))}' lack "
                                             rf"{len(gone)} tensor\(s\) .*\({re.escape(gone[0])}, .*random values"):
            call(folder)


def test_checkpoint_lacking_only_the_pooler_or_saved_with_a_head_loads(tmp_path):
    """What is not a defect: a BERT encoder saved without its pooler (unused by every analysis), a GPT-2 saved
    from its LM-head model (names prefixed ``transformer.``), legacy LayerNorm names gamma / beta. Each passes
    the check and loads the saved weights exactly."""
    from safetensors.torch import load_file, save_file
    from transformers import BertModel, GPT2LMHeadModel

    bert = BertModel(hf.random_model("bert", size="tiny", seed=3).config).double().eval()
    bert.save_pretrained(tmp_path / "bert")
    assert _without(tmp_path / "bert", lambda k: k.startswith("pooler."))
    lm = GPT2LMHeadModel(hf.random_model("gpt2", size="tiny", seed=3).config).double().eval()
    lm.save_pretrained(tmp_path / "lm")
    assert all(k.startswith(("transformer.", "lm_head.")) for k in load_file(tmp_path / "lm" / "model.safetensors"))
    bert.save_pretrained(tmp_path / "legacy")
    state = load_file(tmp_path / "legacy" / "model.safetensors")
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in state.items()}
    assert legacy.keys() != state.keys()
    save_file(legacy, tmp_path / "legacy" / "model.safetensors", metadata={"format": "pt"})
    X = torch.randn(5, 32, dtype=torch.float64)
    for folder, original in (("bert", bert), ("lm", lm.transformer), ("legacy", bert)):
        assert hf.check_checkpoint(tmp_path / folder) == original.config.model_type
        loaded = hf.load_model(tmp_path / folder)
        for layer in (0, 1):
            torch.testing.assert_close(mhf.attention_function(loaded, layer, block=True)(X),
                                       mhf.attention_function(original, layer, block=True)(X), rtol=0, atol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        hf.random_model("llama", size="tiny")
    with pytest.raises(ValueError, match="is_decoder"):
        hf.random_model("gpt2", size="tiny", is_decoder=True)
    with pytest.raises(TypeError, match="allow_pickle"):
        hf.load_model("gpt2", allow_pickle="yes")


def _word_tokenizer(folder, words=None):
    """A word-level tokenizer saved with transformers (tokenizer.json), built here from the corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = words if words is not None else sorted(set(hf.default_corpus().lower().split()))[:500]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(folder)


def test_checkpoint_without_tokenizer_files_is_refused_by_name(models, tmp_path):
    """A GPT-2 saved with save_pretrained alone has no tokenizer: a clear error naming the missing files
    (never an empty tokenizer that turns every text into 0 tokens); with the files saved, it loads."""
    ck = tmp_path / "gpt2-no-tokenizer"
    models[("gpt2", False)].save_pretrained(ck)
    assert hf.tokenizer_files(ck) is None
    with pytest.raises(hf.ModelNotAvailableError, match=r"no tokenizer files.*tokenizer\.json or vocab\.txt or "
                                                        r"vocab\.json \+ merges\.txt.*tokenizer\.save_pretrained"):
        hf.load_tokenizer(ck)
    (ck / "vocab.json").write_text("{}")  # half of GPT-2's pair: still refused
    with pytest.raises(hf.ModelNotAvailableError, match="no tokenizer files"):
        hf.load_tokenizer(ck)
    _word_tokenizer(ck)
    assert hf.tokenizer_files(ck) == ("tokenizer.json",)
    tok = hf.load_tokenizer(ck)
    assert len(tok) == 501 and hf.encode(tok, "the heap is a tree").shape == (1, 5)


def test_paths_with_a_tilde_are_the_home_folder_and_missing_folders_are_named(models, tmp_path, monkeypatch):
    """``~/ck`` is the folder ``ck`` in the home folder for the model, the check and the tokenizer (as a shell
    would expand it); a folder that does not exist is named in one message by all three, not passed on to the
    hub's repository-name validation."""
    monkeypatch.setenv("HOME", str(tmp_path))
    models[("gpt2", False)].save_pretrained(tmp_path / "ck")
    _word_tokenizer(tmp_path / "ck")
    assert hf.check_checkpoint("~/ck", tokenizer=True) == "gpt2"
    loaded = hf.load_model("~/ck")
    X = torch.randn(4, 32, dtype=torch.float64)
    torch.testing.assert_close(mhf.attention_function(loaded, 0)(X),
                               mhf.attention_function(models[("gpt2", False)], 0)(X), rtol=0, atol=0)
    assert len(hf.load_tokenizer("~/ck")) == 501
    for missing in ("~/nothing-here", str(tmp_path / "nothing" / "here"), "./rel/missing"):
        for call in (hf.load_model, hf.check_checkpoint, hf.load_tokenizer):
            with pytest.raises(hf.ModelNotAvailableError, match="name_or_path: no checkpoint directory at"):
                call(missing)


def test_pickled_weights_refused_unless_allowed(models, tmp_path):
    """A folder with only pytorch_model.bin (a pickle, which can run code) is refused with a message saying
    why and how to convert it; allow_pickle=True loads it (transformers' weights-only unpickler)."""
    ck = tmp_path / "pickled"
    model = models[("bert", False)]
    model.save_pretrained(ck)
    torch.save(model.state_dict(), ck / "pytorch_model.bin")   # the old pickle format
    (ck / "model.safetensors").unlink()
    with pytest.raises(hf.ModelNotAvailableError, match="pickled weights.*allow_pickle=True.*safe_serialization"):
        hf.load_model(ck)
    loaded = hf.load_model(ck, allow_pickle=True)
    X = torch.randn(5, 32, dtype=torch.float64)
    torch.testing.assert_close(mhf.attention_function(loaded, 0)(X), mhf.attention_function(model, 0)(X),
                               rtol=0, atol=0)


def test_encode_cuts_one_stream_without_special_tokens(tmp_path):
    """Section 5.1 tokenizes the text once and cuts it: no [CLS]/[SEP] added around the text, and no warning
    about the text being longer than the model's window."""
    ck = tmp_path / "tok"
    ck.mkdir()
    _word_tokenizer(ck)
    tok = hf.load_tokenizer(ck)
    tok.model_max_length = 4
    ids = hf.encode(tok, "the heap is a binary tree")[0].tolist()
    vocab = tok.get_vocab()
    assert ids == [vocab.get(w, 0) for w in ["the", "heap", "is", "a", "binary", "tree"]]
