"""AppendAttend with query_tokens through a live daemon (gRPC, and a client whose doorbell
would otherwise take the call): T tokens per sequence appended and attended causally,
equal to an fp64 attention over the tokens (codec fp16: exact K/V)."""
import math

import torch

from kvstore.client import KVStoreClient
from kvstore.kernels import reference as ref

L, HQ, HKV, D = 2, 4, 2, 16


def test_multi_token_append_attend_over_grpc(daemon):
    kv = KVStoreClient(daemon)
    try:
        kv.create_cache("m", model_id="m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                        dtype="float16", codec="fp16", block_size=8, residual=8, num_blocks=64, max_sequences=4)
        g = torch.Generator().manual_seed(0)
        k0, v0 = (torch.randn(L, 2, 13, HKV, D, generator=g).half() for _ in range(2))
        for b in range(2):
            kv.allocate("m", f"s{b}", [])
            kv.append("m", [f"s{b}"], k0[:, b], v0[:, b], counts=[13])
        t = 5
        k1, v1 = (torch.randn(L, 2 * t, HKV, D, generator=g).half() for _ in range(2))
        q = torch.randn(L, 2 * t, HQ, D, generator=g).half()
        for layer in range(L):
            out = kv.append_attend("m", layer, ["s0", "s1"], k1[layer], v1[layer], q[layer], query_tokens=t,
                                   token_ids=list(range(2 * t)) if layer == 0 else None)
            assert out.shape == (2 * t, HQ, D)
            for b in range(2):
                k = torch.cat([k0[layer, b], k1[layer, b * t:(b + 1) * t]]).double()
                v = torch.cat([v0[layer, b], v1[layer, b * t:(b + 1) * t]]).double()
                for i in range(t):
                    want = ref.attention_dense(q[layer, b * t + i].double(), k[:13 + i + 1], v[:13 + i + 1],
                                               1 / math.sqrt(D))[0]
                    got = out[b * t + i].double()
                    assert ((got - want).norm() / want.norm()).item() < 2e-3
        assert kv.sequence_info("m", "s1").length == 13 + t
    finally:
        kv.close()
