"""`make demo-synthetic` (kvstore.tools.demo): its calls/s are the daemon's
AppendAttend calls alone, not the demo's own fp64 checking, and its outputs
match the fp64 reference."""
import time

import pytest

from kvstore.client import KVStoreClient
from kvstore.tools import demo

CHECK_COST_S = 100.0     # what each fp64 check adds to the (skewed) clock


@pytest.fixture
def slow_checks(monkeypatch):
    """A clock on which every fp64 reference check takes CHECK_COST_S -> the check count."""
    state = {"skew": 0.0, "checks": 0}
    real_clock, real_ref = time.perf_counter, demo.ref.attention_dense

    def ref(*a, **kw):
        state["skew"] += CHECK_COST_S
        state["checks"] += 1
        return real_ref(*a, **kw)
    monkeypatch.setattr(demo.time, "perf_counter", lambda: real_clock() + state["skew"])
    monkeypatch.setattr(demo.ref, "attention_dense", ref)
    return state


@pytest.mark.parametrize("codec", ["fp16", "pq"])
def test_calls_per_s_counts_the_calls_not_the_checks(daemon, slow_checks, codec):
    with KVStoreClient(daemon) as kv:
        r = demo.run_workload(kv, codec, layers=2, hq=4, hkv=2, d=32, n_seqs=2, prompt_len=96, new_tokens=6)
    assert slow_checks["checks"] > 0
    assert r["max_abs_err"] < 1e-3
    assert r["calls"] == 6 * 2
    assert r["call_s"] < CHECK_COST_S, "the fp64 checks were timed as calls"
    assert r["check_s"] >= CHECK_COST_S * slow_checks["checks"]
    assert r["calls_per_s"] == pytest.approx(r["calls"] / r["call_s"])
    s = r["stats"]
    assert s.tokens > 0 and s.effective_bytes_per_token == pytest.approx(s.used_bytes / s.tokens)
