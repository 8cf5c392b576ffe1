"""The Dask corpus-embedding example: the file it writes, the corpus, the cluster's lifetime.

One run of ``embed_corpus.main`` on a small corpus (200 sentences, batches of
50) with a local cluster of two worker processes; its output must equal
``MiniLM.embed`` of the same sentences computed here, and no worker process
may outlive the run.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

distributed = pytest.importorskip(
    "distributed", reason="embed_corpus.py needs dask.distributed (pip install distributed)")
psutil = pytest.importorskip("psutil", reason="psutil comes with distributed")
pytest.importorskip("safetensors", reason="MiniLM reads its weights with safetensors")
pytest.importorskip("tokenizers", reason="MiniLM needs the tokenizers package")

from polyattn.models import minilm  # noqa: E402

try:
    minilm.model_dir()
except (ModuleNotFoundError, FileNotFoundError) as exc:  # pragma: no cover - environment
    pytest.skip(f"the MiniLM weights are not installed: {exc}", allow_module_level=True)

import embed_corpus  # noqa: E402

N = 200
BATCH = 50
SEED = 7


def _children() -> set[int]:
    """Our child processes, less multiprocessing's helpers (which live as long as we do)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:  # already gone
            continue
        if "resource_tracker" in cmdline or "forkserver" in cmdline:
            continue
        pids.add(child.pid)
    return pids


def _left_over(before: set[int], timeout: float = 15.0) -> set[int]:
    """Child processes started since ``before`` that are still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        extra = {pid for pid in _children() - before if psutil.pid_exists(pid)}
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run of the example: its Result, the output path, its stdout, leftover processes."""
    out = tmp_path_factory.mktemp("embed") / "emb.npy"
    before = _children()
    result = embed_corpus.main([
        "--sentences", str(N), "--batch", str(BATCH), "--workers", "2", "--seed", str(SEED),
        "--out", str(out), "--check", "3", "--no-progress",
    ])
    return result, out, _left_over(before)


def test_output_file(run):
    result, out, _ = run
    assert result.path == out
    assert result.sentences == N and result.workers == 2
    emb = np.load(out)
    assert emb.shape == (N, embed_corpus.DIM)
    assert emb.dtype == np.float32
    assert not out.with_name(out.name + ".partial").exists()
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


@pytest.fixture
def one_thread(monkeypatch):
    """One thread for the NumPy work done here, as on each worker: on a small, busy machine
    threads waiting on each other slow the forward pass down many times."""
    from polyattn.backends.numpy import forward as numpy_chunked

    monkeypatch.setattr(numpy_chunked, "NUM_THREADS", 1)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with polyattn[test]
        yield
    else:
        with threadpool_limits(limits=1, user_api="blas"):
            yield


def test_matches_embedding_in_process(run, one_thread):
    _, out, _ = run
    model = minilm.MiniLM.load(backend="numpy", dtype="float32")
    ref = np.asarray(model.embed(embed_corpus.generate_sentences(SEED, 0, N)))
    got = np.load(out)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


def test_check_option(run):
    result, _, _ = run
    assert result.check_error is not None
    assert result.check_error <= 1e-5


def test_model_loaded_once_per_worker(run):
    result, _, _ = run
    assert len(result.model_loads) == 2
    assert set(result.model_loads.values()) == {1}


def test_cluster_is_closed(run):
    _, _, left_over = run
    assert not left_over, f"worker processes still running: {sorted(left_over)}"
    with pytest.raises(ValueError):
        distributed.default_client()  # no client left registered


def test_cluster_is_closed_on_failure(tmp_path):
    before = _children()
    with pytest.raises(FileNotFoundError):  # the output's folder does not exist
        embed_corpus.main(["--sentences", "10", "--workers", "1", "--no-progress",
                           "--out", str(tmp_path / "missing" / "emb.npy")])
    assert not _left_over(before)


def test_existing_cluster(run, tmp_path):
    """``--scheduler``: the example uses a running cluster and leaves it running."""
    _, first, _ = run
    out = tmp_path / "emb.npy"
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                                  host="127.0.0.1", dashboard_address=None) as cluster:
        result = embed_corpus.main([
            "--scheduler", cluster.scheduler_address, "--sentences", "20", "--batch", "10",
            "--seed", str(SEED), "--out", str(out), "--no-progress",
        ])
        assert result.workers == 1
        assert list(result.model_loads.values()) == [1]
        assert len(cluster.scheduler_info["workers"]) == 1  # still there
    np.testing.assert_allclose(np.load(out), np.load(first)[:20], atol=1e-5, rtol=0)


def test_generator_is_deterministic():
    whole = embed_corpus.generate_sentences(SEED, 0, 1000)
    assert len(whole) == 1000
    assert embed_corpus.generate_sentences(SEED, 0, 1000) == whole
    for start, stop in ((0, 1), (3, 17), (499, 500), (640, 1000), (250, 250)):
        assert embed_corpus.generate_sentences(SEED, start, stop) == whole[start:stop]
    pieces = [s for a, b in embed_corpus.slices(1000, 64)
              for s in embed_corpus.generate_sentences(SEED, a, b)]
    assert pieces == whole
    assert embed_corpus.generate_sentences(SEED + 1, 0, 1000) != whole
    assert len(set(whole)) > 950  # varied
    assert all(s and s == s.strip() for s in whole)


def test_generator_rejects_bad_range():
    with pytest.raises(ValueError):
        embed_corpus.generate_sentences(0, 5, 4)


def test_slices_cover_the_corpus():
    assert list(embed_corpus.slices(10, 4)) == [(0, 4), (4, 8), (8, 10)]


def test_bad_arguments():
    with pytest.raises(SystemExit):
        embed_corpus.parse_args(["--batch", "0"])
    with pytest.raises(SystemExit):
        embed_corpus.parse_args(["--dtype", "float16"])
