"""README.md's Python blocks run as written, each on its own in a fresh interpreter.

Every fenced ``python`` block is run with ``python -c``; it must exit 0 and
print something. A block that imports a library that is not installed, or that
needs a CUDA GPU (CuPy) where none is usable, is skipped with the reason.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
#: Libraries whose README blocks need a CUDA GPU as well as the package.
NEEDS_GPU = {"cupy"}


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of every fenced ``python`` block of a Markdown text."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in FENCE.finditer(text)]


def imported_modules(code: str) -> set[str]:
    """The top-level names of the modules that ``code`` imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def gpu_usable() -> bool:
    """Whether CuPy finds a CUDA GPU (imports CuPy only when it is installed)."""
    from polyattn.cli import cupy_status

    return cupy_status()[0]


BLOCKS = python_blocks(README.read_text(encoding="utf-8")) if README.is_file() else []


def test_readme_has_python_blocks():
    if not README.is_file():
        pytest.skip("README.md is not beside tests/ (installed package without the sources)")
    assert len(BLOCKS) >= 3, "README.md lost its Usage examples"


def test_block_parser_finds_blocks_and_imports():
    text = "x\n```python\nimport numpy as np\nfrom a.b import c\n```\n```bash\nls\n```\n"
    [(line, code)] = python_blocks(text)
    assert line == 3 and imported_modules(code) == {"numpy", "a"}


@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code):
    missing = sorted(m for m in imported_modules(code) if importlib.util.find_spec(m) is None)
    if missing:
        pytest.skip(f"README.md line {line}: needs {', '.join(missing)}, not installed")
    if imported_modules(code) & NEEDS_GPU and not gpu_usable():
        pytest.skip(f"README.md line {line}: needs a CUDA GPU usable by CuPy")
    env = {**os.environ, "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env, cwd=README.parent)
    assert proc.returncode == 0, f"README.md line {line} failed:\n{proc.stderr}"
    assert proc.stdout.strip(), f"README.md line {line} printed nothing"
