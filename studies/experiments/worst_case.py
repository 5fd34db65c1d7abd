"""Study: how smooth is this layer? Certified worst-case inputs between the bounds (docs/math.md section 5.9).

The Lipschitz constant of attention on inputs of radius R, Lip(f on B_R^n) = sup over X in B_R^n of
Lip_X(f), is bracketed by formulas: the best upper bound the framework knows
(``meanfield.upper.operator_upper``: Theorems 3.3 and 3.5 unmasked, 4.3 on masked sequences, Lemma 3.8 over
heads) and Proposition 3.4's witness below. ``meanfield.worst_case_sequence`` searches B_R^n for inputs of
large local constant (projected ascent on the top singular value, a step rule that never accepts a
decrease, restarts from the witnesses of both eigen-cases, hubs, clustered and random tokens); the
certified constant of the best input found is a lower bound on Lip(f on B_R^n). This study runs it

* for random single heads A (d = 3, Gaussian / sqrt(d), V = I), one matrix per eigen-case of
  Proposition 3.4 ("max": lambda_max / 8 >= -lambda_min; "min": otherwise), masked and unmasked,
  against n and R: the bracket, where and by how much the search beats Proposition 3.4's witness
  (evaluated here independently, both eigen-cases where they exist), and plain gradient ascent from
  random starts (``meanfield.plain_gradient_ascent``, the approach the paper reports as giving poor
  results) on the same budget of Jacobian products; the found input re-verified with a dense
  Jacobian of attention written out here; the lengths run shortest first, and a search at n also
  starts from the input found at a shorter length m, repeated (``meanfield.starts.longer_start``: its
  constant is at least the shorter one's), so the bracket's lower end never falls with n
  (docs/math.md section 5.9);
* for layers of the trained all-MiniLM-L6-v2 (the ``pretrained`` extra; the attention alone,
  W_O concat_h f_h + bias, float64) at one length n, R the largest token radius of the layer's
  real inputs on the corpus (so the real sequence is in the ball): the bracket, the witness of the
  head of largest gamma, the real text's own constant; skipped, with the reason, when the extra is
  missing. The test-size grid uses a tiny random BERT instead (labelled as such).

The claims and the independent checks they compare with (formulas and witnesses from numpy, attention and its
dense Jacobian written out): :mod:`studies.experiments.worst_case_claims`.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from meanfield import (
    SearchOptions,
    SelfAttention,
    adversarial,
    bounds,
    local_lipschitz,
    plain_gradient_ascent,
    worst_case_sequence,
)
from meanfield.starts import longer_start, sequence_starts
from particles.threads import ThreadPolicy

from .. import plotting as P
from ..contract import StudyResult, register
from ..grid import run_grid
from ..io import write_csv, write_json, write_with
from .worst_case_claims import (
    CASES,
    CERT_N,
    CERT_RUNS,
    CERT_TOL,
    DENSE_VERIFY,
    PLAIN_MARGIN,
    TOL,
    bracket_claim,
    case_matrix,
    certificate_check,
    certificate_rows,
    dense_claim,
    dense_constant,
    input_key,
    longer_claim,
    naive_attention,
    plain_claim,
    witness_claim,
    witness_deviation,
    witness_sequence,
    written_out,
)

__all__ = ["worst_case", "grid", "search_task", "case_matrix", "witness_sequence", "naive_attention",
           "dense_constant", "input_key", "bracket_claim", "witness_claim", "dense_claim", "plain_claim",
           "longer_claim", "shorter_length", "PLAIN_MARGIN", "certificate_rows", "certificate_check", "CERT_N",
           "CERT_TOL", "CERT_RUNS"]

log = logging.getLogger(__name__)


def grid(level: str) -> dict:
    """Sizes per level: the random heads' dimension ``d``, lengths ``ns``, radii ``Rs``, the budget in
    Jacobian products (the same for the search and for plain ascent), the search's random and
    clustered starts, plain ascent's random starts; ``layers``: the real-layer part (model, layers,
    n, budget, starts, whether plain ascent runs there too, and whose witnesses start the search:
    ``"top"``, the head of largest gamma, or ``"all"`` heads; the search is compared with the best
    witness of all heads either way)."""
    if level == "tiny":
        return {"d": 3, "ns": [2, 4], "Rs": [1.0, 2.0], "budget": 300, "random": 2, "clusters": 1,
                "plain_random": 2,
                "layers": {"model": "bert-tiny-random", "layers": [0], "n": 4, "budget": 300, "random": 1,
                           "clusters": 1, "plain": True, "heads": "all"}}
    if level == "quick":
        return {"d": 3, "ns": [4, 8], "Rs": [1.0, 2.0], "budget": 1500, "random": 4, "clusters": 2,
                "plain_random": 4,
                "layers": {"model": "minilm", "layers": [0], "n": 8, "budget": 2000, "random": 1, "clusters": 2,
                           "plain": True, "heads": "top"}}
    return {"d": 3, "ns": [4, 16, 64], "Rs": [1.0, 2.0, 4.0], "budget": 5000, "random": 8, "clusters": 4,
            "plain_random": 8,
            "layers": {"model": "minilm", "layers": [0, 5], "n": 16, "budget": 6000, "random": 2, "clusters": 2,
                       "plain": True, "heads": "all"}}


# ---------------------------------------------------------------------- one grid point
def shorter_length(n: int, done, masked: bool) -> int | None:
    """The longest length m < n among ``done`` whose found input extends to n without lowering its constant
    (:func:`meanfield.starts.longer_start`: m divides n unmasked, any m masked), or None."""
    fits = [m for m in done if m < n and (masked or n % m == 0)]
    return max(fits) if fits else None


def search_task(case: str, masked: bool, n: int, d: int, R: float, seed: int, budget: int, random: int,
                clusters: int, plain_random: int, shorter: str | None = None, *, device=None) -> dict:
    """The search and plain ascent on one random head at (n, R), both on ``budget`` Jacobian products; the
    witnesses' certified constants; the found input's dense constant (n d <= DENSE_VERIFY). ``shorter``: the
    input found at a shorter length (JSON), extended to n (:func:`meanfield.starts.longer_start`) as one more
    start of the search. Picklable."""
    A, a_seed = case_matrix(d, seed, case)
    V = torch.eye(d, dtype=torch.float64)
    op = SelfAttention(A, V, masked=masked)
    if device not in (None, "cpu"):
        op = op.to(device)
    t0 = time.perf_counter()
    starts, m = None, 0
    if shorter is not None:
        Xm = torch.tensor(json.loads(shorter), dtype=torch.float64, device=device or "cpu")
        m = Xm.shape[0]
        starts = sequence_starts(op, R, n, random=random, clusters=clusters, seed=seed) + [
            (f"longer-n{m}", longer_start(Xm, n, masked=masked))]
    res = worst_case_sequence(op, R, n, budget=budget, starts=starts,
                              options=SearchOptions(random=random, clusters=clusters, seed=seed, tol=TOL))
    plain = plain_gradient_ascent(op, R, n, budget=budget,
                                  options=SearchOptions(random=plain_random, seed=seed, tol=TOL))
    seconds = time.perf_counter() - t0
    row = {"a_seed": a_seed, "gamma": bounds.gamma_info(A.numpy()).gamma, "lower": res.lower,
           "lower_error": res.error, "upper": res.upper.value, "upper_source": res.upper.source,
           "ratio": res.ratio, "products": res.products, "stopped": res.stopped, "best_start": res.start,
           "plain": plain.lower, "plain_error": plain.error, "plain_products": plain.products,
           "plain_upper": plain.upper.value, "seconds": seconds, "longer_from": m,
           "start_longer": next((s.initial for s in res.starts if s.name == f"longer-n{m}"), math.nan)}
    X = res.input.detach().cpu().to(torch.float64)
    row["radius_max"] = float(X.norm(dim=1).max())
    ref = written_out(A, R, n, masked)
    row["upper_formula"], row["prop34_lower"] = ref["upper"], ref["lower"]
    for c in CASES:
        W = witness_sequence(A, R, n, c)
        if W is None:
            row[f"witness_{c}"] = row[f"witness_{c}_error"] = math.nan
            row[f"witness_{c}_built"] = 0.0 if ref[f"witness_{c}"] is None else math.inf
            continue
        row[f"witness_{c}_built"] = witness_deviation(W, ref[f"witness_{c}"])
        est = local_lipschitz(op, W.to(res.input), tol=TOL)
        row[f"witness_{c}"], row[f"witness_{c}_error"] = est.value, est.error
        rec = [s for s in res.starts if s.name == f"prop3.4-{c}"]
        row[f"start_{c}"] = rec[0].initial if rec else math.nan
    row["witness"] = max(row[f"witness_{c}"] for c in CASES if not math.isnan(row[f"witness_{c}"]))
    row["dense"] = dense_constant(X, A, masked) if n * d <= DENSE_VERIFY else math.nan
    row["input"] = json.dumps(X.tolist())   # the found input, exactly (JSON floats round-trip)
    # the ascent, as (products spent, best certified value so far), for the figure
    row["trace"] = json.dumps([[t.products, t.best] for t in res.trace])
    row["plain_trace"] = json.dumps([[t.products, t.best] for t in plain.trace])
    log.info("worst_case: case %s, %s, n = %d, R = %g: search %.4g, witness %.4g, plain ascent %.4g, upper %.4g "
             "(%d products, %.1f s)", case, "masked" if masked else "unmasked", n, R, res.lower, row["witness"],
             plain.lower, res.upper.value, res.products, seconds)
    return row


# ---------------------------------------------------------------------- real layers
def _layer_model(spec: dict, ctx):
    """(model, tokenizer, label, provenance) of the real-layer part, or (None, None, None, reason)."""
    from .. import models as hf
    from .. import pretrained

    try:
        import transformers  # noqa: F401
    except ImportError:
        return None, None, None, "transformers is not installed (pip install 'smooth-attention[pretrained]')"
    if spec["model"] == "bert-tiny-random":
        model = hf.random_model("bert", size="tiny", seed=ctx.seed, dtype=torch.float64)
        return model, hf.HashTokenizer(512), "tiny BERT (random init)", f"random init (tiny, seed {ctx.seed})"
    if not pretrained.is_installed(pretrained.MINILM):
        return None, None, None, ("the pretrained extra is not installed (pip install "
                                  "'smooth-attention[pretrained]'): no trained layer to measure")
    folder = pretrained.extract(pretrained.MINILM, ctx.cache)
    model = hf.load_model(folder, dtype=torch.float64)
    return model, hf.load_tokenizer(folder), "MiniLM", f"pretrained {pretrained.MINILM.source}"


def _layer_rows(spec: dict, ctx, out_dir: Path) -> tuple[list[dict], str]:
    """One row per measured layer: bracket, witness, real text, plain ascent; and what was measured or why not."""
    from meanfield import hf as mhf

    from .. import models as hf

    model, tok, label, why = _layer_model(spec, ctx)
    if model is None:
        log.info("worst_case: trained layers skipped: %s", why)
        return [], why
    n = spec["n"]
    text = hf.read_text(path=ctx.text) if ctx.text is not None else hf.default_corpus()
    ids = hf.encode(tok, text, n)
    xs = mhf.capture_attention_inputs(model, ids, spec["layers"])
    rows = []
    for layer in spec["layers"]:
        t0 = time.perf_counter()
        Xt = xs[layer].detach().to(torch.float64)
        R = float(Xt.norm(dim=1).max())
        op = mhf.HFAttention.from_model(model, layer)
        p = op.parameters()
        infos = [bounds.gamma_info_factored(h.Q.double(), h.K.double(), h.scale) for h in p.heads]
        top = max(range(len(infos)), key=lambda h: infos[h].gamma)
        A_top = p.A(top).detach().to(torch.float64)
        start_heads = [top] if spec["heads"] == "top" else list(range(p.num_heads))
        log.info("worst_case: %s layer %d, n = %d, R = %.3g (largest radius of its real inputs), head %d of largest "
                 "gamma %.3g; the search starts from the witnesses of %s, compared with those of all %d heads",
                 label, layer, n, R, top, infos[top].gamma,
                 f"head {top}" if len(start_heads) == 1 else f"all {len(start_heads)} heads", p.num_heads)
        starts = [("text", Xt)]
        witness = {}   # every head's witnesses are certified: the search is compared with the best of them
        for h in range(p.num_heads):
            A_h = A_top if h == top else p.A(h).detach().to(torch.float64)
            for c in CASES:
                W = witness_sequence(A_h, R, n, c)
                if W is not None:
                    if h in start_heads:
                        starts.append((f"prop3.4-{c}[head {h}]", W))
                    est = local_lipschitz(op, W, tol=TOL)
                    witness[(c, h)] = (est.value, est.error)
        starts.append((f"hub[head {top}]", adversarial.large_radius_configuration(A_top, n=n, R=R, masked=op.masked)))
        g = torch.Generator().manual_seed(ctx.seed)
        for k in range(spec["random"]):
            Z = torch.randn(n, Xt.shape[1], generator=g, dtype=torch.float64)
            starts.append((f"random-{k}", R * Z / Z.norm(dim=1, keepdim=True)))
        for k in range(spec["clusters"]):   # the real sequence's first token alone, the others on one random token
            Z = torch.randn(Xt.shape[1], generator=g, dtype=torch.float64)
            C = (R * Z / Z.norm()).expand(n, -1).clone()
            C[k % n] = Xt[k % n]
            starts.append((f"cluster-{k}", C))
        text_est = local_lipschitz(op, Xt, tol=TOL)
        res = worst_case_sequence(op, R, n, starts=starts, budget=spec["budget"],
                                  options=SearchOptions(tol=TOL, seed=ctx.seed))
        plain = (plain_gradient_ascent(op, R, n, budget=spec["budget"],
                                       options=SearchOptions(random=max(2, spec["random"] + 2), seed=ctx.seed, tol=TOL))
                 if spec["plain"] else None)
        best_c = max(witness, key=lambda c: witness[c][0]) if witness else None   # (case, head)
        started = [c for c in witness if c[1] in start_heads]
        best_start_c = max(started, key=lambda c: witness[c][0]) if started else None
        row = {"model": label, "layer": layer, "n": n, "R": R, "d": Xt.shape[1], "heads": p.num_heads,
               "head": top, "gamma": infos[top].gamma, "case": infos[top].case, "lower": res.lower,
               "lower_error": res.error, "upper": res.upper.value, "upper_source": res.upper.source,
               "ratio": res.ratio, "products": res.products, "stopped": res.stopped, "best_start": res.start,
               "witness": witness[best_c][0] if best_c else math.nan,
               "witness_error": witness[best_c][1] if best_c else math.nan,
               "witness_case": best_c[0] if best_c else "", "witness_head": best_c[1] if best_c else -1,
               "start_heads": spec["heads"],
               "start_witness": witness[best_start_c][0] if best_start_c else math.nan,
               "start_witness_error": witness[best_start_c][1] if best_start_c else math.nan,
               "text": text_est.value, "text_error": text_est.error,
               "plain": plain.lower if plain else math.nan, "plain_products": plain.products if plain else 0,
               "radius_max": float(res.input.norm(dim=1).max()), "budget": spec["budget"],
               "seconds": time.perf_counter() - t0, "provenance": why}
        rows.append(row)
        log.info("worst_case: %s layer %d: %.4g <= Lip <= %.4g (ratio %.2g); witness %.4g, real text %.4g%s "
                 "(%d products, %.1f s)", label, layer, res.lower, res.upper.value, res.ratio or math.nan,
                 row["witness"], text_est.value, f", plain ascent {plain.lower:.4g}" if plain else "",
                 res.products, row["seconds"])
    del model, xs
    gc.collect()
    return rows, f"{label} ({why})"


# ---------------------------------------------------------------------- the study
def check(ctx) -> None:
    """Before any study starts (:mod:`studies.preflight`): the packaged MiniLM the trained-layer part
    measures is extracted into the run's cache (when the pretrained extra is installed; otherwise that
    part is skipped and the report says why)."""
    from .. import preflight, pretrained

    if grid(ctx.level)["layers"]["model"] == "minilm" and pretrained.is_installed(pretrained.MINILM):
        preflight.check_packaged_model(ctx.cache)


#: what worst_case.png shows (the report prints it under the figure)
CAPTION = (
    "Top: the bracket on the Lipschitz constant of f on the ball B_R^n against n (left) and R (middle), cases min "
    "and max: the search's certified lower bound (solid: unmasked, filled markers; masked, open ones), the best "
    "upper bound (dashed) and Proposition 3.4's witness (dotted), these two unmasked; every lower bound must stay "
    "below the upper one, and the search at or above the witness. Top right, unmasked: how tight the bracket is "
    "(lower / upper) against n. Bottom left: "
    "the search over the witness and over plain gradient ascent on the same budget of Jacobian products (above 1: "
    "the search found more). Bottom middle: the best certified constant as products are spent, at the one grid "
    "point its title names. Bottom right: a trained layer's bracket (upper bound, search) beside plain ascent, the "
    "best head's witness and its constant on real text.")


@register("worst_case", "How smooth is this layer? Certified worst-case inputs between the bounds",
          grid=grid, check=check, reads=("text",))
def worst_case(out_dir: Path, ctx) -> StudyResult:
    """Certified worst-case inputs: the bracket on Lip(f on B_R^n) vs n and R, against the witness and plain ascent."""
    # small products: one thread unless --threads / $SMOOTH_ATTENTION_THREADS says otherwise (on a shared
    # machine a second thread only spins: a 384 x 384 eigen-decomposition measured 100x slower on two)
    with ThreadPolicy(step_seconds=0.0):
        return _run(Path(out_dir), ctx)


def _run(out_dir: Path, ctx) -> StudyResult:
    g = grid(ctx.level)
    points = [{"case": c, "masked": m, "n": n, "d": g["d"], "R": R, "seed": ctx.seed, "budget": g["budget"],
               "random": g["random"], "clusters": g["clusters"], "plain_random": g["plain_random"]}
              for c in CASES for m in (False, True) for n in g["ns"] for R in g["Rs"]]
    log.info("worst_case: random heads (d = %d, both eigen-cases, masked and unmasked), n in %s, R in %s, budget %d "
             "Jacobian products per search", g["d"], g["ns"], g["Rs"], g["budget"])
    rows, found = [], {}
    for n in sorted(g["ns"]):   # shortest first: a search at n also starts from the input found at m < n
        here = []
        for p in (p for p in points if p["n"] == n):
            m = shorter_length(n, g["ns"], p["masked"])
            here.append({**p, "shorter": None if m is None else found[(p["case"], p["masked"], m, p["R"])]})
        for r in run_grid(search_task, here, out_dir, f"worst_case_n{n}", ctx, device=ctx.device):
            found[(r["case"], r["masked"], r["n"], r["R"])] = r["input"]
            rows.append({k: v for k, v in r.items() if k != "shorter"})
    order = {(p["case"], p["masked"], p["n"], p["R"]): i for i, p in enumerate(points)}
    rows.sort(key=lambda r: order[(r["case"], r["masked"], r["n"], r["R"])])
    traces = [{"case": r["case"], "masked": r["masked"], "n": r["n"], "R": r["R"], "method": method,
               "products": p, "best": b}
              for r in rows for method, key in (("search", "trace"), ("plain", "plain_trace"))
              for p, b in json.loads(r[key])]
    inputs = {input_key(r): np.asarray(json.loads(r["input"]), dtype=np.float64) for r in rows}
    rows = [{k: v for k, v in r.items() if k not in ("trace", "plain_trace", "input")} for r in rows]
    write_csv(rows, out_dir / "brackets.csv")
    write_with(out_dir / "inputs.npz", lambda tmp: np.savez(tmp, **inputs))
    write_csv(traces, out_dir / "traces.csv")
    t0 = time.perf_counter()
    certs = certificate_rows(g["d"], g["Rs"], ctx.seed)
    write_csv(certs, out_dir / "certificates.csv")
    log.info("worst_case: %d certificates against dense singular values (%.1f s)", len(certs),
             time.perf_counter() - t0)
    layer_rows, layer_what = _layer_rows(g["layers"], ctx, out_dir)
    write_csv(layer_rows, out_dir / "layers.csv")
    write_json({"layers": layer_what, "grid": g}, out_dir / "layers.json")

    claims = [bracket_claim(rows, layer_rows), witness_claim(rows, layer_rows), dense_claim(rows, certs),
              plain_claim(rows, g["budget"], layer_rows), longer_claim(rows)]
    _figure(out_dir, rows, traces, layer_rows, layer_what, g)

    gains = {(r["case"], r["masked"], r["n"], r["R"]): r["lower"] / r["witness"] for r in rows}
    top = max(gains, key=gains.get)
    low = min(gains, key=gains.get)
    ratio = [r["ratio"] for r in rows]
    by_n = {str(n): float(np.median([r["ratio"] for r in rows if r["n"] == n])) for n in g["ns"]}
    by_R = {f"{R:g}": float(np.median([r["ratio"] for r in rows if r["R"] == R])) for R in g["Rs"]}
    summary = {"grid": g, "search_over_witness": {"min": gains[low], "max": gains[top]},
               "lower_over_upper": {"min": min(ratio), "max": max(ratio), "median_by_n": by_n, "median_by_R": by_R},
               "search_over_plain_gmean": float(np.exp(np.mean(np.log([r["lower"] / r["plain"] for r in rows])))),
               "layers": layer_rows, "layers_measured": layer_what,
               "seconds": float(sum(r["seconds"] for r in rows) + sum(r["seconds"] for r in layer_rows))}
    notes = (f"Random heads: A = Gaussian / sqrt({g['d']}) (the first seed from {ctx.seed} in each eigen-case), V = I; "
             f"{g['budget']} Jacobian products per search and per plain ascent. The search beats Proposition 3.4's "
             f"best witness by {gains[low]:.3g}x (case {low[0]}, {'masked' if low[1] else 'unmasked'}, n = {low[2]}, "
             f"R = {low[3]:g}) to {gains[top]:.3g}x (case {top[0]}, {'masked' if top[1] else 'unmasked'}, "
             f"n = {top[2]}, R = {top[3]:g}). The certified bracket lower / upper is {min(ratio):.3g} to "
             f"{max(ratio):.3g}; its median by n: " + ", ".join(f"{n}: {v:.3g}" for n, v in by_n.items())
             + "; by R: " + ", ".join(f"{R}: {v:.3g}" for R, v in by_R.items()) + ". ")
    if layer_rows:
        notes += "Real layers (" + layer_what + "): " + "; ".join(
            f"layer {r['layer']}, n = {r['n']}, R = {r['R']:.3g}: {r['lower']:.4g} <= Lip <= {r['upper']:.4g} "
            f"(ratio {r['ratio']:.2g}), best witness {r['witness']:.4g} (head {r['witness_head']}, case "
            f"{r['witness_case']}, the best of all {r['heads']} heads; the search started from {_start_heads(r)}), "
            f"real text {r['text']:.4g}"
            + (f", plain ascent {r['plain']:.4g}" if not math.isnan(r["plain"]) else "")
            + f", best start {r['best_start']}, {r['products']} products" for r in layer_rows) + ". "
    else:
        notes += f"Trained layers: skipped ({layer_what}). "
    notes += ("For your own layer: `meanfield bracket --model minilm --layer L --n N --radius R` "
              "(docs/studies/worst_case.md).")
    return StudyResult("worst_case", "How smooth is this layer? Certified worst-case inputs", claims,
                       ["worst_case.png"], ["brackets.csv", "traces.csv", "layers.csv", "layers.json", "inputs.npz",
                        "certificates.csv"],
                       summary, notes, captions={"worst_case.png": CAPTION})


def _start_heads(row: dict) -> str:
    """Whose witnesses a real layer's search started from, in words."""
    if row["start_heads"] == "top":
        return f"the witnesses of head {row['head']} (largest gamma) only"
    return "every head's witnesses"


