"""Your own checkpoint: a Hugging Face attention layer as an operator, its local constant and its token dynamics.

``meanfield.hf.HFAttention`` wraps a BERT or GPT-2 attention layer as an operator of the framework
(docs/math.md section 2): the same calls as for ``SelfAttention`` apply to it, here
``local_lipschitz`` on the hidden states that the layer really receives, for growing prefixes of
the text, and ``simulate``, the layer's attention as the velocity field of the token dynamics, with
the tokens kept on their spheres (``geometry="sphere"``, as LayerNorm would): they gather into a few
clusters (one for the default random BERT; two for the trained MiniLM's layer 3 at T = 20; docs/math.md
section 6.3).

Point it at a local checkpoint folder (``config.json`` and the weights, as written by
``save_pretrained``; a tokenizer in the same folder is used when present)::

    python examples/hf_checkpoint.py --checkpoint /path/to/bert-base-uncased [--layer 3] [--text file.txt]
    SMOOTH_ATTENTION_CHECKPOINTS=/path/to/gpt2 python examples/hf_checkpoint.py   # the CLI's variable: its first

Nothing is downloaded (``local_files_only=True``). Without a checkpoint it builds a small randomly
initialized BERT from a config (weights of standard deviation 0.1 instead of BERT's 0.02, so that
attention is not nearly uniform) and feeds it random token ids. Needs ``pip install
smooth-attention[models]`` (transformers).

    python examples/hf_checkpoint.py [--out DIR] [--tiny]

Next to the figure: ``hf_checkpoint.csv`` (the constants against n; the diameter and the number of
clusters against t) and ``hf_checkpoint_trajectory.npz`` (``meanfield.io.load_trajectory``).
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from meanfield import hf, local_lipschitz, simulate  # noqa: E402
from meanfield.clustering import count_clusters  # noqa: E402
from meanfield.io import save_trajectory  # noqa: E402
from particles import Measure  # noqa: E402

TEXT = ("Attention layers move every token towards a weighted average of the others, with weights "
        "given by a softmax of scores. How far a small change of the input can move the output is the "
        "local Lipschitz constant of the layer, and iterating the layer moves the tokens as particles. ") * 8


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("SMOOTH_ATTENTION_EXAMPLES_OUT", "examples_output"),
                        help="folder for the figure (default: $SMOOTH_ATTENTION_EXAMPLES_OUT or examples_output)")
    parser.add_argument("--tiny", action="store_true",
                        default=os.environ.get("SMOOTH_ATTENTION_EXAMPLES_TINY", "") not in ("", "0"),
                        help="small sizes, for CI (also $SMOOTH_ATTENTION_EXAMPLES_TINY=1)")
    listed = [c for c in os.environ.get("SMOOTH_ATTENTION_CHECKPOINTS", "").split(os.pathsep) if c]
    parser.add_argument("--checkpoint", default=listed[0] if listed else None,
                        help="a local BERT or GPT-2 checkpoint folder (default: the first of "
                             "$SMOOTH_ATTENTION_CHECKPOINTS, the variable of `meanfield real_models`; none: a small "
                             "random BERT)")
    parser.add_argument("--layer", type=int, default=None, help="the layer to study (default: the last)")
    parser.add_argument("--text", default=None, help="a text file to feed the model (needs a tokenizer)")
    return parser.parse_args(argv)


def load(checkpoint, tiny: bool, text_file=None):
    """(model in float64 and eval mode, input ids (1, n), a description)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one line per weight file is noise here
    if checkpoint is None:
        width = 32 if tiny else 64
        config = transformers.BertConfig(hidden_size=width, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=2 * width, vocab_size=1000, max_position_embeddings=512,
                                         initializer_range=0.1)
        torch.manual_seed(0)
        model = transformers.BertModel(config)
        ids = torch.randint(0, config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(1))
        return model.eval().double(), ids, "random BERT (no checkpoint given)"
    path = Path(checkpoint).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--checkpoint: {path} has no config.json; give a folder written by save_pretrained")
    model = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval().double()
    limit = min(512, getattr(model.config, "max_position_embeddings", 512))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None
    ids = None
    if tokenizer is not None:
        text = Path(text_file).read_text(encoding="utf-8") if text_file else TEXT
        ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=limit)["input_ids"]
        if ids.shape[1] < 8:  # a folder without vocabulary files gives an empty tokenizer
            ids = None
    if ids is None:
        if text_file:
            raise SystemExit(f"--text: {path} has no tokenizer to encode the text with")
        print(f"{path}: no usable tokenizer, feeding random token ids")
        ids = torch.randint(0, model.config.vocab_size, (1, limit), generator=torch.Generator().manual_seed(1))
    return model, ids, f"{path.name} ({type(model).__name__})"


