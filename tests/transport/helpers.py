"""Data and checks shared by the transport tests: seeded float64 points and weights, and a
central finite-difference check of a gradient (an independent truth for autograd)."""

from __future__ import annotations

import numpy as np
import torch

F64 = torch.float64


def rand(n, d, seed=0, scale=1.0):
    return scale * torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=F64)


def rand_weights(n, seed=0):
    w = torch.rand(n, generator=torch.Generator().manual_seed(seed + 100), dtype=F64) + 0.05
    return w / w.sum()


def fd_check(fn, X, h=1e-5, tol=1e-6):
    """The autograd gradient of the scalar fn at X equals central finite differences (step h)."""
    X = X.clone().requires_grad_()
    val = fn(X)
    assert isinstance(val, torch.Tensor) and val.dim() == 0
    (g,) = torch.autograd.grad(val, X)
    fd = torch.zeros_like(X)
    for idx in np.ndindex(*X.shape):
        E = torch.zeros_like(X)
        E[idx] = h
        fd[idx] = (float(fn((X + E).detach())) - float(fn((X - E).detach()))) / (2 * h)
    assert torch.allclose(g, fd, atol=tol, rtol=tol), (g, fd)


def plan_marginal_error(mu, nu, f, g, eps):
    """L1 error of both marginals of pi_ij = a_i b_j exp((f_i + g_j - |x_i - y_j|^2) / eps), summed densely in
    numpy float64: what a streaming solve's reported error must bound (its certificate)."""
    X, Y = mu.points.double().numpy(), nu.points.double().numpy()
    a, b = mu.weights.double().numpy(), nu.weights.double().numpy()
    C = ((X[:, None, :] - Y[None, :, :]) ** 2).sum(-1)
    P = a[:, None] * b[None, :] * np.exp((f.double().numpy()[:, None] + g.double().numpy()[None, :] - C) / eps)
    return np.abs(P.sum(1) - a).sum() + np.abs(P.sum(0) - b).sum()
