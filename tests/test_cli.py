"""python -m polyattn info | demo | bench."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from polyattn import cli


def run(*args):
    return subprocess.run([sys.executable, "-m", "polyattn", *args], capture_output=True,
                          text=True, check=True).stdout


def test_info_lists_libraries_and_implementations():
    out = run("info")
    assert out.startswith("polyattn ")
    for name in ("numpy", "array_api_compat", "torch", "jax", "cupy", "numba_cuda"):
        assert name in out
    assert "implementations available: reference, chunked" in out
    assert "CUDA kernel:" in out


def test_demo_shows_movie_attention(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "这 部 电影 很 好看" in out
    assert "(5, 8)" in out and "(5, 5)" in out
    last = next(line for line in out.splitlines() if line.startswith("好看 good-looking"))
    cells = last.split()[2:]
    starred = [i for i, c in enumerate(cells) if c.endswith("*")]
    assert starred == [2], last   # the strongest weight of 好看 is on 电影


def test_demo_weights_rows_sum_to_one():
    from polyattn import attention_weights, sinusoidal_positional_encoding

    m = cli.demo_matrices()
    x = m["embeddings"] + sinusoidal_positional_encoding(5, cli.D_MODEL)
    w = attention_weights(x @ m["w_q"], x @ m["w_k"])
    np.testing.assert_allclose(w.sum(-1), 1.0)
    assert w[4].argmax() == 2 and w[4, 2] > 0.5


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_demo_on_other_backends(backend, capsys):
    pytest.importorskip(backend)
    assert cli.main(["demo", "--backend", backend]) == 0
    assert f"backend: {backend}" in capsys.readouterr().out


def test_demo_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "w.png"
    assert cli.main(["demo", "--save-png", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_runs(capsys):
    assert cli.main(["bench", "--shape", "1,2,64,8", "--repeat", "1", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "polyattn" in out and "naive numpy" in out


def test_format_weights_marks_row_maximum():
    table = cli.format_weights(np.array([[0.2, 0.8], [0.6, 0.4]]), ["a", "b"], ["x", "y"])
    lines = table.splitlines()
    assert lines[1].split()[-1] == "0.800*" and lines[2].split()[1] == "0.600*"
