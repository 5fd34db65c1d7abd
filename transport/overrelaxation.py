r"""Over-relaxation of the streaming Sinkhorn: the factor omega and the rule that adapts it.

An over-relaxed Sinkhorn step moves each potential omega times as far as the plain step would
(Thibault, Chizat, Dossal, Papadakis 2017, "Overrelaxed Sinkhorn-Knopp algorithm"; in the log domain)::

    f <- f + omega (T(g) - f),        g <- g + omega (T(f) - g),

omega = 1 being plain Sinkhorn. Near the solution Sinkhorn is a linear iteration whose error shrinks
by a factor rho per step, rho -> 1 as eps -> 0 (the regime of small blur); relaxed, it behaves like
successive over-relaxation of a linear system (Young's theory), whose best factor and rate are

    omega* = 2 / (1 + sqrt(1 - rho)),        rate(omega*) = omega* - 1,

so that rho = 0.975 (a unit cube against its translate at blur 0.05) becomes 0.73: ten times fewer
steps to a given error. rho is not known in advance, so :class:`Relaxation` estimates it from the
errors it observes, window by window: a rate lam seen at factor omega < omega* gives back
rho = (lam + omega - 1)^2 / (lam omega^2) (the eigenvalue relation of SOR), hence a new omega; the
factor only grows (a rate at omega >= omega* is omega - 1 whatever rho is, and says nothing more),
up to :data:`OMEGA_MAX`, and halves its excess over 1 when the error grows :data:`GUARD` times above
the best seen since the start or the last back-off (a divergence guard; the errors after relaxed steps
also swing, so it trips on large swings as well).

What it changes and what it does not: the relaxed potentials are not Sinkhorn iterates, so the error
measured after a relaxed step is not a certificate (the plan's columns are no longer exact); the
solver (``transport.streaming_sinkhorn._solve_pair``) takes a plain step once the relaxed error is within
``transport.streaming_sinkhorn.PROBE`` times tol and stops only after one, reporting the error of a
plan whose columns are exact, as without relaxation. Measured on CPU
(benchmarks/transport.md, "Small blur"): 1.8-8x fewer soft-min passes at blur 0.05, tol 1e-3.
"""

from __future__ import annotations

import math

__all__ = ["OMEGA_MAX", "WINDOW", "GUARD", "young_omega", "Relaxation"]

#: the largest factor the adaptive rule takes; near 2 the relaxed steps stall, their rate omega - 1 tending to 1
OMEGA_MAX = 1.9
#: steps between two estimates of the rate (a shorter window follows the end of the transient sooner; 4
#: took the fewest steps of 4 and 8 in exploratory runs on 1500 points, cube and Gaussian clouds, blur
#: 0.05-0.16, and did better than fewer plain probing steps followed by a single estimate)
WINDOW = 4
#: an error this many times above the best since the start or the last back-off halves omega - 1
GUARD = 10.0


def young_omega(rate: float, omega: float) -> float:
    """The best factor for the plain rate rho that an observed rate ``rate`` at factor ``omega`` implies:
    rho = (rate + omega - 1)^2 / (rate omega^2) (SOR's eigenvalue relation), omega* = 2 / (1 + sqrt(1 - rho)).

    ``rate`` in (0, 1), ``omega`` in [1, 2). At omega = 1, rho = rate.
    """
    if not (0.0 < rate < 1.0 and 1.0 <= omega < 2.0):
        raise ValueError(f"rate, omega: expected 0 < rate < 1 and 1 <= omega < 2, got {rate!r}, {omega!r}")
    rho = min((rate + omega - 1.0) ** 2 / (rate * omega * omega), 1.0 - 1e-12)
    return 2.0 / (1.0 + math.sqrt(1.0 - rho))


class Relaxation:
    """The factor of each relaxed step: fixed (``omega`` a float in [1, 2)) or adaptive (``"auto"``).

    :meth:`observe` takes the marginal error measured before a step and returns the factor for it.
    """

    def __init__(self, omega="auto"):
        self.adaptive = omega == "auto"
        self.omega = 1.0 if self.adaptive else float(omega)
        self._window: list[float] = []
        self._best = math.inf

    def observe(self, err: float) -> float:
        if not self.adaptive or not math.isfinite(err) or err <= 0.0:
            return self.omega
        self._window.append(err)
        self._best = min(self._best, err)
        if self.omega > 1.0 and err > GUARD * self._best:
            self._change(1.0 + (self.omega - 1.0) / 2.0, err)
        elif len(self._window) > WINDOW:
            rate = (self._window[-1] / self._window[0]) ** (1.0 / WINDOW)
            if 0.0 < rate < 1.0:   # 0: an underflowed ratio says nothing of the rate
                self._change(min(OMEGA_MAX, max(self.omega, young_omega(rate, self.omega))), None)
            self._window = [err]
        return self.omega

    def _change(self, omega: float, restart) -> None:
        self.omega = omega
        if restart is not None:   # after a back-off, rates and the best error start again
            self._window, self._best = [restart], restart
