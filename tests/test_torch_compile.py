"""``torch.compile`` of code that calls polyattn: no warnings from polyattn's own code
(user rules, sinks and segment ids included, which give the eager result).

The compilation runs in a fresh interpreter, because torch warns about some
things only once per process. Two kinds of complaint are collected while a
function that does nothing but call polyattn is compiled (``backend="eager"``,
so no C compiler is needed):

- Python warnings raised from a polyattn source file, or whose message names
  one as the place the call came from (TorchDynamo's warnings name the user
  frame in the message, not in ``filename``);
- records at WARNING or above on TorchDynamo's logger, which torch prints to
  stderr: the compiled functions call polyattn only, so polyattn's code is
  what they are about.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from helpers import Backend, selected_backends

pytest.importorskip("torch")
# torch.compile of a call that polyattn receives torch tensors in: the torch session (the
# NumPy session shares its environment, and would compile the same functions again)
pytestmark = pytest.mark.skipif(Backend.TORCH not in selected_backends(),
                                reason="torch.compile is tested where POLYATTN_TEST_BACKENDS "
                                       "selects torch")

SCRIPT = textwrap.dedent("""
    import json, logging, os, re, warnings
    import torch
    import polyattn

    SRC = os.path.dirname(os.path.abspath(polyattn.__file__))
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(f"{record.name}: {record.getMessage()}")

    logging.getLogger("torch._dynamo").addHandler(Collect(level=logging.WARNING))

    def sdpa(q, k, v):
        return polyattn.scaled_dot_product_attention(q, k, v, is_causal=True)

    from polyattn import ops

    def t5(score, b, h, q_idx, kv_idx, table):
        return score + table[h, ops.minimum(ops.maximum(q_idx - kv_idx, -4), 4) + 4]

    def causal(b, h, q_idx, kv_idx, table):
        return q_idx >= kv_idx

    def rules(q, k, v, table, sinks, ids):
        return polyattn.scaled_dot_product_attention(
            q, k, v, score_mod=t5, mask_mod=causal, mod_args=(table,), sinks=sinks,
            segment_ids=ids)

    def mha(x, params):
        return polyattn.multi_head_attention(x, x, x, params, num_heads=2, is_causal=True)

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    params = polyattn.MultiHeadAttention(8, 2, xp=torch, seed=0).params
    x = torch.randn(1, 8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(sdpa, backend="eager")(q, k, v)
        torch.compile(mha, backend="eager")(x, params)
        extra = (torch.randn(2, 9), torch.zeros(2), torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]))
        got = torch.compile(rules, backend="eager")(q, k, v, *extra)
        assert torch.allclose(got, rules(q, k, v, *extra), rtol=1e-5, atol=1e-6)

    ours = []
    for w in caught:
        message = str(w.message)
        origins = re.findall(r'File "([^"]+)", line (\\d+), in (\\w+)', message)
        named = [o for o in origins if os.path.abspath(o[0]).startswith(SRC)]
        if os.path.abspath(w.filename).startswith(SRC) or named:
            where = (f"{os.path.relpath(named[0][0], SRC)}:{named[0][1]} in {named[0][2]}"
                     if named else f"{os.path.relpath(w.filename, SRC)}:{w.lineno}")
            ours.append(f"{w.category.__name__} at {where}: {message.splitlines()[0]}")
    every = [f"{w.category.__name__} at {w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}"
             for w in caught]
    print(json.dumps({"warnings": ours, "dynamo_log": records, "all": every}))
""")


@pytest.fixture(scope="module")
def complaints() -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "PYTHONWARNINGS")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_warning_from_polyattn_source(complaints):
    assert complaints["warnings"] == []


def test_no_dynamo_warnings_while_tracing_polyattn(complaints):
    assert complaints["dynamo_log"] == []


def test_no_warning_at_all_while_compiling_calls_to_polyattn(complaints):
    """Not even from the libraries polyattn calls (array_api_compat's cached type checks)."""
    assert complaints["all"] == []


FULLGRAPH = textwrap.dedent("""
    import torch
    import polyattn

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8, 4, requires_grad=True) for _ in range(3))
    sinks = torch.zeros(4)
    x = torch.randn(1, 8, 8)
    params = polyattn.MultiHeadAttention(8, 2, xp=torch, seed=0).params

    def keywords(q, k, v):
        return polyattn.scaled_dot_product_attention(q, k, v, window=(3, 0), softcap=5.0,
                                                     sinks=sinks)

    def causal(q, k, v):
        return polyattn.scaled_dot_product_attention(q, k, v, is_causal=True)

    def mha(x):
        return polyattn.multi_head_attention(x, x, x, params, num_heads=2, is_causal=True)

    # the compiled calls are the process's first calls of polyattn
    for f in (causal, keywords):
        got = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
        grads = torch.autograd.grad(got.sum(), (q, k, v))
        want = f(q, k, v)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), f.__name__
        for g, w in zip(grads, torch.autograd.grad(want.sum(), (q, k, v))):
            assert torch.allclose(g, w, rtol=1e-6, atol=1e-7), f.__name__
    assert torch.allclose(torch.compile(mha, fullgraph=True, backend="eager")(x), mha(x))
    print("ok")
""")


def test_fullgraph_compile_of_keywords_and_multi_head_attention():
    """``torch.compile(fullgraph=True)`` traces polyattn's calls with keyword rules (no
    graph break), even as the process's first call: the implementation packages are
    imported with polyattn, since TorchDynamo cannot trace an import."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "PYTHONWARNINGS")}
    proc = subprocess.run([sys.executable, "-c", FULLGRAPH], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
