"""The CPU benchmarks' cases run end to end on a tiny shape. No timing is asserted (the
benchmarks measure): the tests check that what they call still exists and agrees."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import backward
import cpu


@pytest.mark.parametrize("causal", [False, True])
def test_forward_benchmark_case_runs(causal):
    """Every contender of benchmarks/cpu.py runs (the NumPy path's products alone
    included) and polyattn agrees with torch and the float64 oracle."""
    row = cpu.run_case(1, 2, 64, 8, causal, "float32", 1, np.random.default_rng(0))
    assert {"polyattn", "torch", "products", "numpy_path", "naive"} <= set(row["median_s"])
    assert set(row["ratio_to_torch"]) == {"polyattn", "products", "numpy_path", "naive"}
    assert row["rel_diff_vs_torch"] < 1e-5, row
    assert max(row["max_abs_err_vs_float64"].values()) < 1e-5, row


@pytest.mark.parametrize("causal", [False, True])
def test_backward_benchmark_case_runs(causal):
    """Every contender of benchmarks/backward.py runs forward and backward, and
    polyattn's gradients agree with torch's."""
    row = backward.run_case(1, 2, 64, 8, causal, "float32", 1, np.random.default_rng(0),
                            "pool")
    assert {"polyattn", "torch", "numpy_path", "naive"} <= set(row["median_s"])
    assert {"polyattn", "polyattn forward", "polyattn backward"} <= set(row["ratio_to_torch"])
    assert max(row["rel_diff_vs_torch"].values()) < 1e-5, row
    assert row["gflops_by_pass"]["forward"] > 0
    summary = backward.targets([row])
    assert any(line.startswith("polyattn GFLOP/s by pass, float32") for line in summary)


@pytest.mark.parametrize("kind", ["equal", "random"])
def test_packed_benchmark_case_runs(kind, monkeypatch):
    """benchmarks/packed.py's contenders run, and the packed output agrees with torch's
    masked attention (numba_cpu where Numba is installed)."""
    import importlib.util

    import packed

    if importlib.util.find_spec("numba") is None:
        monkeypatch.setattr(packed, "IMPLEMENTATIONS", ("chunked",))
    row = packed.run_case(256, kind, 1, np.random.default_rng(0))
    assert sum(row["documents"]) == 256 and len(row["documents"]) == packed.DOCUMENTS
    assert {"torch mask", "torch dense"} <= set(row["ms"])
    for impl in packed.IMPLEMENTATIONS:
        assert row["guard_max_abs_error"][impl] < 1e-5, row


def test_tiles_benchmark_report():
    """benchmarks/tiles.py's configurations and its table (the children that time the
    kernels compile them for each target: the numba_cpu session's business, not here)."""
    import tiles

    configs = tiles.configurations(False)
    assert [c[0] for c in configs] == ["host", "haswell", "haswell, 4 x 2 tiles"]
    assert configs[1][1] == {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}
    case = {"shape": [1, 8, 64, 16], "causal": True, "dtype": "float32"}
    runs = {label: [{"vector_bytes": 32, "tile_rows": rows or 6,
                     "cases": [dict(case, **{"forward/torch": f, "backward/torch": 2 * f})]}
                    for f in (0.5 * scale, 0.7 * scale)]
            for (label, _, rows), scale in zip(configs, (1.0, 1.2, 0.9), strict=True)}
    env = {"date": "2026-01-01", "cpu": "x", "cpu_count": 2, "simd": "avx2",
           "versions": {"torch": "t"}, "torch_threads": 2, "load_average_start": [1.0]}
    text = tiles.markdown(env, runs, "python benchmarks/tiles.py")
    assert "| float32 (1, 8, 64, 16) causal | 0.600 / 1.200 | 0.720 / 1.440 |" in text
    assert "- haswell, forward: 1.200" in text and "- haswell, 4 x 2 tiles, backward: 0.900" \
        in text


def test_decode_pretrained_benchmark_runs_on_tiny_checkpoints(tmp_path):
    """benchmarks/decode_pretrained.py builds tiny random checkpoints, decodes them with
    every contender (transformers' sdpa where the architecture allows it) and writes its
    report; polyattn's greedy tokens are transformers eager's."""
    pytest.importorskip("transformers")
    pytest.importorskip("threadpoolctl")
    import json

    import decode_pretrained

    assert decode_pretrained.main(["--random", "gemma3_text", "--random", "gpt_oss", "--tiny",
                                   "--new-tokens", "3", "--rounds", "1", "--threads", "1",
                                   "--out", str(tmp_path)]) == 0
    [report] = [json.loads(f.read_text()) for f in tmp_path.glob("decode-pretrained-*.json")]
    gemma3, gpt_oss = report["models"]
    assert set(gemma3["summary"]) == {"polyattn numpy", "polyattn torch",
                                      "transformers eager", "transformers sdpa"}
    assert set(gpt_oss["unsupported"]) == {"transformers sdpa"}
    for model in (gemma3, gpt_oss):
        assert model["prompt_tokens"] == list(decode_pretrained.PROMPT_LENGTHS)
        assert all(s["same_tokens"] for s in model["summary"].values()), model["summary"]
    assert "| polyattn numpy |" in (tmp_path / next(tmp_path.glob("*.md")).name).read_text()


def test_after_torch_op_benchmark_case_runs(tmp_path):
    """benchmarks/after_torch_op.py times torch's attention and numba_cpu after a torch
    product and back to back, and writes its report."""
    pytest.importorskip("numba")
    import after_torch_op

    row = after_torch_op.time_case((1, 2, 64, 8), True, 1)
    for impl in ("native", "numba_cpu"):
        assert set(row[impl]) == {"after_op_ms", "back_to_back_ms"}
    assert row["ratio_after_op"] > 0 and row["ratio_back_to_back"] > 0
    env = {"date": "d", "cpu": "c", "cpu_count": 2, "simd": "s", "numba_threading_layer": "tbb",
           "versions": {"torch": "t"}, "torch_threads": 2}
    text = after_torch_op.markdown(env, [row], "cmd")
    assert "| (1, 2, 64, 8) | yes |" in text and "Numba threading layer: tbb" in text
