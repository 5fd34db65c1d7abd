"""``meanfield bracket``: a certified bracket for a user's own layer. The saved input is re-verified with a
dense Jacobian of the BERT attention written out here from the checkpoint's weights (independent of
meanfield.hf); the bracket's order (lower <= upper) is a theorem; usage errors exit 64 with one line."""

from __future__ import annotations

import math

import pytest
import torch

from particles.io import load_measure, read_header
from studies import pretrained
from studies.cli import EXIT_USAGE, main
from tests.reference import dense_lipschitz

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random BERT (d = 32, 4 heads, 2 layers) saved as safetensors, without tokenizer files."""
    from studies.models import random_model

    folder = tmp_path_factory.mktemp("tiny_bert")
    model = random_model("bert", size="tiny", seed=3)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def _written_out(model, layer, masked):
    """BERT's attention alone, from its weights: W_O concat_h softmax(q_h k_h^T / sqrt(k)) v_h + b_O."""
    att = model.encoder.layer[layer].attention
    s, o = att.self, att.output.dense
    H = s.num_attention_heads
    k = s.attention_head_size

    def f(X):
        q, kk, v = s.query(X), s.key(X), s.value(X)
        outs = []
        for h in range(H):
            sl = slice(h * k, (h + 1) * k)
            S = q[:, sl] @ kk[:, sl].T / math.sqrt(k)
            if masked:
                S = S.masked_fill(torch.triu(torch.ones_like(S, dtype=torch.bool), 1), -math.inf)
            outs.append(torch.softmax(S, -1) @ v[:, sl])
        return o(torch.cat(outs, dim=1))

    return f


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_bracket_on_a_checkpoint_is_reverified_by_a_dense_jacobian(checkpoint, tmp_path, capsys, mask):
    folder, model = checkpoint
    out = tmp_path / "out"
    code = main(["bracket", "--checkpoint", str(folder), "--layer", "1", "--n", "4", "--radius", "2.5",
                 "--budget", "300", "--mask", mask, "--out", str(out), "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    for word in ("lower", "upper", "ratio", "Jacobian products", "worst_case_input.npz"):
        assert word in printed
    meta = read_header(out / "worst_case_input.npz")["metadata"]
    mu = load_measure(out / "worst_case_input.npz")
    assert mu.points.shape == (4, 32) and float(mu.points.norm(dim=1).max()) <= 2.5 * (1 + 1e-12)
    assert meta["masked"] == (mask == "causal") and (mu.positions is not None) == (mask == "causal")
    dense = dense_lipschitz(_written_out(model, 1, mask == "causal"), mu.points)
    assert abs(dense - meta["lower"]) <= meta["error"] + 1e-9 * dense
    assert meta["lower"] <= meta["upper"]        # a certified lower bound never exceeds an upper bound
    assert f"{meta['lower']:.6g}" in printed


def test_bracket_usage_errors_exit_64_with_one_line(checkpoint, tmp_path, capsys):
    folder, _ = checkpoint
    afile = tmp_path / "file"
    afile.write_text("x")
    cases = [([], "--model NAME or --checkpoint DIR"),
             (["--checkpoint", str(folder), "--n", "4"], "--radius"),           # no tokenizer: no real radius
             (["--checkpoint", str(folder), "--layer", "2", "--radius", "1"], "--layer"),
             (["--checkpoint", str(folder), "--n", "0", "--radius", "1"], "--n"),
             (["--checkpoint", str(folder), "--n", "500", "--radius", "1"], "--n"),
             (["--checkpoint", str(folder), "--radius", "-1"], "--radius"),
             (["--checkpoint", str(folder), "--radius", "1", "--out", str(afile)], "--out"),
             (["--checkpoint", str(tmp_path / "missing"), "--radius", "1"], "--checkpoint")]
    for argv, word in cases:
        assert main(["bracket", *argv]) == EXIT_USAGE, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and word in err[0], (argv, err)
    with pytest.raises(SystemExit) as exc:
        main(["bracket", "--model", "llama"])
    assert exc.value.code == EXIT_USAGE


def test_bracket_checks_the_threads_variable_before_loading(checkpoint, monkeypatch, capsys):
    folder, _ = checkpoint
    monkeypatch.setenv("SMOOTH_ATTENTION_THREADS", "abc")
    assert main(["bracket", "--checkpoint", str(folder), "--radius", "1", "--n", "3"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "$SMOOTH_ATTENTION_THREADS" in err[0], err


@pytest.mark.skipif(not pretrained.is_installed(pretrained.MINILM), reason="the pretrained extra is not installed")
@pytest.mark.parametrize("which", ["attention", "block"])
def test_bracket_radius_of_a_gpt2_map_is_that_of_its_own_input(tmp_path, capsys, which):
    """A pre-LayerNorm GPT-2: the attention receives ln_1(X), the whole block X itself (the residual stream).
    The radius taken from the real text is the largest norm of the map's own input, read here by a forward
    pre-hook on the module the map starts at (for the block, not the attention's input, which has another scale)."""
    import shutil

    from studies import models as hf

    folder = tmp_path / "tiny_gpt2"
    model = hf.random_model("gpt2", size="tiny", seed=3, vocab_size=30522)   # MiniLM's WordPiece vocabulary
    model.save_pretrained(folder, safe_serialization=True)
    for f in pretrained.extract(cache_dir=tmp_path / "cache").iterdir():
        if f.name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
            shutil.copy(f, folder / f.name)
    ids = hf.encode(hf.load_tokenizer(folder), hf.default_corpus(), 6)
    module = model.h[0] if which == "block" else model.h[0].attn
    seen = []
    handle = module.register_forward_pre_hook(lambda m, a, kw: seen.append((a[0] if a else kw["hidden_states"])[0]),
                                              with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    out = tmp_path / which
    assert main(["bracket", "--checkpoint", str(folder), "--layer", "0", "--n", "6", "--map", which,
                 "--budget", "50", "--out", str(out), "--quiet"]) == 0
    meta = read_header(out / "worst_case_input.npz")["metadata"]
    assert meta["map"] == which and meta["radius_from"].startswith("the largest token norm")
    assert meta["R"] == pytest.approx(float(seen[0].norm(dim=1).max()), rel=1e-12)


@pytest.mark.skipif(not pretrained.is_installed(pretrained.MINILM), reason="the pretrained extra is not installed")
def test_bracket_on_the_trained_minilm(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["bracket", "--model", "minilm", "--layer", "-1", "--n", "4", "--budget", "400", "--out",
                 str(out), "--quiet"]) == 0
    meta = read_header(out / "worst_case_input.npz")["metadata"]
    assert meta["layer"] == 5 and meta["radius_from"].startswith("the largest token norm")
    assert 0 < meta["lower"] <= meta["upper"] and meta["text"] <= meta["lower"] * (1 + 1e-6)
    mu = load_measure(out / "worst_case_input.npz")
    assert float(mu.points.norm(dim=1).max()) <= meta["R"] * (1 + 1e-12)


def test_bracket_of_the_whole_block_has_no_upper_bound(checkpoint, tmp_path, capsys):
    folder, _ = checkpoint
    out = tmp_path / "b"
    assert main(["bracket", "--checkpoint", str(folder), "--n", "3", "--radius", "1", "--map", "block",
                 "--budget", "100", "--plain", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "ratio  unknown" in printed
    # the starts (about 1900 products) exceed the budget of 100: the comparison with plain ascent is not called
    # "same budget" (it was, at 4x the work), it says so
    assert "plain gradient ascent, budget 100:" in printed and "not on equal work: the search spent" in printed
    meta = read_header(out / "worst_case_input.npz")["metadata"]
    assert meta["upper"] is None and meta["map"] == "block" and meta["lower"] > 0


def _damaged(folder, tmp_path, name, damage):
    """A copy of the checkpoint folder with one file damaged by ``damage(copy)``."""
    import shutil

    copy = tmp_path / name
    shutil.copytree(folder, copy)
    damage(copy)
    return copy


def _set_config(copy, **fields):
    import json

    cfg = json.loads((copy / "config.json").read_text())
    cfg.update(fields)
    (copy / "config.json").write_text(json.dumps(cfg))


def _cut(path, keep):
    data = path.read_bytes()
    path.write_bytes(keep(data))


@pytest.mark.parametrize("name, damage, words", [
    ("heads", lambda c: _set_config(c, num_attention_heads=5),
     ["does not describe a model", "not a multiple of the number of attention heads"]),
    ("width", lambda c: _set_config(c, hidden_size="big"), ["refused by transformers", "hidden_size"]),
    ("unparsable", lambda c: (c / "config.json").write_text("{not json"), ["config.json", "not a readable JSON"]),
    ("truncated", lambda c: _cut(c / "model.safetensors", lambda d: d[: len(d) // 2]), ["is truncated"]),
    ("header", lambda c: _cut(c / "model.safetensors", lambda d: (2**62).to_bytes(8, "little") + d[8:]),
     ["is not a safetensors file: its header length 4611686018427387904"]),
    ("stray", lambda c: _cut(c / "model.safetensors", lambda d: d + b"\0" * 100), ["followed by stray bytes"]),
    ("noweights", lambda c: (c / "model.safetensors").unlink(), ["no weights"]),
])
def test_bracket_damaged_checkpoints_exit_64_naming_the_file(checkpoint, tmp_path, capsys, name, damage, words):
    """Each damage found before loading (a config transformers refuses or cannot build, a safetensors file cut,
    with a header length beyond the file, or stray bytes): exit 64, one line naming --checkpoint and the
    problem, never a traceback or 'has no config.json' for a config that is there."""
    folder, _ = checkpoint
    copy = _damaged(folder, tmp_path, name, damage)
    assert main(["bracket", "--checkpoint", str(copy), "--radius", "1", "--n", "3", "--budget", "10",
                 "--out", str(tmp_path / "out")]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"meanfield: --checkpoint {copy}"), err
    assert all(w in err[0] for w in words) and "has no config.json" not in err[0], err
    assert not (tmp_path / "out").exists()


def test_bracket_text_cache_and_radius_errors_exit_64(checkpoint, tmp_path, capsys):
    folder, _ = checkpoint
    (tmp_path / "empty.txt").write_text("  \n\t")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "cachefile").write_text("x")
    cases = [(["--text", str(tmp_path / "empty.txt")], "--text: ", "is empty"),
             (["--text", str(tmp_path / "latin1.txt")], "--text: ", "is not UTF-8 text (byte 0xe9 at offset 3)"),
             (["--cache", str(tmp_path / "cachefile")], "--cache: ", "is an existing file"),
             (["--radius", "1e200"], "--radius: at R = 1e+200", "give a smaller radius")]
    for extra, start, words in cases:
        argv = ["bracket", "--checkpoint", str(folder), "--n", "3", "--budget", "50", "--out", str(tmp_path / "o"),
                "--quiet", *(["--radius", "1"] if "--radius" not in extra else []), *extra]
        assert main(argv) == EXIT_USAGE, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("meanfield: " + start) and words in err[0], (extra, err)
    # the largest radius that stays finite still brackets: lower <= upper at R = 1e3
    assert main(["bracket", "--checkpoint", str(folder), "--n", "3", "--budget", "50", "--radius", "1e3", "--out",
                 str(tmp_path / "big"), "--quiet"]) == 0
    meta = read_header(tmp_path / "big" / "worst_case_input.npz")["metadata"]
    assert meta["lower"] <= meta["upper"]


def test_bracket_says_when_the_starts_cost_more_than_the_budget(checkpoint, tmp_path, capsys):
    """--budget 1: the starts are certified anyway (a lower bound needs a certified value); the output says
    what they cost and that the ascent made no step, instead of promising a budget it then exceeds."""
    folder, _ = checkpoint
    out = tmp_path / "b1"
    assert main(["bracket", "--checkpoint", str(folder), "--n", "4", "--radius", "1", "--budget", "1",
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    meta = read_header(out / "worst_case_input.npz")["metadata"]
    assert meta["products"] == meta["start_products"] > 1 and meta["stopped"] == "budget"
    assert f"{meta['products']} Jacobian products ({meta['start_products']} certifying" in captured.out
    assert "the ascent made no step" in captured.out and f"above {meta['start_products']}" in captured.out
    assert "certifying the starts comes first" in captured.err


@pytest.mark.skipif(not pretrained.is_installed(pretrained.MINILM), reason="the pretrained extra is not installed")
def test_bracket_says_the_text_was_projected_into_the_ball(tmp_path, capsys):
    """MiniLM's layer-0 inputs have norms near 10: at --radius 5 the text lies outside B_R, and the output
    says that its constant is the projected text's, with the count and the largest norm."""
    out = tmp_path / "t"
    assert main(["bracket", "--model", "minilm", "--n", "4", "--radius", "5", "--budget", "50", "--out",
                 str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    meta = read_header(out / "worst_case_input.npz")["metadata"]
    assert meta["text_tokens_outside"] == 4
    assert "projected into B_R" in printed and "own constant" not in printed


def test_bracket_verbose_shows_the_solvers_and_threads_override(checkpoint, tmp_path, capsys, monkeypatch):
    """-v prints each certified constant's solver, products and threads; --threads 1 is applied (and the
    environment restored afterwards); a malformed --threads is a usage error naming the option."""
    import logging

    from particles import threads

    folder, _ = checkpoint
    monkeypatch.delenv(threads.ENV, raising=False)
    names = ("meanfield", "transport", "particles", "studies")
    before = [logging.getLogger(name).level for name in names]
    assert main(["bracket", "--checkpoint", str(folder), "--n", "3", "--radius", "1", "--budget", "50",
                 "--threads", "1", "-v", "--out", str(tmp_path / "v")]) == 0
    err = capsys.readouterr().err
    assert "meanfield.lipschitz DEBUG: local_lipschitz:" in err and "1 thread(s)" in err
    assert threads.ENV not in __import__("os").environ and threads.requested_threads() is None
    # the loggers are back at their levels: a -v run in a process does not leave the library at DEBUG
    assert [logging.getLogger(name).level for name in names] == before
    with pytest.raises(SystemExit) as exc:
        main(["bracket", "--checkpoint", str(folder), "--threads", "0"])
    assert exc.value.code == EXIT_USAGE
    assert "--threads" in capsys.readouterr().err


def test_bracket_says_when_no_ascent_step_fit(checkpoint, tmp_path, capsys):
    """A budget just above the starts' cost buys no ascent step: the summary says so and how much to give,
    instead of 'still ascending'."""
    import re

    folder, _ = checkpoint
    common = ["bracket", "--checkpoint", str(folder), "--n", "3", "--radius", "1", "--quiet"]
    assert main([*common, "--budget", "1", "--out", str(tmp_path / "a")]) == 0
    starts = int(re.search(r"\((\d+) certifying", capsys.readouterr().out).group(1))
    assert main([*common, "--budget", str(starts + 1), "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "0 ascending" in out and "still ascending" not in out
    assert "no ascent step fit in the 1 products left after the starts" in out and f"{3 * starts}" in out
