"""GPU data plane : CUDA IPC buffers, remote and mapped attend, two
worker processes, lease expiry after a killed worker. Runs on a CUDA machine."""
import json
import signal
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

WORKER = r"""
import sys, json, math, os, torch
from kvstore.client import KVStoreClient
from kvstore.client.mapped import MappedCache
from kvstore.kernels import reference as ref
target, cache, sid, mode, seed = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
dev = torch.device("cuda")
kv = KVStoreClient(target)
L, HQ, HKV, D = 2, 8, 2, int(os.environ.get("KV_HEAD_DIM", "64"))
prompt = list(range(300))
cached = kv.allocate(cache, sid, prompt)
g = torch.Generator(device=dev).manual_seed(0)          # same prompt -> same K/V in every worker
k = torch.randn(L, 300, HKV, D, device=dev, generator=g).half()
v = torch.randn(L, 300, HKV, D, device=dev, generator=g).half()
kv.append(cache, [sid], k[:, cached:], v[:, cached:], token_ids=[prompt[cached:]])
g2 = torch.Generator(device=dev).manual_seed(seed)
errs, outs = [], []
mc = MappedCache(kv, cache) if mode in ("mapped", "graph") else None
graph = None
for step in range(20):
    k1 = torch.randn(L, 1, HKV, D, device=dev, generator=g2).half()
    v1 = torch.randn(L, 1, HKV, D, device=dev, generator=g2).half()
    q = torch.randn(L, 1, HQ, D, device=dev, generator=g2).half()
    if mode == "graph":        # one graph over all layers, replayed with a refilled plan
        if graph is None:
            plan = mc.step([sid], max_tokens=400)
            sk, sv, sq, so = k1.clone(), v1.clone(), q.clone(), torch.empty(L, 1, HQ, D, device=dev).half()
            def layers():
                for layer in range(L):
                    mc.write(plan, layer, sk[layer], sv[layer])
                    so[layer].copy_(mc.attend(plan, layer, sq[layer]))
            layers(); torch.cuda.synchronize()          # warm-up (kernels loaded); the replay redoes it
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
                layers()
            torch.cuda.current_stream().wait_stream(s)
        else:
            mc.step([sid], into=plan)
        sk.copy_(k1); sv.copy_(v1); sq.copy_(q)
        graph.replay()
        outs += [so[layer].float().cpu() for layer in range(L)]
    else:
        plan = mc.step([sid]) if mc else None
        for layer in range(L):
            if mc:
                mc.write(plan, layer, k1[layer], v1[layer])
                out = mc.attend(plan, layer, q[layer]).clone()
            else:
                out = kv.append_attend(cache, layer, [sid], k1[layer], v1[layer], q[layer])
            outs.append(out.float().cpu())
    k = torch.cat([k, k1], 1); v = torch.cat([v, v1], 1)
if mc:
    mc.step([sid], 0)                       # commit the last token
torch.cuda.synchronize()
n = k.shape[1]
rk, rv = kv.retrieve(cache, sid, 0, n)      # the daemon's (dequantized) K/V
for layer in range(L):
    want, _ = ref.attention_dense(q[layer, 0].double().cpu(), rk[layer].double().cpu(), rv[layer].double().cpu(), 1 / math.sqrt(D))
    errs.append((outs[-L + layer][0].double() - want).abs().max().item())
exact = (rk.float().cpu() - k.float().cpu()).abs().max().item()
print(json.dumps({"cached": cached, "err": max(errs), "retrieve_vs_appended": exact,
                  "last": outs[-1].tolist()}))
if len(sys.argv) > 6 and sys.argv[6] == "hang":
    print("ready", flush=True)
    import time; time.sleep(600)
"""


def start_daemon(sock, *extra):
    from tests.service.test_daemon_process import start_daemon as start
    return start(sock, extra=["--device", "cuda", *extra])


def worker(target, cache, sid, mode, seed=1, head_dim=64):
    import os
    r = subprocess.run([sys.executable, "-c", WORKER, target, cache, sid, mode, str(seed)],
                       capture_output=True, text=True, env=dict(os.environ, KV_HEAD_DIM=str(head_dim)))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def daemon(tmp_path):
    from tests.service.test_daemon_process import stop_daemon
    # Long enough for a worker's first-use kernel compiles, short enough to test expiry.
    p, target = start_daemon(str(tmp_path / "kv.sock"), "--lease-timeout", "10")
    yield target
    stop_daemon(p)


def _create(target, codec, name=None, head_dim=64):
    from kvstore.client import KVStoreClient
    kv = KVStoreClient(target)
    name = name or codec
    kv.create_cache(name, "m", num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, codec=codec,
                    block_size=16, residual=32, num_blocks=512, exist_ok=True)
    if codec == "pq":     # random codebooks: the GPU box has no faiss, and speed tests need no training
        from kvstore.codec.codebooks import Codebooks
        g = torch.Generator().manual_seed(0)
        m = head_dim // 2
        kv.set_codebooks(name, Codebooks(k=torch.randn(2, 2, m, 256, 2, generator=g),
                                         v=torch.randn(2, 2, m, 256, 2, generator=g)).to_bytes())
    return kv


