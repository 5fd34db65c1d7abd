"""Saving and loading measures: exact round trips, the documented format read by numpy alone, and
crafted files refused with errors that say what is wrong."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from particles import Measure, load_measure, save_measure
from particles.io import FORMAT_VERSION, FileFormatError, read_header


def _same(a: Measure, b: Measure):
    assert a.dtype == b.dtype
    assert torch.equal(a.points, b.points)
    assert torch.equal(a.weights, b.weights)
    assert torch.equal(a.log_weights, b.log_weights)  # -inf entries included
    assert (a.positions is None) == (b.positions is None)
    if a.positions is not None:
        assert torch.equal(a.positions, b.positions)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_exact_in_every_float_dtype(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    mu = Measure(torch.randn(7, 3, generator=g, dtype=torch.float64).to(dtype),
                 weights=torch.rand(7, generator=g, dtype=torch.float64).to(dtype), normalize=True)
    back = load_measure(save_measure(mu, tmp_path / "mu.npz"))
    _same(mu, back)
    # a sequence of 300 tokens: in half precision its positions (kept in float32) stay distinct through a file
    seq = Measure.sequence(torch.randn(300, 2, generator=g, dtype=torch.float64).to(dtype))
    back = load_measure(save_measure(seq, tmp_path / "seq.npz"))
    _same(seq, back)
    assert bool((back.positions[1:] > back.positions[:-1]).all())


def test_round_trip_keeps_positions_and_minus_inf_log_weights(tmp_path):
    lw = torch.tensor([-math.inf, -2000.0, 0.0], dtype=torch.float64)  # exp(-2000) underflows to 0
    mu = Measure(torch.randn(3, 2, dtype=torch.float64), log_weights=lw, positions=[0.2, 0.5, 1.0])
    back = load_measure(save_measure(mu, tmp_path / "mu.npz"))
    _same(mu, back)
    assert back.log_weights[1] == -2000.0 and back.weights[1] == 0.0 and back.log_weights[0] == -math.inf


def test_file_is_the_documented_npz(tmp_path):
    """numpy alone (no pickle) reads the documented arrays and JSON header."""
    mu = Measure.sphere(4, 2, seed=1, positions=True)
    path = save_measure(mu, tmp_path / "mu.npz", metadata={"seed": 1, "note": "sphere"})
    with np.load(path, allow_pickle=False) as z:
        assert sorted(z.files) == ["header", "log_weights", "points", "positions", "weights"]
        header = json.loads(str(z["header"]))
        np.testing.assert_array_equal(z["points"], mu.points.numpy())
        np.testing.assert_array_equal(z["positions"], np.arange(1, 5) / 4)
    assert header["format"] == "smooth-attention" and header["version"] == FORMAT_VERSION
    assert header["kind"] == "measure" and header["dtype"] == "float64"
    assert header["metadata"] == {"seed": 1, "note": "sphere"}
    assert read_header(path) == header


def test_saving_detaches_moves_to_cpu_and_needs_no_suffix(tmp_path):
    X = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    mu = Measure(X)
    path = save_measure(mu, tmp_path / "measure")  # no suffix added
    assert path.name == "measure" and path.is_file()
    back = load_measure(path, device="cpu")
    assert not back.points.requires_grad and torch.equal(back.points, X.detach())
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_bad_arguments_name_themselves(tmp_path):
    mu = Measure.sphere(3, 2, seed=0)
    with pytest.raises(TypeError, match="mu:"):
        save_measure(mu.points, tmp_path / "x.npz")
    with pytest.raises(TypeError, match="metadata"):
        save_measure(mu, tmp_path / "x.npz", metadata={"f": object()})
    with pytest.raises(TypeError, match="metadata"):
        save_measure(mu, tmp_path / "x.npz", metadata=[1, 2])
    with pytest.raises(IsADirectoryError, match="path"):
        save_measure(mu, tmp_path)
    with pytest.raises(FileNotFoundError, match="path"):
        load_measure(tmp_path / "missing.npz")


# ---------------------------------------------------------------------- crafted files
def _craft(path, header=None, **arrays):
    base = {"format": "smooth-attention", "version": 1, "kind": "measure", "dtype": "float64", "metadata": {}}
    if header is not None:
        base.update(header)
    np.savez(path, header=np.array(json.dumps(base)), **arrays)
    return path


def _good_arrays(n=3):
    w = np.full(n, 1.0 / n)
    return dict(points=np.arange(2.0 * n).reshape(n, 2), weights=w, log_weights=np.log(w))


def test_a_crafted_file_that_is_valid_loads(tmp_path):
    mu = load_measure(_craft(tmp_path / "ok.npz", **_good_arrays()))
    assert mu.n == 3 and mu.dim == 2


@pytest.mark.parametrize("header, match", [
    ({"version": FORMAT_VERSION + 1}, "format version 2.*upgrade"),
    ({"version": 0}, "invalid format version"),
    ({"version": "1"}, "invalid format version"),
    ({"format": "something-else"}, "not a smooth-attention archive"),
    ({"kind": "trajectory"}, "holds a 'trajectory'.*load_trajectory"),
    ({"dtype": "int64"}, "unknown dtype"),
    ({"dtype": "float32"}, "dtype float64, but the header says float32"),
])
def test_refuses_bad_headers(tmp_path, header, match):
    path = _craft(tmp_path / "bad.npz", header, **_good_arrays())
    with pytest.raises(FileFormatError, match=match):
        load_measure(path)


def test_refuses_pickled_object_arrays(tmp_path):
    path = _craft(tmp_path / "pickle.npz", **_good_arrays(), positions=np.array([object(), 1, 2], dtype=object))
    with pytest.raises(FileFormatError, match="'positions' holds Python objects"):
        load_measure(path)


def test_refuses_a_pickled_header_and_files_that_are_not_archives(tmp_path):
    path = tmp_path / "h.npz"
    np.savez(path, header=np.array([{"format": "smooth-attention"}], dtype=object), **_good_arrays())
    with pytest.raises(FileFormatError, match="Python objects"):
        load_measure(path)
    np.save(tmp_path / "single.npy", np.zeros(3))
    with pytest.raises(FileFormatError, match="single .npy array"):
        load_measure(tmp_path / "single.npy")
    (tmp_path / "text.npz").write_text("not an archive")
    with pytest.raises(FileFormatError, match="not a smooth-attention archive|not a readable"):
        load_measure(tmp_path / "text.npz")
    np.savez(tmp_path / "noheader.npz", **_good_arrays())
    with pytest.raises(FileFormatError, match="no 'header'"):
        load_measure(tmp_path / "noheader.npz")


@pytest.mark.parametrize("change, match", [
    (dict(weights=np.full(4, 0.25)), "'weights' has 4 entries for 3 atoms"),
    (dict(positions=np.array([0.1, 0.2])), "'positions' has 2 entries for 3 atoms"),
    (dict(points=np.zeros((3, 2, 1))), "'points' has shape .*2 dimension"),
    (dict(log_weights=np.zeros(3)), "not a valid measure: log_weights"),
    (dict(weights=np.array([0.5, 0.25, 0.25])), "'weights' and 'log_weights' disagree"),
    # within the agreement tolerance of exp(log_weights), but a negative mass and a sum above one
    (dict(weights=np.array([0.5 + 5e-10, 0.5 + 5e-10, -8e-10]),
          log_weights=np.array([math.log(0.5), math.log(0.5), -math.inf])),
     "'weights' holds negative masses or does not sum to one"),
    (dict(positions=np.array([0.1, 0.2, 1.5])), "positions: must lie in \\[0, 1\\]"),
    (dict(points=np.array([[0, 1], [np.nan, 0], [1, 1]], dtype=float)), "NaN or infinite"),
    (dict(points=np.zeros((3, 2), dtype=np.int64)), "'points' has dtype int64"),
    (dict(extra=np.zeros(3)), "unknown array.*extra"),
])
def test_refuses_inconsistent_arrays(tmp_path, change, match):
    arrays = {**_good_arrays(), **change}
    with pytest.raises(FileFormatError, match=match):
        load_measure(_craft(tmp_path / "bad.npz", **arrays))


def test_refuses_missing_arrays(tmp_path):
    arrays = _good_arrays()
    del arrays["log_weights"]
    with pytest.raises(FileFormatError, match="missing array.*log_weights"):
        load_measure(_craft(tmp_path / "bad.npz", **arrays))
    assert issubclass(FileFormatError, ValueError)


# ---------------------------------------------------------------------- damaged and hostile files
_MEASURE_HEADER = json.dumps({"format": "smooth-attention", "version": 1, "kind": "measure", "dtype": "float64",
                              "metadata": {}})


def _zip(path, members: dict[str, bytes], compression=None):
    """An .npz written member by member (what a crafted or damaged file can hold)."""
    import zipfile

    with zipfile.ZipFile(path, "w", compression=compression or zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _npy(arr) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def _npy_header_only(shape, descr="<f8") -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return b"\x93NUMPY\x01\x00" + buf.getvalue()[8:]


def test_a_header_nested_100000_levels_is_a_file_format_error(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    path = _craft(tmp_path / "deep.npz", None, **_good_arrays())
    arrays = _good_arrays()
    np.savez(path, header=np.array(deep), **arrays)
    with pytest.raises(FileFormatError, match="nested too deeply"):
        load_measure(path)
    with pytest.raises(FileFormatError, match="nested too deeply"):
        read_header(path)


def test_a_header_claiming_10_to_the_12_entries_is_truncated_not_a_memory_error(tmp_path):
    path = _zip(tmp_path / "huge.npz", {"header.npy": _npy(np.array(_MEASURE_HEADER)),
                                        "points.npy": _npy_header_only((10**6, 10**6)) + b"\0" * 16,
                                        "weights.npy": _npy(np.ones(1)), "log_weights.npy": _npy(np.zeros(1))})
    with pytest.raises(FileFormatError, match=r"'points' is truncated: its header declares shape \(1000000, 1000000\)"):
        load_measure(path)


def test_a_truncated_array_is_named_truncated(tmp_path):
    good = _good_arrays()
    members = {f"{k}.npy": _npy(v) for k, v in good.items()}
    members["header.npy"] = _npy(np.array(_MEASURE_HEADER))
    members["points.npy"] = members["points.npy"][:-8]   # the last coordinate is cut off
    with pytest.raises(FileFormatError, match="'points' is truncated"):
        load_measure(_zip(tmp_path / "cut.npz", members))
    members["points.npy"] = _npy(good["points"]) + b"\0" * 8
    with pytest.raises(FileFormatError, match="'points' is followed by stray bytes"):
        load_measure(_zip(tmp_path / "long.npz", members))
    # the whole file cut in half: its zip directory is gone
    whole = save_measure(Measure.sphere(50, 3, seed=0), tmp_path / "whole.npz").read_bytes()
    (tmp_path / "half.npz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(FileFormatError, match="damaged or truncated .npz archive"):
        load_measure(tmp_path / "half.npz")


def test_a_pickle_is_refused_as_pickled_data(tmp_path):
    import pickle

    (tmp_path / "p.npz").write_bytes(pickle.dumps({"points": [1, 2]}))
    with pytest.raises(FileFormatError, match="pickled data"):
        load_measure(tmp_path / "p.npz")


def test_shapes_are_checked_before_a_compressed_array_is_decompressed(tmp_path):
    """A small compressed file whose 'positions' decompress to 160 MB is refused from its npy header: the
    peak of traced allocations during the load stays far below the array's size."""
    import tracemalloc
    import zipfile

    arrays = {**_good_arrays(), "positions": np.zeros(2 * 10**7)}
    path = tmp_path / "bomb.npz"
    np.savez_compressed(path, header=np.array(_MEASURE_HEADER), **arrays)
    assert path.stat().st_size < 1_000_000 and zipfile.ZipFile(path).getinfo("positions.npy").file_size > 1.6e8
    tracemalloc.start()
    try:
        with pytest.raises(FileFormatError, match="'positions' has 20000000 entries for 3 atoms"):
            load_measure(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak


def test_the_arrays_total_size_is_bounded_by_the_memory_limit_before_reading(tmp_path, monkeypatch):
    """Consistent shapes, 3 x 16 MiB decompressed from a file of a few dozen KiB: above a 16 MiB limit the
    load is a MemoryLimitError naming the size, with nothing allocated; below it, the measure loads."""
    import tracemalloc

    from particles.validation import MEMORY_LIMIT_ENV, MemoryLimitError

    n = 2**20
    w = np.full(n, 1.0 / n)
    path = tmp_path / "big.npz"
    np.savez_compressed(path, header=np.array(_MEASURE_HEADER), points=np.zeros((n, 2)), weights=w,
                        log_weights=np.log(w))
    assert path.stat().st_size < 200_000
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "16M")
    tracemalloc.start()
    try:
        with pytest.raises(MemoryLimitError, match="needs about 32.0 MiB, above the memory limit of 16.0 MiB"):
            load_measure(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "64M")
    mu = load_measure(path)
    assert mu.n == n and float(mu.weights.sum()) == pytest.approx(1.0)


def test_saving_into_a_missing_folder_names_the_folder(tmp_path):
    mu = Measure.sphere(4, 3, seed=0)
    with pytest.raises(FileNotFoundError, match=r"path: the folder .*nope does not exist; create it first") as exc:
        save_measure(mu, tmp_path / "nope" / "a.npz")
    assert ".tmp" not in str(exc.value) and not (tmp_path / "nope").exists()


def test_loading_on_cuda_without_cuda_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = save_measure(Measure.sphere(4, 3, seed=0), tmp_path / "mu.npz")
    with pytest.raises(ValueError, match="device: 'cuda' was asked for, but CUDA is not available"):
        load_measure(path, device="cuda")


def test_the_one_atomic_writer_leaves_the_old_file_when_the_writer_fails(tmp_path):
    """particles.files is the framework's only atomic writer (measures, sweep records, study files): a
    writer that fails midway leaves the previous content and no temporary file behind."""
    from particles.files import atomic_write, atomic_write_with

    target = tmp_path / "t.csv"
    atomic_write(target, "old\n")

    def half(tmp):
        tmp.write_bytes(b"ne")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write_with(target, half)
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]
    atomic_write_with(target, lambda tmp: tmp.write_text("new\n"))
    assert target.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]
