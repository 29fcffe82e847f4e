"""kvstore-eval's daemon backend with sink tokens: the daemon keeps them in
fp16 itself (nothing faked in the mask), and gives what the simulation, which
fakes them, gives."""
import math

import pytest
import torch

pytest.importorskip("transformers")

from kvstore.client import KVStoreClient  # noqa: E402
from kvstore.tools import evaluate as E  # noqa: E402

from test_calibrate_eval import rand_codebooks, tiny_llama  # noqa: E402


def test_daemon_quantizer_returns_sinks_exact(daemon):
    model, cb = tiny_llama(), rand_codebooks()
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(100, 2, 16, generator=g), torch.randn(100, 2, 16, generator=g)
    with KVStoreClient(daemon) as kv:
        plain = E.DaemonQuantizer(kv, "plain", model, cb, window=128)
        sinks = E.DaemonQuantizer(kv, "sinks", model, cb, window=128, sinks=16)
        assert kv.get_cache("sinks-L0").spec.sink_tokens == 16
        for layer in range(2):
            for x, coded, with_sinks in zip((k, v), plain(layer, k, v), sinks(layer, k, v)):
                assert torch.equal(with_sinks[:16], x[:16].half().float())      # fp16, never coded
                assert torch.equal(with_sinks[16:], coded[16:])                 # the rest as without sinks
                assert not torch.equal(coded[:16], with_sinks[:16])


def test_daemon_backend_matches_the_simulation_with_sinks(daemon, tmp_path):
    model = tiny_llama()
    path = str(tmp_path / "cb.safetensors")
    rand_codebooks().save(path)
    wins = [torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]
    rows = [E.Row("pq sinks", path, "i", sinks=16, residual=8, transform="none"),
            E.Row("pq", path, "i", residual=8, transform="none")]
    sim = [ppl for _, ppl, _ in E.run(model, wins, rows, "sim", log=lambda s: None)]
    with KVStoreClient(daemon) as kv:
        got = [ppl for _, ppl, _ in E.run(model, wins, rows, "daemon", kv, log=lambda s: None)]
    assert math.isclose(got[0], sim[0], rel_tol=1e-4) and math.isclose(got[1], sim[1], rel_tol=1e-4), (got, sim)
    assert not math.isclose(got[0], got[1], rel_tol=2e-3), got       # the sinks do matter here