@pytest.mark.parametrize("codec", ["fp16", "pq"])
def test_two_workers_remote_and_mapped_agree_with_reference(daemon, codec):
    kv = _create(daemon, codec)
    a = worker(daemon, codec, "a", "remote")
    b = worker(daemon, codec, "b", "mapped")          # second process: prefix hit, mapped plane
    assert a["cached"] == 0 and b["cached"] == 288    # 300 tokens: every full block but the last
    for r in (a, b):
        assert r["err"] < 2e-3, r["err"]
        if codec == "fp16":
            assert r["retrieve_vs_appended"] == 0.0
    # Same inputs through both planes give the same outputs.
    assert torch.allclose(torch.tensor(a["last"]), torch.tensor(b["last"]), atol=2e-3)
    c = worker(daemon, codec, "c", "graph")          # mapped under one CUDA graph per step
    assert c["cached"] == 288 and c["err"] < 2e-3, c
    assert torch.allclose(torch.tensor(a["last"]), torch.tensor(c["last"]), atol=2e-3)
    # The workers exited: their session leases lapse and free their sequences.
    deadline = time.time() + 40
    while time.time() < deadline and kv.stats(codec).caches[0].sequences:
        time.sleep(0.5)
    st = kv.stats(codec).caches[0]
    assert st.main.used == 0 and st.sequences == 0


@pytest.mark.parametrize("codec", ["fp16", "pq"])
def test_mapped_graph_replays_follow_growing_lengths_head_dim_128(daemon, codec):
    """Mapped attend under one CUDA graph per step at head_dim 128: the lengths
    grow across steps (blocks seal, tables change), every replay's output is
    checked against the daemon's K/V at the end, and codebooks that changed
    on the emptied cache (in place, as set_codebooks does) are what the next
    worker's graph reads."""
    kv = _create(daemon, codec, name=codec + "128", head_dim=128)
    r = worker(daemon, codec + "128", "g1", "graph", head_dim=128)
    assert r["err"] < 2e-3, r
    if codec == "pq":
        deadline = time.time() + 40          # the worker's session lapses with its sequences
        while time.time() < deadline and kv.stats(codec + "128").caches[0].sequences:
            time.sleep(0.5)
        from kvstore.codec.codebooks import Codebooks
        g = torch.Generator().manual_seed(9)
        kv.set_codebooks(codec + "128", Codebooks(k=torch.randn(2, 2, 64, 256, 2, generator=g),
                                                  v=torch.randn(2, 2, 64, 256, 2, generator=g)).to_bytes())
        r = worker(daemon, codec + "128", "g2", "graph", head_dim=128)
        assert r["err"] < 2e-3, r


@pytest.mark.parametrize("field,value", [("layer_windows", [16, 0]), ("logit_softcap", 30.0),
                                         ("sink_logits", [0.5] * 16)])
def test_mapped_attend_refuses_a_cache_whose_attention_it_does_not_apply(daemon, field, value):
    """One kernel plan serves every layer of a mapped step: a cache with windows,
    soft-capping or sink logits is refused by MappedCache, naming them, before anything
    is mapped; append_attend serves it."""
    from kvstore.client import KVStoreClient
    from kvstore.client.mapped import MappedCache
    kv = KVStoreClient(daemon)
    kv.create_cache(f"m-{field}", "m", num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64, codec="fp16",
                    block_size=16, residual=32, num_blocks=64, **{field: value})
    with pytest.raises(ValueError, match="mapped attend does not take sliding-window or chunked layers, logit "
                                         "soft-capping or sink logits; use append_attend"):
        MappedCache(kv, f"m-{field}")


@pytest.mark.parametrize("codec", ["fp16", "pq"])
def test_retrieve_onto_the_gpu_equals_the_host_copy_and_crosses_no_host_memory(daemon, codec, monkeypatch):
    """Retrieve with a CUDA device: the daemon copies into the client's CUDA buffer, no
    shared-memory buffer is made, and the K/V are those a host Retrieve reads, in one call
    or (past RETRIEVE_CALL_BYTES) in calls of whole layers."""
    from kvstore.client import client as client_mod
    kv = _create(daemon, codec, name=f"r-{codec}")
    g = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(2, 300, 2, 64, device="cuda", generator=g).half() for _ in range(2))
    kv.allocate(f"r-{codec}", "a", list(range(300)))
    kv.append(f"r-{codec}", ["a"], k, v, token_ids=[list(range(300))])
    dk, dv = kv.retrieve(f"r-{codec}", "a", 5, device="cuda")
    assert dk.device.type == dv.device.type == "cuda" and kv._arena is None
    monkeypatch.setattr(client_mod, "RETRIEVE_CALL_BYTES", 1)         # one layer a call
    ck, cv = kv.retrieve(f"r-{codec}", "a", 5, device="cuda")
    hk, hv = kv.retrieve(f"r-{codec}", "a", 5)
    assert hk.device.type == "cpu"
    for got in (dk, dv, ck, cv):
        assert got.shape == (2, 295, 2, 64)
    assert torch.equal(dk.cpu(), hk) and torch.equal(dv.cpu(), hv) and torch.equal(ck, dk) and torch.equal(cv, dv)
    if codec == "fp16":
        assert torch.equal(dk, k[:, 5:]) and torch.equal(dv, v[:, 5:])


def test_killed_worker_leaves_no_blocks_after_lease(daemon):
    kv = _create(daemon, "pq")
    before = kv.stats("pq").caches[0]
    p = subprocess.Popen([sys.executable, "-c", WORKER, daemon, "pq", "w", "mapped", "1", "hang"],
                         stdout=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.strip() == "ready":
            break
    assert kv.stats("pq").caches[0].sequences == 1
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.time() + 40
    while time.time() < deadline and kv.stats("pq").caches[0].sequences:
        time.sleep(0.5)
    after = kv.stats("pq").caches[0]
    assert after.sequences == 0 and after.main.used == before.main.used == 0
    assert after.tail.used == 0
