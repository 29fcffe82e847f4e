"""CI version of scripts/soak.py: 8 client processes against one daemon for
about a minute, one of them crashing on purpose; every block accounted for at
the end, nothing leaked, daemon RSS flat after warm-up. The same under tier
pressure (--tiers), with every read checked."""
import importlib.util
import os

import pytest
from helpers import ROOT



def load(name):
    spec = importlib.util.spec_from_file_location(f"kvstore_scripts_{name}", os.path.join(ROOT, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_soak_one_minute_eight_clients():
    res = load("soak").run(minutes=0.9, clients=8, lease_timeout=3.0, seed=1, crash=True, verbose=False)
    assert res["failures"] == [], res
    assert res["blocks_leaked"] == 0 and res["sequences_leaked"] == 0
    assert res["ops"] > 1000, res
    # The reaper cleaned up after the crashed client (its buffer always; its sequences if it held any).
    assert res["crashes"] >= 1 and res["lease_released_buffers"] >= 1, res
    assert res["rss_growth_mib"] < 64, res


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_soak_tier_pressure_one_minute():
    """scripts/soak.py --tiers: GPU pools of a few sequences over a host tier and
    a bounded LMDB; every read checked against what was written."""
    res = load("soak").run(minutes=0.7, clients=8, lease_timeout=3.0, seed=2, crash=True, verbose=False, tiers=True)
    assert res["failures"] == [], res
    assert res["blocks_leaked"] == 0 and res["sequences_leaked"] == 0 and res["disk_held_bytes"] == 0
    assert res["checked_reads"] > 100, res
    t = res["tiers"]
    assert t["offloads_host"] > 0 and t["offloads_disk"] > 0 and t["page_ins_host"] > 0 and t["page_ins_disk"] > 0, t
    assert 0 < t["disk_used_bytes"] <= t["disk_max_bytes"], t
