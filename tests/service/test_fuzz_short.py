"""CI version of scripts/fuzz.py: 1,000 malformed requests against a live
daemon process; every answer a documented status code, the daemon alive,
invariants after every call, what clients see unchanged by every refusal,
accepted outputs finite, anchors unchanged, no blocks leaked."""
import importlib.util
import os

import pytest
from helpers import ROOT



def load(name):
    spec = importlib.util.spec_from_file_location(f"kvstore_scripts_{name}", os.path.join(ROOT, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(180)
def test_fuzz_1000_requests():
    res = load("fuzz").run(n=1000, seed=1234, verbose=False)
    assert res["failures"] == [], res
    assert res["requests"] == 1000
    assert not {"INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED", "UNAVAILABLE"} & set(res["outcomes"])
    # The run reached past the front door: valid calls, tenants, IPC refusals.
    for code in ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNAUTHENTICATED", "PERMISSION_DENIED"):
        assert res["outcomes"].get(code, 0) > 0, code
    # ... and past the checks into the tiers and the kernels, comparing state around the refusals.
    for method in ("Offload", "Prefetch", "Free", "Append", "Attend", "AppendAttend"):
        assert res["by_method"][method].get("OK", 0) > 0, (method, res["by_method"][method])
    assert res["refusals_checked"] > 500, res["refusals_checked"]