def _figure(out_dir: Path, rows, traces, layer_rows, layer_what, g) -> None:
    fig, axes = P.figure(ncols=3, nrows=2, width=17.0, height=8.6)
    ns, Rs = g["ns"], g["Rs"]
    colors = {"max": P.COLORS[0], "min": P.COLORS[3]}
    # (a), (b): the bracket against n (largest R) and against R (largest n), unmasked and masked
    for ax, x_key, fixed_key, fixed in ((axes[0], "n", "R", max(Rs)), (axes[1], "R", "n", max(ns))):
        for case in CASES:
            for masked in (False, True):
                sel = sorted((r for r in rows if r["case"] == case and r["masked"] == masked
                              and r[fixed_key] == fixed), key=lambda r: r[x_key])
                x = [r[x_key] for r in sel]
                P.measured(ax, x, [r["lower"] for r in sel],
                           f"search, case {case}, {'masked' if masked else 'unmasked'}", color=colors[case],
                           marker="s" if masked else "o", mfc="white" if masked else None, lw=0.9 if masked else 1.2)
                if not masked:
                    P.theory(ax, x, [r["upper"] for r in sel], f"best upper bound, case {case}", color=colors[case])
                    P.theory(ax, x, [r["witness"] for r in sel], f"Prop 3.4 witness, case {case}",
                             color=colors[case], kind="lower")
        P.finish(ax, "sequence length n" if x_key == "n" else "radius R", "bounds on Lip(f on B_R^n)",
                 f"the bracket vs {x_key} ({fixed_key} = {fixed:g})", logx=x_key == "n", logy=True,
                 legend_loc="outside")
        if x_key == "R":   # a few radii: a linear axis labelled at each of them
            ax.set_xticks(Rs, [f"{R:g}" for R in Rs])
    # (c): lower / upper vs n, per case and R (unmasked)
    ax = axes[2]
    for i, R in enumerate(Rs):
        for case in CASES:
            sel = sorted((r for r in rows if r["case"] == case and not r["masked"] and r["R"] == R),
                         key=lambda r: r["n"])
            P.measured(ax, [r["n"] for r in sel], [r["ratio"] for r in sel], f"case {case}, R = {R:g}",
                       color=colors[case], marker="os^"[i % 3], alpha=0.5 + 0.5 * (i + 1) / len(Rs))
    P.finish(ax, "sequence length n", "certified lower / upper bound", "how tight the bracket is (unmasked)",
             logx=True, logy=True, legend_loc="outside")
    # (d): search / witness and search / plain at every (case, n, R); filled markers unmasked, open masked
    ax = axes[3]
    keys = sorted({(r["case"], r["n"], r["R"]) for r in rows})
    pos = {k: i for i, k in enumerate(keys)}
    for masked in (False, True):
        sel = [r for r in rows if r["masked"] == masked]
        x = [pos[(r["case"], r["n"], r["R"])] + (0.15 if masked else -0.15) for r in sel]
        face = "none" if masked else None
        what = "masked" if masked else "unmasked"
        ax.plot(x, [r["lower"] / r["witness"] for r in sel], "o", color=P.COLORS[2], mfc=face,
                label=f"search / best witness, {what}")
        ax.plot(x, [r["lower"] / r["plain"] for r in sel], "s", color=P.COLORS[4], mfc=face,
                label=f"search / plain ascent, {what}")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":", label="ratio 1")
    ax.set_xticks(range(len(keys)), [f"{c}, n={n}, R={R:g}" for c, n, R in keys], rotation=90, fontsize=7)
    P.finish(ax, "grid point (case, n, R)", "ratio of certified constants",
             f"search vs witness and plain ascent ({g['budget']} products each)", logy=True, legend_loc="outside")
    # (e): the ascent at the largest (n, R), unmasked, search vs plain, both cases
    ax = axes[4]
    for case in CASES:
        for method, ls in (("search", "-"), ("plain", ":")):
            sel = [t for t in traces if t["case"] == case and not t["masked"] and t["n"] == max(ns)
                   and t["R"] == max(Rs) and t["method"] == method]
            if sel:
                ax.plot([t["products"] for t in sel], [t["best"] for t in sel], ls=ls, color=colors[case],
                        label=f"{'search' if method == 'search' else 'plain ascent'}, case {case}")
    P.finish(ax, "Jacobian products spent", "best certified constant so far",
             f"the ascent, n = {max(ns)}, R = {max(Rs):g}, unmasked\n(the search's curve starts once its "
             "starts are certified)", legend_loc="outside")
    # (f): real layers
    ax = axes[5]
    if layer_rows:
        marks = [("upper", "upper bound"), ("lower", "search"), ("plain", "plain ascent"),
                 ("witness", "Prop 3.4 witness\n(best head)"), ("text", "real text")]
        marks = [(k, lab) for k, lab in marks if not all(math.isnan(r[k]) for r in layer_rows)]
        for j, r in enumerate(layer_rows):
            ax.plot(np.arange(len(marks)) + 0.1 * (j - (len(layer_rows) - 1) / 2), [r[k] for k, _ in marks],
                    "os^Dv"[j % 5], color=P.COLORS[j % 10], ls="none", ms=7,
                    label=f"layer {r['layer']} (n = {r['n']}, R = {r['R']:.3g})")
        ax.set_xticks(range(len(marks)), [lab for _, lab in marks], rotation=30, ha="right")
        ax.set_xlim(-0.5, len(marks) - 0.5)
        which = (f"layer {layer_rows[0]['layer']}" if len(layer_rows) == 1 else "per layer")
        P.finish(ax, "", "bounds on Lip(f on B_R^n)",
                 f"{layer_rows[0]['model']}: the bracket, {which}", logy=True, legend_loc="outside")
    else:
        ax.text(0.5, 0.5, "trained layers skipped:\n" + layer_what, ha="center", va="center", wrap=True,
                transform=ax.transAxes, fontsize=8)
        ax.set_axis_off()
    from ..io import save_figure

    save_figure(fig, out_dir / "worst_case.png")
