"""load_measure reads archives written on a big-endian machine: the documented .npz with its float arrays (and
its header) stored as '>f8' / '>f4' / '>U', built here by hand with numpy, loads with the values it holds."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from particles import load_measure

# the documented format (particles/io.py module docstring), written out by hand
POINTS = [[1.0, -2.5], [0.125, 3.0], [-7.0, 0.5]]
WEIGHTS = [0.25, 0.25, 0.5]
POSITIONS = [0.0, 0.5, 1.0]


def _write(path, dtype: str, order: str, positions: bool):
    header = {"format": "smooth-attention", "version": 1, "kind": "measure", "dtype": dtype,
              "library_version": "0.0.0", "metadata": {}}
    f = np.dtype(dtype).newbyteorder(order)
    arrays = {"points": np.array(POINTS, dtype=f), "weights": np.array(WEIGHTS, dtype=f),
              "log_weights": np.log(np.array(WEIGHTS, dtype=dtype)).astype(f)}
    if positions:
        arrays["positions"] = np.array(POSITIONS, dtype=f)
    text = json.dumps(header)
    np.savez(path, header=np.array(text, dtype=np.dtype(f"U{len(text)}").newbyteorder(order)), **arrays)
    return path


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("positions", [False, True])
def test_big_endian_archive_loads_with_the_values_it_holds(tmp_path, dtype, positions):
    big = load_measure(_write(tmp_path / "big.npz", dtype, ">", positions))
    little = load_measure(_write(tmp_path / "little.npz", dtype, "<", positions))
    torch_dtype = getattr(torch, dtype)
    assert big.dtype == little.dtype == torch_dtype
    # the values typed above (exact in both dtypes), and the same tensors as the little-endian file
    assert torch.equal(big.points, torch.tensor(POINTS, dtype=torch_dtype))
    assert torch.equal(big.weights, torch.tensor(WEIGHTS, dtype=torch_dtype))
    for name in ("points", "weights", "log_weights"):
        assert torch.equal(getattr(big, name), getattr(little, name)), name
    if positions:
        assert torch.equal(big.positions, torch.tensor(POSITIONS, dtype=torch_dtype))
        assert torch.equal(big.positions, little.positions)
    else:
        assert big.positions is None
