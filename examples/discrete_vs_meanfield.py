"""Discrete versus mean-field: local Lipschitz constants and Lipschitz ratios as the number of tokens n grows.

For i.i.d. samples X_n of a law mu (n tokens uniform on the sphere of radius R), the local constant
Lip_X(f) of the sequence map stays bounded as n grows: by Lemma 3.2 it is the W2-sense constant of
mean-field attention F at the empirical measure m(X_n), which converges to the constant at mu. On
the witness of Proposition 3.4 it grows like sqrt(n), between Proposition 3.4's lower bound and
Theorem 3.3's upper bound, while n << exp(2 gamma R^2) (docs/math.md sections 4 and 5). The right
panel shows the Lipschitz ratio W2(F mu_n, F nu_n) / W2(mu_n, nu_n) of mean-field attention between
n i.i.d. samples mu_n of a Gaussian law and their translate nu_n = mu_n + b (so that
W2(mu_n, nu_n) = |b| exactly): it converges to the ratio of the two laws as n grows, and its spread
over samples shrinks overall (with 8 seeds, not at every n) (docs/math.md section 4.6). R = 3.5 keeps
n <= 1024 far below exp(2 gamma R^2) = 2e5: at R = 2.5 (exp = 518) the witness left the sqrt(n) regime
from n = 256 on.

    python examples/discrete_vs_meanfield.py [--out DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from meanfield import SelfAttention, adversarial, bounds, lipschitz_ratio, local_lipschitz  # noqa: E402
from particles import Measure  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("SMOOTH_ATTENTION_EXAMPLES_OUT", "examples_output"),
                        help="folder for the figure (default: $SMOOTH_ATTENTION_EXAMPLES_OUT or examples_output)")
    parser.add_argument("--tiny", action="store_true",
                        default=os.environ.get("SMOOTH_ATTENTION_EXAMPLES_TINY", "") not in ("", "0"),
                        help="small sizes, for CI (also $SMOOTH_ATTENTION_EXAMPLES_TINY=1)")
    return parser.parse_args(argv)


def main(argv=None) -> Path:
    args = parse_args(argv)
    ns = [8, 16] if args.tiny else [8, 16, 32, 64, 128, 256, 512, 1024]
    seeds = range(2 if args.tiny else 8)
    d, R = 2, 3.5   # 2 gamma R^2 = 12.25: n up to 1024 stays << exp(2 gamma R^2), where the witness follows sqrt(n)
    theta = 0.4  # A = rotation diag(1, -0.5) rotation^T: real eigenvalues, gamma = 0.5 (Proposition 3.4)
    rot = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    A = rot @ np.diag([1.0, -0.5]) @ rot.T
    att = SelfAttention(A, np.eye(d))  # V = I, the setting of Proposition 3.4
    shift = torch.tensor([0.5, 0.0], dtype=torch.float64)

    random_lip, ratios, witness = [], [], []
    for n in ns:
        lips, rs = [], []
        for s in seeds:
            X = Measure.sphere(n, d, R, seed=1000 * s + n).points
            lips.append(local_lipschitz(att, X, tol=1e-8).value)
            mu = Measure.gaussian(n, np.zeros(d), seed=1000 * s + n + 1)
            rs.append(lipschitz_ratio(att, mu, mu.pushforward(lambda Y: Y + shift)))
        random_lip.append(lips)
        ratios.append(rs)
        witness.append(local_lipschitz(att, adversarial.sqrt_n_sequence(A, R, n), tol=1e-8).value)
        print(f"n = {n:4d}: Lip at samples {np.mean(lips):.3f} +/- {np.std(lips):.3f}, at the witness "
              f"{witness[-1]:.3f}; ratio {np.mean(rs):.3f} +/- {np.std(rs):.3f}")
    lower = [bounds.sqrt_n_lower(A, R, n) for n in ns]
    upper = [bounds.sqrt_n_upper(A, np.eye(d), R, n) for n in ns]

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5.4))
    m, sd = np.mean(random_lip, axis=1), np.std(random_lip, axis=1)
    ax.plot(ns, upper, "k-", lw=1.2, label="Theorem 3.3 upper bound")
    ax.plot(ns, witness, "o-", color="tab:red", label="witness of Prop. 3.4")
    ax.plot(ns, lower, "--", color="tab:red", lw=2.5, alpha=0.45, label="Prop. 3.4 lower bound")
    ax.errorbar(ns, m, yerr=sd, fmt="s-", color="tab:blue", capsize=3,
                label=f"i.i.d. on the sphere (mean $\\pm$ sd, {len(seeds)} seeds)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if min(m) / 1.5 <= t <= 1.5 * max(upper)]
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.yaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("number of tokens $n$")
    ax.set_ylabel(r"local constant $\mathrm{Lip}_X(f)$")
    ax.set_title(f"sequences in $B_R$, R = {R}: the worst case grows like $\\sqrt{{n}}$ (n $\\ll e^{{2\\gamma R^2}}$)",
                 fontsize=11)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=9, frameon=False)

    m, sd = np.mean(ratios, axis=1), np.std(ratios, axis=1)
    bx.errorbar(ns, m, yerr=sd, fmt="o-", color="tab:green", capsize=3, label=f"mean $\\pm$ sd over {len(seeds)} seeds")
    bx.axhline(m[-1], color="gray", ls=":", label=f"the mean at n = {ns[-1]}, for reference (not the limit)")
    bx.set_xscale("log", base=2)
    bx.set_xticks(ns, [str(n) for n in ns])
    bx.set_xlabel("number of tokens $n$")
    bx.set_ylabel(r"$W_2(F\mu_n, F\nu_n)\, /\, W_2(\mu_n, \nu_n)$")
    bx.set_title(f"measures: the ratio at n samples and their translate by |b| = {float(shift.norm()):g}",
                 fontsize=11)
    lo, hi = float(np.min(m - sd)), float(np.max(m + sd))
    bx.set_ylim(lo - 0.25 * (hi - lo), hi + 0.45 * (hi - lo))
    bx.grid(alpha=0.3)
    bx.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=9, frameon=False)
    fig.tight_layout()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "discrete_vs_meanfield.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    main()
