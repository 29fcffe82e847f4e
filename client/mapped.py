"""Mapped attend (docs/design.md, Control plane and data planes): the worker maps the daemon's pool once and runs
the decode kernels in its own process; the daemon keeps allocation, sharing,
sealing, eviction and codebooks. One Reserve per step is the only RPC.

    mc = MappedCache(kv, "llama")                 # MapPool: IPC handles, opened once
    for step in range(n):
        plan = mc.step(seq_ids)                   # Reserve (batch): slots + block tables
        for layer in range(L):
            mc.write(plan, layer, k, v)           # k, v [B, Hkv, d] into the reserved fp16 slots
            out = mc.attend(plan, layer, q)       # q [B, Hq, d] -> [B, Hq, d]

Per-layer calls allocate nothing and never synchronise with the host. For a
decode loop under a CUDA graph (as vLLM runs decode), make the plan once with
fixed-size buffers and refill it each step; the graph captures all layers:

        plan = mc.step(seq_ids, max_tokens=4096)      # buffers sized for the longest sequence
        graph = capture(lambda: model_step(plan))       # write()/attend() of every layer
        for step in range(n):
            mc.step(seq_ids, into=plan)               # Reserve + stream-ordered refills
            graph.replay()
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.cuda import ipc as cuda_ipc
from kvstore.cuda.pinned import block_table, copy_into, host_table, to_device
from kvstore.protocol import wire
from kvstore.v1 import kvstore_pb2 as pb

from .client import KVStoreClient
from .tables import SealedTables


@dataclass(slots=True)
class StepPlan:
    slots: torch.Tensor          # [B * n] int64: tail-pool slot (block * bs + offset) of each reserved token
    sealed_tables: torch.Tensor  # [B, S] int32
    tail_tables: torch.Tensor    # [B, T] int32
    kernel_plan: object          # kernels.plan.DecodePlan
    out: torch.Tensor            # [B, Hq, d] reused by every layer
    lse: torch.Tensor            # [B, Hq] fp32, likewise
    host_tables: torch.Tensor | None = None   # what the tables hold now (refills skip equal ones)


class MappedCache:
    def __init__(self, kv: KVStoreClient, cache: str, device: torch.device | str | None = None):
        self.kv, self.cache = kv, cache
        self.device = torch.device(device or f"cuda:{torch.cuda.current_device()}")
        uuid = cuda_ipc.device_uuid(self.device.index or 0)
        reply = kv.stub.MapPool(pb.MapPoolRequest(cache=cache, device_uuid=uuid), timeout=kv.timeout)
        self.spec = reply.spec
        if (any(reply.spec.layer_windows) or any(reply.spec.layer_chunks) or reply.spec.logit_softcap
                or len(reply.spec.sink_logits)):
            # One kernel plan serves every layer of a step here; per-layer windows, chunks,
            # soft-capping and sink logits run in the daemon (append_attend), not in a mapped worker.
            raise ValueError(f"cache {cache!r}: mapped attend does not take sliding-window or chunked "
                             "layers, logit soft-capping or sink logits; use append_attend")
        g = reply.spec.geometry
        self.hq, self.hkv, self.d = g.num_q_heads, g.num_kv_heads, g.head_dim
        self.scale = 1.0 / math.sqrt(self.d)
        self.bs = reply.spec.block_size
        self.is_pq = reply.spec.codec == "pq"
        self.last_rpc_s = 0.0        # host time of the last step's Reserve round trip
        self.tables = SealedTables()  # Reserve sends only the sealed blocks not held here
        self.t: dict[str, torch.Tensor] = {}
        self._allocs = []
        for st in reply.tensors:
            h = cuda_ipc.TensorHandle(st.ipc_handle, st.offset, tuple(st.shape), wire.TO_TORCH[st.dtype],
                                      reply.device_uuid)
            self.t[st.name], alloc = cuda_ipc.import_tensor(h)
            self._allocs.append(alloc)
        # The daemon's image of the codebooks for the attention kernel's bulk copies;
        # it rebuilds the image in place when the codebooks change, so this stays current.
        self.images = None
        if "codebook_image" in self.t:
            from kvstore.kernels import layer_images
            self.images = layer_images(self.t["codebook_image"], self.hq, self.t["k_codebook"].shape[-1])
        # A tiny registered buffer whose event pair orders our slot writes before
        # the daemon's sealing (at the next Reserve) and its sealing before our reads.
        self.sync = kv._cuda_arena_for(4096, self.device)
        if self.sync is None:
            raise RuntimeError("the daemon refused a CUDA buffer: mapped attend needs the daemon on this GPU")

    def step(self, seq_ids: list[str], n: int = 1, *, into: StepPlan | None = None,
             max_tokens: int | None = None) -> StepPlan:
        """Commit the previous step's tokens and reserve n more per sequence.

        For CUDA graphs: `max_tokens` (the longest a sequence will get) makes a
        plan whose buffers have fixed sizes; pass it back as `into=` on later
        steps to refill those same buffers (stream-ordered copies), so a graph
        captured over write()/attend() with it replays the new step."""
        stream = torch.cuda.current_stream(self.device)
        t0 = time.perf_counter()
        counts, epochs = self.tables.known(seq_ids)
        with self.kv._lock:
            self.sync.ready.record(stream)
            reply = self.kv.stub.Reserve(pb.ReserveRequest(cache=self.cache, sequence_ids=seq_ids, num_tokens=n,
                                                           buffer_id=self.sync.buffer_id, known_sealed=counts,
                                                           known_epochs=epochs), timeout=self.kv.timeout)
            if not reply.gpu_idle:      # waiting on the daemon's event costs a GPU context switch
                stream.wait_event(self.sync.done)
        self.last_rpc_s = time.perf_counter() - t0
        rs = reply.reservations
        slots = torch.from_numpy(np.concatenate([np.asarray(r.slot_mapping, dtype=np.int64) for r in rs]))
        full = [self.tables.update(sid, r) for sid, r in zip(seq_ids, rs)]
        self.tables.keep(seq_ids)
        if self.is_pq:
            sealed_rows = full
            tail_rows = [r.tail_blocks for r in rs]
            lens = ([len(t) * self.bs for t in full],)
            lens += ([r.length - sl for r, sl in zip(rs, lens[0])],)
        else:
            sealed_rows = [[] for _ in rs]
            tail_rows = [np.concatenate([t, np.asarray(r.tail_blocks, dtype=np.int32)]) for t, r in zip(full, rs)]
            lens = ([r.length for r in rs],)
        self.last_lens = lens
        if into is not None:
            return self._refill(into, slots, sealed_rows, tail_rows, lens)
        dev = self.device
        if max_tokens is None:
            dslots = to_device(slots, dev)
            sealed, tail = block_table(sealed_rows, dev), block_table(tail_rows, dev)
        else:
            cols = -(-max_tokens // self.bs) + 1
            dslots = torch.empty(len(slots), dtype=torch.int64, device=dev)
            sealed = torch.zeros(len(rs), cols, dtype=torch.int32, device=dev)
            tail = torch.zeros_like(sealed)
        kp = self._plan(lens, spare=None if max_tokens is None else len(rs))
        out = torch.empty(len(rs), self.hq, self.d, dtype=self._dtype(), device=dev)
        lse = torch.empty(len(rs), self.hq, dtype=torch.float32, device=dev)
        plan = StepPlan(dslots, sealed, tail, kp, out, lse)
        if max_tokens is not None:
            self._refill(plan, slots, sealed_rows, tail_rows, lens, replan=False)
        return plan

    def _plan(self, lens, spare):
        from kvstore.kernels import plan_decode
        kw = dict(num_qo_heads=self.hq, num_kv_heads=self.hkv, head_dim=self.d, block_size=self.bs,
                  device=self.device, dtype=self._dtype(), spare_items=spare)
        if self.is_pq:
            return plan_decode("pq", *lens, tail_block_size=self.bs, codebook_dtype=self.t["k_codebook"].dtype, **kw)
        return plan_decode("paged", *lens, **kw)

    def _refill(self, plan: StepPlan, slots, sealed_rows, tail_rows, lens, replan: bool = True) -> StepPlan:
        if slots.numel() != plan.slots.numel() or len(sealed_rows) != plan.out.shape[0]:
            raise ValueError(f"into: the plan holds {plan.out.shape[0]} sequences x "
                             f"{plan.slots.numel() // max(1, plan.out.shape[0])} tokens; this step has "
                             f"{len(sealed_rows)} x {slots.numel() // max(1, len(sealed_rows))}")
        cols = plan.sealed_tables.shape[1]
        try:
            sealed, tail = host_table(sealed_rows, cols), host_table(tail_rows, cols)
        except ValueError:
            raise ValueError(f"into: a sequence outgrew the plan, made for max_tokens up to "
                             f"{(cols - 1) * self.bs}") from None
        copy_into(plan.slots, slots)
        # Tables change when a block seals or a tail block is added (1 step in bs):
        # skip the copies otherwise.
        tables = torch.stack([sealed, tail])
        if plan.host_tables is None or not torch.equal(plan.host_tables, tables):
            copy_into(plan.sealed_tables, sealed)
            copy_into(plan.tail_tables, tail)
            plan.host_tables = tables
        if replan:
            plan.kernel_plan.update(*lens)
        return plan

    def _dtype(self) -> torch.dtype:
        return self.t["tail_k" if self.is_pq else "k"].dtype

    def write(self, plan: StepPlan, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B * n, Hkv, d] -> the reserved fp16 slots of this layer."""
        from kvstore.kernels import write_slots
        tk, tv = (self.t["tail_k"], self.t["tail_v"]) if self.is_pq else (self.t["k"], self.t["v"])
        write_slots(k, v, tk[layer], tv[layer], plan.slots)

    def attend(self, plan: StepPlan, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, d] -> [B, Hq, d] (a view of the plan's output buffer)."""
        if self.is_pq:
            t = self.t
            plan.kernel_plan.run_pq(q, t["k_codes"][layer], t["v_codes"][layer], t["k_codebook"][layer],
                                    t["v_codebook"][layer], plan.sealed_tables, t["tail_k"][layer],
                                    t["tail_v"][layer], plan.tail_tables, self.scale, out=plan.out, lse=plan.lse,
                                    codebook_image=None if self.images is None else self.images[layer])
        else:
            plan.kernel_plan.run_paged(q, self.t["k"][layer], self.t["v"][layer], plan.tail_tables,
                                       self.scale, out=plan.out, lse=plan.lse)
        return plan.out

    def close(self) -> None:
        self.t.clear()
        for a in self._allocs:
            a.close()
        self._allocs.clear()
