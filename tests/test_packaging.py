"""Package identity: ``__version__`` from the distribution metadata (source-tree fallback), and a clear
ImportError when an unrelated package named ``particles`` or ``transport`` shadows this project's."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = Path(__file__).resolve().parent.parent
PYPROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_version_of_every_package_is_the_pyproject_version():
    import meanfield
    import particles
    import transport

    assert particles.__version__ == transport.__version__ == meanfield.__version__ == PYPROJECT_VERSION
    from meanfield import __version__

    assert __version__ == PYPROJECT_VERSION


def test_version_without_installed_metadata_comes_from_the_source_tree(monkeypatch):
    from particles import _version

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_version.metadata, "distribution", missing)
    assert _version.distribution_version() == PYPROJECT_VERSION


def _run(code: str, tmp_path: Path, *fake: str, broken: bool = False) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter whose sys.path puts fake packages ``fake`` before the checkout."""
    shadow = tmp_path / "shadow"
    for name in fake:
        (shadow / name).mkdir(parents=True, exist_ok=True)
        body = "raise ImportError('No module named scipy_smc')\n" if broken else "def SMC():\n    pass\n"
        (shadow / name / "__init__.py").write_text(f'"""An unrelated package named {name}."""\n' + body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def test_own_packages_import_and_meanfield_does_not_import_transport(tmp_path):
    out = _run("import sys, meanfield, particles; print('transport' in sys.modules, 'ot' in sys.modules); "
               "import transport; print(transport.__file__)", tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[:2] == ["False", "False"]  # the check is cheap: POT is not imported by it
    # the path is the last word: POT imports pykeops where it is installed (the bench extra), which prints a
    # warning on stdout without a GPU
    assert Path(lines[-1]).resolve() == ROOT / "transport" / "__init__.py"


@pytest.mark.parametrize("module", ["meanfield", "transport"])
def test_a_foreign_particles_is_reported(tmp_path, module):
    out = _run(f"import {module}", tmp_path, "particles")
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: particles:"), out.stderr
    assert str(tmp_path / "shadow" / "particles") in last
    assert "not smooth-attention's own particles package" in last
    assert "its own virtual environment" in last and "pip uninstall particles" in last
    assert "AttributeError" not in out.stderr


def test_a_foreign_transport_is_reported_by_meanfield(tmp_path):
    out = _run("import meanfield", tmp_path, "transport")
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode != 0 and last.startswith("ImportError: transport:"), out.stderr
    assert "its own virtual environment" in last


@pytest.mark.parametrize("module", ["meanfield", "transport"])
def test_a_foreign_package_that_fails_to_import_is_reported_as_foreign(tmp_path, module):
    out = _run(f"import {module}", tmp_path, "particles", broken=True)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode != 0 and last.startswith("ImportError: particles:"), out.stderr
    assert "failed" in last and "No module named scipy_smc" in last and "shadows it" in last


def test_an_already_imported_foreign_particles_is_reported(tmp_path):
    out = _run("import particles; print(particles.SMC); import meanfield", tmp_path, "particles")
    assert out.returncode != 0 and "ImportError: particles:" in out.stderr, out.stderr


def test_a_foreign_meanfield_is_reported_by_studies(tmp_path):
    out = _run("import studies", tmp_path, "meanfield")
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode != 0 and last.startswith("ImportError: meanfield:"), out.stderr
    assert str(tmp_path / "shadow" / "meanfield") in last and "shadows it" in last
    assert "its own virtual environment" in last


def test_studies_version():
    import studies

    assert studies.__version__ == PYPROJECT_VERSION
