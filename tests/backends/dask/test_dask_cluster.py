"""The Dask plan on a real ``dask.distributed`` cluster of worker processes, on loopback.

A ``LocalCluster`` of 2 worker processes (1 thread each, a memory limit) runs a
long causal problem, (1, 4, 16384, 64) float32 in 16 chunks of 1024 (136 tile tasks),
and the result is checked on sampled rows against the float64 oracle; the workers must
stay clear of their memory limit, an eighth of the 4 GiB score matrix (no pause, no
spill). A worker killed mid-computation is replaced and its tasks rerun, and the
result is bitwise the undisturbed one. The cluster is closed on failure too. These
tests run in the Dask session.
"""

from __future__ import annotations

import os
import resource
import signal
import time

import numpy as np
import pytest
from helpers import Backend, assert_close, assert_lse_close, ref_attention, selected_backends

import polyattn

pytestmark = pytest.mark.skipif(
    Backend.DASK not in selected_backends(),
    reason="Dask cluster tests: they run where POLYATTN_TEST_BACKENDS selects dask")

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

#: Memory limit of each worker process; the long problem's inputs are 48 MiB in all, its
#: score matrix 4 GiB.
MEMORY_LIMIT = 512 * 2**20
CLUSTER = {"n_workers": 2, "threads_per_worker": 1, "processes": True,
           "host": "127.0.0.1", "dashboard_address": "127.0.0.1:0",
           "worker_dashboard_address": "127.0.0.1:0", "memory_limit": MEMORY_LIMIT,
           "silence_logs": 40}


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(**CLUSTER) as cluster, distributed.Client(cluster) as c:
        yield c


def _inputs(shape, chunk, seed=0):
    """q, k, v generated chunk by chunk on the workers (float32, chunks along T)."""
    rng = da.random.default_rng(seed)
    chunks = (1, shape[1], chunk, shape[3])
    return [rng.standard_normal(shape, dtype=np.float32, chunks=chunks) for _ in range(3)]


def _peak_rss(dask_worker=None) -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def test_long_causal_sequence_on_two_workers(client):
    shape = (1, 4, 16384, 64)
    q, k, v = client.persist(_inputs(shape, 1024))
    e = polyattn.explain(q, k, v, is_causal=True)
    assert e.implementation == "distributed"
    assert "16 query chunks" in e.plan and "136 tile tasks" in e.plan   # 16·17/2 of 256
    out, lse = polyattn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                     return_lse=True)
    out, lse = client.compute([out, lse], sync=True)
    assert out.shape == shape and out.dtype == np.float32 and lse.shape == shape[:3]

    # --- sampled rows against the float64 oracle
    rows = np.array([0, 1, 1023, 1024, 1025, 5000, 8191, 8192, 12501, 16382, 16383])
    qs = q[..., rows, :].compute()
    kk, vv = client.compute([k, v], sync=True)
    mask = np.arange(shape[2])[None, :] <= rows[:, None]               # causal, top-left
    ref, ref_lse, _ = ref_attention(qs, kk, vv, mask=mask)
    assert_close(out[..., rows, :], ref, "float32")
    assert_lse_close(lse[..., rows], ref_lse, "float32")

    # --- memory: every worker stayed under its limit, nothing paused, nothing spilled
    peaks = client.run(_peak_rss)
    assert len(peaks) == 2
    assert max(peaks.values()) < 0.6 * MEMORY_LIMIT, {a: p / 2**20 for a, p in peaks.items()}
    logs = "\n".join(line for lines in client.get_worker_logs().values()
                     for _, line in lines).lower()
    assert "paus" not in logs and "spill" not in logs, logs
    spilled = client.run(lambda dask_worker: len(getattr(dask_worker.data, "slow", {})))
    assert set(spilled.values()) == {0}


def _tasks_done(prefix: str, dask_scheduler=None) -> int:
    return sum(1 for key, ts in dask_scheduler.tasks.items()
               if str(key[0] if isinstance(key, tuple) else key).startswith(prefix)
               and ts.state == "memory")


def test_a_killed_worker_is_replaced_and_the_result_is_unchanged(client):
    shape = (1, 2, 16384, 64)
    q, k, v = _inputs(shape, 1024, seed=1)
    out = polyattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = client.compute(out, sync=True)
    pids = client.run(os.getpid)

    future = client.compute(out)
    deadline = time.monotonic() + 60
    while client.run_on_scheduler(_tasks_done, "attention-tile") < 8:
        assert not future.done(), "the computation ended before a worker could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(next(iter(pids.values())), signal.SIGKILL)
    got = future.result(timeout=120)
    np.testing.assert_array_equal(got, want)
    # the nanny started a new worker process in place of the killed one
    client.wait_for_workers(2, timeout=60)
    assert set(client.run(os.getpid).values()) != set(pids.values())


def test_the_cluster_is_closed_when_a_task_fails():
    def boom(block_info=None):
        raise RuntimeError("a chunk that cannot be computed")

    q = da.map_blocks(boom, dtype=np.float32, chunks=((1,), (1,), (8, 8), (4,)),
                      meta=np.empty((0, 0, 0, 0), np.float32))
    with pytest.raises(RuntimeError, match="cannot be computed"):
        with distributed.LocalCluster(**{**CLUSTER, "n_workers": 1}) as cluster, \
                distributed.Client(cluster) as c:
            pids = c.run(os.getpid)
            c.compute(polyattn.scaled_dot_product_attention(q, q, q), sync=True)
    assert cluster.status.name == "closed"
    for pid in pids.values():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # a process that lingers a moment after closing must still go
        time.sleep(2)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
