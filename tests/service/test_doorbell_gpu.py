"""The doorbell with CUDA buffers : a client whose host waits for
the daemon's done event (host_wait) finds its output in place as the call
returns, equal to the default client's, whose stream waits instead. Runs on
a CUDA machine (the daemon in its own process: CUDA IPC needs two)."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_host_wait_output_is_in_place_when_the_call_returns(tmp_path):
    from kvstore.client import KVStoreClient
    from tests.service.test_daemon_process import start_daemon, stop_daemon
    from tests.client.test_gpu_dataplane import _create
    p, target = start_daemon(str(tmp_path / "kv.sock"), extra=["--device", "cuda"])
    try:
        _create(target, "pq").close()
        with KVStoreClient(target, heartbeat=False) as a, KVStoreClient(target, heartbeat=False, host_wait=True) as b:
            g = torch.Generator(device="cuda").manual_seed(3)
            pre = torch.randn(2, 200, 2, 64, device="cuda", generator=g).half()
            ios = {}
            for kv, sid in ((a, "a"), (b, "b")):
                kv.allocate("pq", sid, [])
                kv.append("pq", [sid], pre, pre)
                ios[sid] = kv.step_buffers("pq", 1, "cuda")
            for step in range(40):
                k = torch.randn(1, 2, 64, device="cuda", generator=g).half()
                q = torch.randn(1, 8, 64, device="cuda", generator=g).half()
                for sid in ios:
                    ios[sid].k.copy_(k)
                    ios[sid].v.copy_(-k)
                    ios[sid].q.copy_(q)
                a.append_attend("pq", step % 2, ["a"], ios["a"].k, ios["a"].v, ios["a"].q, out=ios["a"].out)
                b.append_attend("pq", step % 2, ["b"], ios["b"].k, ios["b"].v, ios["b"].q, out=ios["b"].out)
                # Queued right after the return, behind no wait on b's done event.
                snap = ios["b"].out.clone()
                torch.cuda.synchronize()
                assert torch.equal(snap, ios["a"].out), f"step {step}"
                assert torch.equal(ios["b"].out, ios["a"].out), f"step {step}"
            assert a._bell is not None and b._bell is not None and b.doorbell_handler_us > 0
            assert a.sequence_info("pq", "a").length == b.sequence_info("pq", "b").length == 220
    finally:
        stop_daemon(p)
