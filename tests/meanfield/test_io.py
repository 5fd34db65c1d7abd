"""Saving and loading trajectories and Lipschitz estimates: exact round trips, the documented
format read by numpy alone, crafted files refused."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from meanfield import (
    IsotropicAttention,
    LipschitzEstimate,
    SelfAttention,
    load_estimate,
    load_trajectory,
    local_lipschitz,
    save_estimate,
    save_trajectory,
    simulate,
)
from particles import Measure
from particles.io import FileFormatError, read_header


def _att(masked=False, dtype=torch.float64):
    A = torch.tensor([[0.5, 0.2], [-0.1, 0.3]], dtype=dtype)
    return SelfAttention(A, torch.eye(2, dtype=dtype), masked=masked)


@pytest.mark.parametrize("masked, rescale", [(False, False), (True, True)])
def test_trajectory_round_trip(tmp_path, masked, rescale):
    lw = torch.tensor([-math.inf, math.log(0.25), math.log(0.75)], dtype=torch.float64)
    mu = Measure(torch.randn(3, 2, dtype=torch.float64), log_weights=lw, positions=[0.3, 0.6, 1.0] if masked else None)
    traj = simulate(_att(masked), mu, [0.0, 0.5, 1.0], rescale=rescale, options={"steps": 2})
    back = load_trajectory(save_trajectory(traj, tmp_path / "traj.npz", metadata={"layer": 3}))
    assert torch.equal(back.times, traj.times) and torch.equal(back.points, traj.points)
    assert torch.equal(back.log_weights, traj.log_weights) and back.log_weights[0] == -math.inf
    assert torch.equal(back.weights, traj.weights)
    assert (back.positions is None) == (not masked)
    if masked:
        assert torch.equal(back.positions, traj.positions)
    assert (back.method, back.nfev, back.steps, back.geometry) == (traj.method, traj.nfev, traj.steps, traj.geometry)
    if rescale:
        assert torch.equal(back.rescale_V, traj.rescale_V)
        assert torch.equal(back.unscaled().points, traj.unscaled().points)
    assert read_header(tmp_path / "traj.npz")["metadata"] == {"layer": 3}


def test_adaptive_trajectory_round_trip(tmp_path):
    """An adaptive solver (dopri5) counts no fixed steps (steps is None): the file keeps that."""
    pytest.importorskip("torchdiffeq")
    traj = simulate(_att(), Measure.sphere(5, 2, seed=1), [0.0, 0.5, 1.0], method="dopri5", rescale=True)
    assert traj.steps is None
    back = load_trajectory(save_trajectory(traj, tmp_path / "t.npz"))
    assert torch.equal(back.points, traj.points) and torch.equal(back.rescale_V, traj.rescale_V)
    assert (back.method, back.nfev, back.steps) == ("dopri5", traj.nfev, None)


def test_sphere_trajectory_float32_round_trip(tmp_path):
    mu = Measure.sphere(6, 3, seed=0, dtype=torch.float32)
    traj = simulate(IsotropicAttention(1.0, "USA"), mu, [0.0, 1.0], geometry="sphere", options={"steps": 4})
    back = load_trajectory(save_trajectory(traj, tmp_path / "t.npz"))
    assert back.points.dtype == torch.float32 and torch.equal(back.points, traj.points)
    assert back.geometry == "sphere"


def test_trajectories_of_the_previous_release_still_load(tmp_path):
    """Files written before geometry replaced sphere carry ``sphere`` (False, True, "SA", "USA")."""
    for old, geometry in ((False, "euclidean"), (True, "sphere"), ("SA", "sphere"), ("USA", "sphere")):
        back = load_trajectory(_traj_file(tmp_path, header={"geometry": None, "sphere": old}))
        assert back.geometry == geometry
        with pytest.warns(DeprecationWarning, match="geometry"):
            assert back.sphere == (geometry == "sphere")


def test_trajectory_file_is_the_documented_npz(tmp_path):
    traj = simulate(_att(), Measure.sphere(4, 2, seed=0), [0.0, 1.0], options={"steps": 2})
    with np.load(save_trajectory(traj, tmp_path / "t.npz"), allow_pickle=False) as z:
        assert sorted(z.files) == ["header", "log_weights", "points", "times", "weights"]
        header = json.loads(str(z["header"]))
        assert z["points"].shape == (2, 4, 2)
    assert header["kind"] == "trajectory" and header["method"] == "rk4" and header["steps"] == traj.steps


def _traj_file(tmp_path, **change):
    traj = simulate(_att(), Measure.sphere(4, 2, seed=0), [0.0, 0.5, 1.0], options={"steps": 2})
    path = save_trajectory(traj, tmp_path / "t.npz")
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(str(arrays.pop("header")))
    for key, value in change.pop("header", {}).items():
        if value is None:
            header.pop(key, None)   # a field the previous release did not write
        else:
            header[key] = value
    arrays.update(change)
    np.savez(path, header=np.array(json.dumps(header)), **arrays)
    return path


@pytest.mark.parametrize("change, match", [
    (dict(times=np.array([0.0, 1.0])), "2 times for 3 point sets"),
    (dict(times=np.array([0.0, 1.0, 0.5])), "strictly increasing"),
    (dict(weights=np.full(5, 0.2)), "'weights' has 5 entries for 4 atoms"),
    (dict(points=np.zeros((3, 4))), "'points' has shape"),
    (dict(rescale_V=np.eye(3)), "'rescale_V' has shape \\(3, 3\\); expected \\(2, 2\\)"),
    (dict(header={"geometry": "torus"}), "'geometry' is 'torus'"),
    (dict(header={"geometry": None, "sphere": "XY"}), "'sphere'"),
    (dict(header={"nfev": 2.5}), "'nfev' is 2.5"),
    (dict(header={"version": 7}), "format version 7.*upgrade"),
    (dict(header={"kind": "measure"}), "holds a 'measure'.*load_measure"),
    (dict(positions=np.array([object()] * 4, dtype=object)), "Python objects"),
])
def test_trajectory_refuses_crafted_files(tmp_path, change, match):
    with pytest.raises(FileFormatError, match=match):
        load_trajectory(_traj_file(tmp_path, **change))


def test_estimate_round_trip(tmp_path):
    est = local_lipschitz(_att(), Measure.sphere(5, 2, seed=0, dtype=torch.float64))
    back = load_estimate(save_estimate(est, tmp_path / "est.npz", metadata={"R": 1.0}))
    for f in dataclasses.fields(LipschitzEstimate):
        a, b = getattr(est, f.name), getattr(back, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        else:
            assert type(a) is type(b) and a == b, f.name
    assert float(back) == est.value


def test_a_batch_of_estimates_round_trips_and_each_member_is_checked(tmp_path):
    """local_lipschitz on a (b, n, d) batch returns one estimate holding b (tensors of values, errors, flags);
    it saves and loads as that batch (it once failed: 'cannot store torch.bool'), and a member whose fields
    mean nothing a run gives is refused by its index."""
    X = torch.randn(3, 4, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    est = local_lipschitz(_att(), X)
    assert est.batched
    back = load_estimate(save_estimate(est, tmp_path / "b.npz"))
    assert back.batched and len(back) == 3
    for f in dataclasses.fields(LipschitzEstimate):
        a, b = getattr(est, f.name), getattr(back, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        else:
            assert type(a) is type(b) and a == b, f.name
    assert [m.value for m in back] == [m.value for m in est]
    path = save_estimate(est, tmp_path / "bad.npz")
    _rewrite_fields(path, {"error": [0.0, -1.0, 0.0]})
    with pytest.raises(FileFormatError, match=r"batch member 1\): field 'error' is -1.0"):
        load_estimate(path)
    _rewrite_fields(path, {"error": [0.0, 0.0]})
    with pytest.raises(FileFormatError, match="'error' of a batch of 3 estimates"):
        load_estimate(path)


def test_estimate_file_is_the_documented_npz(tmp_path):
    est = local_lipschitz(_att(), torch.randn(4, 2, dtype=torch.float64), method="dense")
    with np.load(save_estimate(est, tmp_path / "e.npz"), allow_pickle=False) as z:
        assert sorted(z.files) == ["header", "vector"]
        header = json.loads(str(z["header"]))
    assert header["kind"] == "lipschitz_estimate"
    assert header["fields"]["value"] == est.value and header["fields"]["method"] == "dense"


def _rewrite_fields(path, fields, drop=()) -> None:
    """Overwrite (or ``drop``) header fields of a saved estimate, as a crafted file would."""
    with np.load(path, allow_pickle=False) as z:
        vector = z["vector"]
        header = json.loads(str(z["header"]))
    header["fields"].update(fields)
    for key in drop:
        del header["fields"][key]
    np.savez(path, header=np.array(json.dumps(header)), vector=vector)


@pytest.mark.parametrize("fields, match", [
    ({"value": "big"}, "'value' is 'big'"),
    ({"converged": 1}, "'converged' is 1"),
    ({"iterations": True}, "'iterations' is True"),
    ({"bogus": 1.0}, "unknown: \\['bogus'\\]"),
])
def test_estimate_refuses_crafted_fields(tmp_path, fields, match):
    est = local_lipschitz(_att(), torch.randn(4, 2, dtype=torch.float64), method="dense")
    path = save_estimate(est, tmp_path / "e.npz")
    _rewrite_fields(path, fields)
    with pytest.raises(FileFormatError, match=match):
        load_estimate(path)
    _rewrite_fields(path, {}, drop=("value",))
    with pytest.raises(FileFormatError, match="missing: \\['value'\\]"):
        load_estimate(path)


def test_wrong_objects_and_kinds(tmp_path):
    mu = Measure.sphere(3, 2, seed=0)
    with pytest.raises(TypeError, match="traj:"):
        save_trajectory(mu, tmp_path / "x.npz")
    with pytest.raises(TypeError, match="est:"):
        save_estimate(1.0, tmp_path / "x.npz")
    from particles import save_measure

    save_measure(mu, tmp_path / "m.npz")
    with pytest.raises(FileFormatError, match="holds a 'measure'"):
        load_estimate(tmp_path / "m.npz")


@pytest.mark.parametrize("fields, match", [
    ({"value": math.nan}, "'value' is nan"),
    ({"value": math.inf}, "'value' is inf"),
    ({"value": -5.0}, "'value' is -5.0"),
    ({"error": -1.0}, "'error' is -1.0"),
    ({"error": math.nan}, "'error' is nan"),
    ({"error": math.inf}, "'error' is inf.*did not converge"),
    ({"residual": -1e-3}, "'residual' is -0.001"),
    ({"iterations": -3}, "'iterations' is -3; a count is >= 0"),
    ({"applications": -1}, "'applications' is -1"),
    ({"method": "magic"}, "'method' is 'magic'; expected one of \\('lanczos', 'power', 'dense'\\)"),
])
def test_estimate_fields_must_mean_what_they_say(tmp_path, fields, match):
    """A certified-looking estimate (converged=True) with a value, error or count that no run of
    local_lipschitz gives is refused; the file as saved loads."""
    est = local_lipschitz(_att(), torch.randn(4, 2, dtype=torch.float64), method="dense")
    path = save_estimate(est, tmp_path / "e.npz")
    assert load_estimate(path).converged
    _rewrite_fields(path, fields)
    with pytest.raises(FileFormatError, match=match):
        load_estimate(path)


def test_an_unconverged_estimate_may_carry_an_infinite_error_and_the_vector_is_checked(tmp_path):
    est = local_lipschitz(_att(), torch.randn(4, 2, dtype=torch.float64), method="dense")
    path = save_estimate(est, tmp_path / "e.npz")
    with np.load(path, allow_pickle=False) as z:
        vector = z["vector"]
        header = json.loads(str(z["header"]))
    header["fields"].update(error=math.inf, converged=False)
    np.savez(path, header=np.array(json.dumps(header)), vector=vector)
    assert load_estimate(path).error == math.inf
    for bad, match in [(vector * np.nan, "NaN or infinite"), (2 * vector, "norm 2"), (vector[:0], "empty")]:
        np.savez(path, header=np.array(json.dumps(header)), vector=bad)
        with pytest.raises(FileFormatError, match=match):
            load_estimate(path)


@pytest.mark.parametrize("change, match", [
    (dict(header={"method": "magic"}), "'method' is 'magic'"),
    (dict(header={"nfev": -1}), "'nfev' is -1; a count is >= 0"),
    (dict(header={"steps": -2}), "'steps' is -2"),
    (dict(rescale_V=np.full((2, 2), np.nan)), "'rescale_V' contains NaN"),
])
def test_trajectory_header_fields_must_mean_what_they_say(tmp_path, change, match):
    with pytest.raises(FileFormatError, match=match):
        load_trajectory(_traj_file(tmp_path, **change))


def test_trajectory_shapes_are_checked_before_any_data_is_read(tmp_path):
    """A trajectory whose weights have the wrong length is refused before its (large, compressed) points are
    decompressed: the traced allocation peak stays below the size of 'points'."""
    import tracemalloc

    path = _traj_file(tmp_path)
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["points"] = np.zeros((3, 10**6, 2))   # 48 MB, compresses to a few dozen KB
    np.savez_compressed(path, **arrays)
    tracemalloc.start()
    try:
        with pytest.raises(FileFormatError, match="'weights' has 4 entries for 1000000 atoms"):
            load_trajectory(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak


def test_loading_on_cuda_without_cuda_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    est = local_lipschitz(_att(), torch.randn(4, 2, dtype=torch.float64), method="dense")
    path = save_estimate(est, tmp_path / "e.npz")
    with pytest.raises(ValueError, match="CUDA is not available"):
        load_estimate(path, device="cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        load_trajectory(_traj_file(tmp_path), device="cuda:0")


def test_an_estimate_written_before_the_attention_field_loads_as_not_recorded(tmp_path):
    est = local_lipschitz(_att(), Measure.sphere(5, 2, seed=0, dtype=torch.float64))
    path = save_estimate(est, tmp_path / "old.npz")
    _rewrite_fields(path, {}, drop=("attention",))
    assert load_estimate(path).attention == "not recorded"
    _rewrite_fields(path, {"attention": "fast"})
    with pytest.raises(FileFormatError, match="field 'attention' is 'fast'"):
        load_estimate(path)
