"""The Backend protocol's rule gate: a backend is given only the rules it lowers."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import polyattn
from polyattn import backends
from polyattn.backends import array_api
from polyattn.backends import numpy as numpy_family
from polyattn.rules.user import UserRules
from polyattn.rules.visibility import RULE_NAMES, Rules


def _inputs():
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((1, 2, 6, 4)) for _ in range(3))


def test_every_family_names_the_rules_it_handles():
    # named one by one, so that a rule added to RULE_NAMES is refused until a family lists it
    today = {"causal", "window", "key_lengths", "softcap", "alibi", "dropout"}
    assert set(RULE_NAMES) == today | {"segment_ids", "score_mod", "mask_mod"}
    user = {"segment_ids", "score_mod", "mask_mod"}
    lowered = {"reference": user, "chunked": user,
               "native": user, "numba_cpu": user, "distributed": user, "numba_cuda": user}
    for name in backends.FAMILIES:
        assert backends.family(name).RULES == today | lowered.get(name, set()), name
    assert backends.numpy_path().RULES == today | user


def test_a_new_rule_is_refused_until_a_family_lists_it(monkeypatch):
    from types import SimpleNamespace

    from polyattn.rules import visibility

    monkeypatch.setattr(visibility.Rules, "in_use",
                        lambda self: frozenset({"softcap", "a_new_rule"}))
    problem = SimpleNamespace(rules=Rules(6, 6, softcap=2.0))
    runners = [backends.family(name) for name in backends.FAMILIES] + [backends.numpy_path()]
    for runner in runners:
        why = backends.objection(runner, problem)
        assert why is not None and why.startswith("it does not apply a_new_rule"), (runner, why)


def test_attention_weights_refuse_a_rule_the_formula_does_not_apply(monkeypatch):
    import array_api_compat.numpy as xp

    from polyattn.backends import array_api
    from polyattn.rules import visibility

    monkeypatch.setattr(visibility.Rules, "in_use",
                        lambda self: frozenset({"softcap", "a_new_rule"}))
    q = np.zeros((1, 1, 4, 2))
    problem = SimpleNamespace(q=q, k=q, rules=Rules(4, 4, softcap=2.0), mask=None,
                              scale=1.0, xp=xp)
    problem.arguments = lambda: {"mask": None, "rules": problem.rules, "scale": 1.0, "xp": xp}
    with pytest.raises(ValueError, match="attention_weights cannot apply a_new_rule"):
        array_api.weights(problem)


def test_importing_polyattn_imports_no_array_library_or_compiler():
    import subprocess
    import sys

    code = ("import sys, polyattn\n"
            "heavy = [m for m in ('numba', 'cupy', 'torch', 'jax', 'dask', 'llvmlite')"
            " if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_rules_in_use_name_each_rule():
    assert Rules(3, 3).in_use() == frozenset()
    assert Rules(3, 3).simple
    every = Rules(3, 3, causal=True, window=(1, None), key_lengths=np.array([3]),
                  softcap=5.0, alibi=np.ones((1, 1)), dropout_p=0.1,
                  segments=(np.zeros((1, 3)), np.zeros((1, 3))),
                  user=UserRules(score_mod=lambda s, *a: s, mask_mod=lambda *a: True))
    assert every.in_use() == frozenset(RULE_NAMES)
    assert not every.simple


def test_a_backend_is_not_given_a_rule_it_does_not_lower(monkeypatch):
    q, k, v = _inputs()
    monkeypatch.setattr(numpy_family.FastPath, "RULES", frozenset({"causal"}))
    # "chunked" on NumPy passes the call to the Array-API blocked path, which lowers it
    out = polyattn.scaled_dot_product_attention(q, k, v, softcap=2.0, implementation="chunked")
    ref = polyattn.scaled_dot_product_attention(q, k, v, softcap=2.0,
                                                implementation="reference")
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    assert polyattn.explain(q, k, v, softcap=2.0, implementation="chunked").module.endswith(
        "array_api.blocked")
    # a call without the rule still takes the fast path
    assert polyattn.explain(q, k, v, is_causal=True, implementation="chunked").module.endswith(
        "numpy.forward")


def test_no_backend_lowering_a_rule_means_a_clear_refusal(monkeypatch):
    q, k, v = _inputs()
    monkeypatch.setattr(numpy_family.FastPath, "RULES", frozenset({"causal"}))
    monkeypatch.setattr(array_api.ArrayApiPath, "RULES", frozenset({"causal"}))
    with pytest.raises(ValueError, match="does not apply softcap"):
        polyattn.scaled_dot_product_attention(q, k, v, softcap=2.0, implementation="reference")
    with pytest.raises(ValueError, match="does not apply softcap"):
        polyattn.scaled_dot_product_attention(q, k, v, softcap=2.0, implementation="chunked")


def test_auto_with_no_backend_for_a_rule_names_each_objection(monkeypatch):
    q, k, v = _inputs()
    monkeypatch.setattr(numpy_family.FastPath, "RULES", frozenset({"causal"}))
    monkeypatch.setattr(array_api.ArrayApiPath, "RULES", frozenset({"causal"}))
    with pytest.raises(ValueError, match="does not apply softcap"):
        polyattn.scaled_dot_product_attention(q, k, v, softcap=2.0)
