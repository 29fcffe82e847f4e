"""Where the host time of one decode call goes (issue 4 control plane), in
process, no gRPC: cProfile of the engine's AppendAttend and of a mapped step's
Reserve + plan, on the GPU with the Llama-3-8B layer geometry.

python bench/profile_control.py
"""
import cProfile
import pstats
import time

import torch

from kvstore.codec.codebooks import Codebooks
from kvstore.core.config import CacheConfig, CodecConfig, ModelGeometry
from kvstore.engine.engine import Engine


def main():
    L, B = 32, 8
    for codec in ("pq", "fp16"):
        e = Engine("cuda")
        e.create_cache(CacheConfig(name="c", model_id="m", geometry=ModelGeometry(L, 32, 8, 128),
                                   codec=CodecConfig(codec), num_blocks=B * 300, max_sequences=B + 1,
                                   device="cuda"))
        if codec == "pq":
            g = torch.Generator().manual_seed(0)
            e.set_codebooks("c", Codebooks(k=torch.randn(L, 8, 64, 256, 2, generator=g),
                                           v=torch.randn(L, 8, 64, 256, 2, generator=g)))
        ids = [f"s{i}" for i in range(B)]
        for sid in ids:
            e.allocate("c", "t", sid, [])
            k = torch.randn(L, 4096, 8, 128, device="cuda", dtype=torch.float16)
            e.append("c", "t", [sid], k, k, [4096])
        k1 = torch.randn(B, 8, 128, device="cuda", dtype=torch.float16)
        q = torch.randn(B, 32, 128, device="cuda", dtype=torch.float16)

        def step_remote():
            for layer in range(L):
                e.append_attend("c", "t", layer, ids, k1, k1, q)

        def step_reserve():
            from kvstore.kernels.decode_attention import plan_pq_decode, plan_paged_decode
            rs = e.reserve_batch("c", "t", ids, 1)
            if codec == "pq":
                plan_pq_decode([len(r.sealed_blocks) * 16 for r in rs],
                               [r.length - len(r.sealed_blocks) * 16 for r in rs], num_qo_heads=32,
                               num_kv_heads=8, head_dim=128, block_size=16, tail_block_size=16, device="cuda")
            else:
                plan_paged_decode([r.length for r in rs], num_qo_heads=32, num_kv_heads=8, head_dim=128,
                                  block_size=16, device="cuda")
        for name, fn in (("AppendAttend x32 layers", step_remote), ("Reserve + plan", step_reserve)):
            fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                fn()
            host = (time.perf_counter() - t) / 20
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / 20
            print(f"\n== {codec}: {name}: host {host * 1e3:.2f} ms/step, with GPU {wall * 1e3:.2f} ms/step")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                fn()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        if e.caches["c"].is_pq:
            e.reserve_batch("c", "t", ids, 0)
        del e
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
