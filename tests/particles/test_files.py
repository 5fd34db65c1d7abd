"""The atomic writer: a reader sees the old file or the new one, and a glob for the final files never
sees one being written."""

import pytest

from particles.files import atomic_write, atomic_write_with


def test_a_file_being_written_is_invisible_to_a_glob_of_final_names(tmp_path):
    seen = []

    def writer(tmp):
        seen.append(sorted(p.name for p in tmp_path.glob("*.rec")))
        tmp.write_bytes(b"new")

    (tmp_path / "a.rec").write_bytes(b"old")
    atomic_write_with(tmp_path / "b.rec", writer, keep_suffix=False)
    assert seen == [["a.rec"]]
    assert (tmp_path / "b.rec").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.rec", "b.rec"]


def test_writers_that_need_the_suffix_get_it(tmp_path):
    names = []
    atomic_write_with(tmp_path / "m.npz", lambda tmp: (names.append(tmp.name), tmp.write_bytes(b"x")))
    assert names[0].endswith(".npz") and names[0].startswith(".")


def test_a_failed_write_keeps_the_old_content_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "t.csv"
    atomic_write(target, "old")

    def boom(tmp):
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_with(target, boom)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["t.csv"]
