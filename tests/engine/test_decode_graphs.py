"""CUDA graphs of small decode steps (kvstore/engine/decode_graphs.py): replays give
what the eager kernels give, step after step, while sequences grow, seal
blocks and outgrow their graphs' tables. Runs on a CUDA machine."""
import pytest
import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.core.config import CacheConfig, CodecConfig, ModelGeometry
from kvstore.engine.engine import Engine

pytestmark = pytest.mark.gpu
L, HQ, HKV = 2, 8, 2


def _engine(codec: str, graphs: bool, D: int) -> Engine:
    eng = Engine("cuda")
    eng.create_cache(CacheConfig(name="c", model_id="m", geometry=ModelGeometry(L, HQ, HKV, D, "float16"),
                                 codec=CodecConfig(kind=codec), block_size=16, residual=32, num_blocks=512,
                                 max_sequences=8, device="cuda"))
    if codec == "pq":
        g = torch.Generator().manual_seed(0)
        eng.set_codebooks("c", Codebooks(k=torch.randn(L, HKV, D // 2, 256, 2, generator=g),
                                         v=torch.randn(L, HKV, D // 2, 256, 2, generator=g)))
    eng.caches["c"].graphs.enabled = graphs
    return eng


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("codec", ["pq", "fp16"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kv_at", ["fresh", "buffer", "moving"])
def test_replays_match_eager(codec, batch, kv_at, D):
    """kv_at: where the new tokens' k and v sit. "buffer": repeating addresses
    (a registered buffer), so the graphs write the new tokens too; "moving": a
    new address every call, so only the attention is graphed and the new
    tokens must be written before it replays; "fresh": new tensors, whose
    addresses the allocator may or may not repeat (either path)."""
    engines = {g: _engine(codec, g, D) for g in (True, False)}
    sids = [f"s{i}" for i in range(batch)]
    g = torch.Generator(device="cuda").manual_seed(1)
    for eng in engines.values():
        for i, sid in enumerate(sids):
            eng.allocate("c", "t", sid, [])
            n = 230 + 37 * i         # lengths that do not fill their last block
            pre = torch.randn(L, n, HKV, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(i))
            eng.append("c", "t", [sid], pre.half(), pre.half(), [n])
    # Fixed buffers, as a client's registered arena gives: q in, out written in place.
    q = torch.empty(batch, HQ, D, device="cuda", dtype=torch.float16)
    kbuf = torch.empty(batch, HKV, D, device="cuda", dtype=torch.float16)
    arena = torch.empty(121 * batch * HKV * D, device="cuda", dtype=torch.float16)
    outs = {gr: torch.empty(batch, HQ, D, device="cuda", dtype=torch.float16) for gr in engines}
    stream = torch.cuda.Stream()        # the daemon's own stream, as in a CudaScope
    for step in range(120):             # seals blocks and grows the tables past 16 columns
        k = torch.randn(batch, HKV, D, device="cuda", generator=g).half()
        if kv_at == "buffer":
            k = kbuf.copy_(k)
        elif kv_at == "moving":
            n = batch * HKV * D
            k = arena[step * n:(step + 1) * n].view(batch, HKV, D).copy_(k)
        q.copy_(torch.randn(batch, HQ, D, device="cuda", generator=g).half())
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for gr, eng in engines.items():
                res = eng.append_attend("c", "t", step % L, sids, k, k, q, out=outs[gr])
                assert res.data_ptr() == outs[gr].data_ptr()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # The same kernels; a graph's plan may split the work differently (fp32 partials).
        torch.testing.assert_close(outs[True], outs[False], atol=2e-3, rtol=2e-3, msg=f"step {step}")
    graphs = engines[True].caches["c"].graphs
    assert graphs.enabled and graphs.hits > 100 and graphs.captures <= 12, (graphs.hits, graphs.captures)
    # Both layers of a step have the same lengths: the second reuses the first's work items,
    # which are padded to the capacity of the graph that computed them. With "buffer" and
    # "moving" each layer always replays the same kind of graph. With "fresh" the allocator
    # decides at every step whether a layer replays its writing graph or its attention-only
    # one; those were captured at different lengths, so their capacities differ and the
    # rows are computed again (a GPU run saw 9 reuses in 114 replays, every output still
    # equal to eager's).
    if kv_at != "fresh":
        assert graphs.rows_hits > graphs.hits // 4, (graphs.rows_hits, graphs.hits)
    writing = [key for key in graphs.graphs if len(key) > 9]     # keys of graphs that write the new tokens
    if kv_at == "buffer":
        assert len(writing) == len(graphs.graphs), list(graphs.graphs)
    elif kv_at == "moving":
        assert not writing and graphs.hits > 100, (list(graphs.graphs), graphs.hits)
    for eng in engines.values():
        eng.check_invariants()
    a, b = (engines[gr].caches["c"] for gr in (True, False))
    for sid in sids:     # the tokens the graphs wrote are the ones the eager path wrote
        sa, sb = a.seq("t", sid), b.seq("t", sid)
        assert sa.length == sb.length and len(sa.tail) == len(sb.tail)
        assert torch.equal(a.tail.k[:, sa.tail], b.tail.k[:, sb.tail])
        assert torch.equal(a.tail.v[:, sa.tail], b.tail.v[:, sb.tail])
