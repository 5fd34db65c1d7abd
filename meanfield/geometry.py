"""Where tokens live during the dynamics: the geometry injected into :func:`meanfield.simulate`.

A geometry is prepared once on the initial points (``prepare(X0)``) and then gives

* ``project(X, V)``: the velocity V (N, d) at the points X made tangent to the manifold;
* ``retract(X)``: the points put back on the manifold after a numerical step (the exact flow
  never leaves it; Runge-Kutta steps drift by O(h^5)).

:class:`Euclidean` is R^d (nothing to do). :class:`Sphere` keeps every token on its sphere
``|x_i| = r_i`` (r_i the initial norms; the unit sphere for the sphere models of docs/math.md section
6): ``x_i' = Proj_{x_i}^perp Gamma(x_i)``, so ``|x_i|`` is conserved.
"""

from __future__ import annotations

import torch

__all__ = ["Euclidean", "Sphere", "GEOMETRIES", "resolve_geometry"]


class Euclidean:
    """Tokens in R^d: velocities and points are left as they are."""

    name = "euclidean"

    def prepare(self, X0: torch.Tensor) -> Euclidean:
        return self

    def project(self, X: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        return V

    def retract(self, X: torch.Tensor) -> torch.Tensor:
        return X

    def __repr__(self) -> str:
        return "Euclidean()"


class Sphere:
    """Each token on its own sphere ``|x_i| = r_i``, with r_i its initial norm."""

    name = "sphere"

    def __init__(self):
        self.radii = None

    def prepare(self, X0: torch.Tensor) -> Sphere:
        norms = X0.detach().norm(dim=-1, keepdim=True)
        if bool((norms == 0).any()):
            raise ValueError("mu0: sphere dynamics need non-zero points (the projection divides by |x|^2)")
        bound = Sphere()
        bound.radii = X0.norm(dim=-1, keepdim=True)
        return bound

    def project(self, X: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        return V - ((V * X).sum(-1, keepdim=True) / (X * X).sum(-1, keepdim=True)) * X

    def retract(self, X: torch.Tensor) -> torch.Tensor:
        return X * (self.radii / X.norm(dim=-1, keepdim=True))

    def __repr__(self) -> str:
        return "Sphere()"


GEOMETRIES = {"euclidean": Euclidean, "sphere": Sphere}


def resolve_geometry(geometry):
    """A geometry object from an instance, a class, or a name ("euclidean", "sphere")."""
    if geometry is None:
        return Euclidean()
    if isinstance(geometry, str):
        if geometry not in GEOMETRIES:
            raise ValueError(f"geometry: expected one of {sorted(GEOMETRIES)}, got {geometry!r}")
        return GEOMETRIES[geometry]()
    if isinstance(geometry, type):
        geometry = geometry()
    if not all(callable(getattr(geometry, m, None)) for m in ("prepare", "project", "retract")):
        raise TypeError(f"geometry: expected an object with prepare, project and retract (Euclidean(), Sphere()), "
                        f"got {type(geometry).__name__}")
    return geometry