def main(argv=None) -> Path:
    args = parse_args(argv)
    if args.text is not None and args.checkpoint is None:
        raise SystemExit("--text: needs --checkpoint (a folder with a tokenizer)")
    model, ids, what = load(args.checkpoint, args.tiny, args.text)
    layers = hf.num_layers(model)
    layer = layers - 1 if args.layer is None else args.layer
    ns = [n for n in ([8, 16] if args.tiny else [8, 16, 32, 64, 128, 256]) if n <= ids.shape[1]]
    X = hf.capture_attention_inputs(model, ids[:, :ns[-1]], [layer])[layer]  # what the layer receives

    op = hf.HFAttention.from_model(model, layer)
    lips = [local_lipschitz(op, X[:n], tol=1e-6).value for n in ns]
    print(f"{what}, {op!r}: local constants " + ", ".join(f"n={n}: {v:.3f}" for n, v in zip(ns, lips)))

    n_dyn = ns[-1] if args.tiny else 64
    mu = Measure.sequence(X[:n_dyn]) if op.masked else Measure(X[:n_dyn])
    T = 20.0
    times = torch.linspace(0.0, T, 9 if args.tiny else 41, dtype=torch.float64)
    traj = simulate(op, mu, times, method="rk4", geometry="sphere", options={"steps": 2 if args.tiny else 10})
    P = traj.points
    diameter = torch.cdist(P, P).amax(dim=(1, 2)).numpy()
    scale = float(P[0].norm(dim=1).mean())
    clusters = count_clusters(traj, 0.05 * scale)
    print(f"token dynamics: diameter {diameter[0]:.3g} -> {diameter[-1]:.3g}; clusters {clusters[0]} -> "
          f"{clusters[-1]} (single linkage at 5% of the token norm)")

    # a 2-D view of the tokens: the top two principal directions of the initial tokens
    Z0 = P[0] - P[0].mean(0)
    basis = torch.linalg.svd(Z0, full_matrices=False).Vh[:2].T
    view = ((P - P[0].mean(0)) @ basis).numpy()

    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(15, 4.6))
    ax.plot(ns, lips, "o-", color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("number of tokens $n$ (prefix of the input)")
    ax.set_ylabel(r"local constant $\mathrm{Lip}_X(f)$")
    lo, hi = min(lips), max(lips)
    ax.set_ylim(lo - 0.3 * (hi - lo) - 0.05 * hi, hi + 0.3 * (hi - lo) + 0.05 * hi)
    ax.grid(alpha=0.3)
    ax.set_title(f"layer {layer} of {what}", fontsize=10)

    shown = [0, len(times) // 8, len(times) // 4, len(times) - 1]
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(shown)))
    for k, c in zip(shown, colors):
        last = k == shown[-1]
        bx.scatter(view[k, :, 0], view[k, :, 1], s=90 if last else 12, marker="*" if last else "o", color=c,
                   label=f"t = {float(times[k]):g}", zorder=3 if last else 2)
    for i in range(view.shape[1]):
        bx.plot(view[:, i, 0], view[:, i, 1], color="0.75", lw=0.5, zorder=0)
    bx.set_aspect("equal", adjustable="datalim")
    bx.set_xlabel("first principal direction of the tokens at t = 0")
    bx.set_ylabel("second principal direction")
    bx.set_title(f"{n_dyn} tokens under the layer's attention (on their spheres)", fontsize=10)
    bx.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=4, frameon=False, fontsize=9)
    bx.grid(alpha=0.25)

    cx.semilogy(times.numpy(), diameter, color="tab:green")
    cx.set_xlabel("time $t$ (depth)")
    cx.set_ylabel("diameter of the tokens (largest distance)")
    cx.grid(alpha=0.3, which="both")
    cx.set_title(f"{n_dyn} tokens ({_plural(clusters[0], 'cluster')} at t = 0) end in "
                 f"{_plural(clusters[-1], 'cluster')} at t = {T:g}", fontsize=10)
    fig.tight_layout()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hf_checkpoint.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    # what the figure shows, next to it: the constants, the diameter and cluster count over time, the trajectory
    with open(out / "hf_checkpoint.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["panel", "n", "lip", "t", "diameter", "clusters"])
        w.writerows(["local_constant", n, f"{v:.10g}", "", "", ""] for n, v in zip(ns, lips))
        w.writerows(["dynamics", n_dyn, "", f"{float(t):g}", f"{dd:.10g}", int(c)]
                    for t, dd, c in zip(times, diameter, clusters))
    save_trajectory(traj, out / "hf_checkpoint_trajectory.npz", metadata={"what": what, "layer": layer})
    print(f"wrote {path} (data: hf_checkpoint.csv, hf_checkpoint_trajectory.npz)")
    return path


def _plural(k: int, word: str) -> str:
    return f"{k} {word}" + ("" if k == 1 else "s")


if __name__ == "__main__":
    main()
