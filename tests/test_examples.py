"""The example gallery runs: each script at its tiny size in its own interpreter, writing a readable PNG
into the folder it is given (argument or environment variable)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPTS = {
    "measure_pushforward": "measure_pushforward.png",
    "discrete_vs_meanfield": "discrete_vs_meanfield.png",
    "token_dynamics": "token_dynamics.png",
    "hf_checkpoint": "hf_checkpoint.png",
}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOOTH_ATTENTION_")}
    # one thread: the examples are tiny here and threads only contend on a loaded machine
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MPLBACKEND="Agg", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _check_png(path: Path):
    import matplotlib.image as mpimg

    assert path.is_file(), f"{path.name} was not written"
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] >= 300 and img.shape[1] >= 600, img.shape
    assert img[..., :3].std() > 0.05  # not a blank canvas


def test_every_script_is_listed():
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted(SCRIPTS)


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - {"token_dynamics"}))  # that one: the next test
def test_example_runs_tiny(name, tmp_path):
    if name == "hf_checkpoint":
        pytest.importorskip("transformers")
    out = tmp_path / "figures"
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--tiny", "--out", str(out)],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {out / SCRIPTS[name]}" in proc.stdout
    _check_png(out / SCRIPTS[name])


def test_output_folder_and_size_from_the_environment(tmp_path):
    out = tmp_path / "from_env"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "token_dynamics.py")], cwd=tmp_path,
                          env=_env(SMOOTH_ATTENTION_EXAMPLES_OUT=str(out), SMOOTH_ATTENTION_EXAMPLES_TINY="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "16 tokens" in proc.stdout  # the tiny size
    _check_png(out / "token_dynamics.png")


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_hf_example_on_a_local_checkpoint_folder(kind, tmp_path, monkeypatch):
    """The documented use: --checkpoint pointing at a folder written by save_pretrained (BERT, or GPT-2
    with its causal mask), loaded without any download."""
    transformers = pytest.importorskip("transformers")
    import importlib.util

    if kind == "bert":
        config = transformers.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=32, vocab_size=50, initializer_range=0.1)
        model = transformers.BertModel(config)
    else:
        config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=50, n_positions=64)
        model = transformers.GPT2Model(config)
    ckpt = tmp_path / kind
    model.save_pretrained(ckpt)
    spec = importlib.util.spec_from_file_location("hf_checkpoint_example", EXAMPLES / "hf_checkpoint.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    path = example.main(["--tiny", "--out", str(tmp_path / "out"), "--checkpoint", str(ckpt), "--layer", "0"])
    _check_png(path)
    with pytest.raises(SystemExit, match="config.json"):
        example.main(["--tiny", "--out", str(tmp_path / "out"), "--checkpoint", str(tmp_path)])
