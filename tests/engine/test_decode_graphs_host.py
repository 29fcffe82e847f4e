"""The host side of the decode graphs (kvstore/engine/decode_graphs.py), on CPU: the
meta buffer a call packs, the two host copies it packs into in turn (a
pinned ring slot when both still wait for their copy), and work items
computed once for all graphs whose plans share their parameters."""
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvstore.engine import decode_graphs as dg


def _old_pack(n, items, ptr, sealed, tail, b, cols, new):
    """The layout as the session-5 code packed it (np.zeros, then the parts)."""
    host = np.zeros(n, dtype=np.int32)
    host[:len(items)] = items
    host[len(items):len(items) + b + 1] = ptr
    o = len(items) + b + 1
    for rows, c in ((sealed, cols[0]), (tail, cols[1])):
        if rows is None:
            continue
        for i, r in enumerate(rows):
            host[o + i * c:o + i * c + len(r)] = r
        o += b * c
    if new is not None:
        host[o:o + 2 * len(new[0])] = [x for x, _ in new[0]] + [y for _, y in new[0]]
    return host


def _call(b=2, cols=(16, 16), pq=True, step=0):
    items = np.arange(5 * 12, dtype=np.int32) + step
    ptr = np.arange(b + 1, dtype=np.int32) + step
    sealed = [list(range(3 + i + step)) for i in range(b)] if pq else None
    tail = [[40 + i, 41 + i + step] for i in range(b)]
    new = ([(40 + i, 7 + step) for i in range(b)], None, None)
    n = len(items) + b + 1 + b * ((cols[0] if pq else 0) + cols[1]) + 2 * b
    return n, (items, ptr, sealed, tail, b), (cols if pq else (0, cols[1])), new


def _graph(n, cols):
    return dg._Graph(None, None, torch.zeros(n, dtype=torch.int32), None, 5, cols,
                     hosts=dg._host_copies(n, torch.device("cpu")))


@pytest.mark.parametrize("pq", [True, False])
def test_pack_meta_is_the_old_layout_and_clears_what_rows_left(pq):
    n, args, cols, new = _call(pq=pq, step=3)
    host = np.full(n, -7, dtype=np.int32)       # what a longer earlier call left behind
    dg.pack_meta(host, *args, cols, new)
    assert np.array_equal(host, _old_pack(n, *args, cols, new))
    n2, args2, _, _ = _call(pq=pq, step=0)      # shorter rows: the stale ids must go
    dg.pack_meta(host, *args2, cols, new)
    assert np.array_equal(host, _old_pack(n, *args2, cols, new))
    with pytest.raises(AssertionError, match="meta layout"):
        dg.pack_meta(np.zeros(n + 1, dtype=np.int32), *args, cols, new)


class _Event:
    def __init__(self, done):
        self.done = done

    def query(self):
        return self.done


def test_copies_alternate_and_a_busy_copy_is_passed_by(monkeypatch):
    n, args, cols, new = _call()
    g = _graph(n, cols)
    graphs = dg.DecodeGraphs()
    want = _old_pack(n, *args, cols, new)
    graphs._copy_meta(g, *args, new)
    assert torch.equal(g.meta, torch.from_numpy(want)) and g.turn == 1
    assert np.array_equal(g.hosts[0][1], want)
    graphs._copy_meta(g, *args, new)
    assert g.turn == 0 and np.array_equal(g.hosts[1][1], want)
    # Copy 0's last H2D copy has not run: the call packs into copy 1.
    g.hosts[0][2], g.hosts[1][2] = _Event(False), _Event(True)
    g.hosts[1][1][:] = -1
    graphs._copy_meta(g, *args, new)
    assert np.array_equal(g.hosts[1][1], want) and g.turn == 0


def test_both_copies_busy_go_through_the_ring(monkeypatch):
    n, args, cols, new = _call()
    g = _graph(n, cols)
    calls = []

    class Ring:
        def acquire(self):
            return 3, torch.zeros(1 << 12, dtype=torch.int64)

        def release(self, slot, buf, device):
            calls.append((slot, device))
    monkeypatch.setattr(dg.pinned, "_get_ring", lambda: Ring())
    for h in g.hosts:
        h[1][:] = -5
        h[2] = _Event(False)
    dg.DecodeGraphs()._copy_meta(g, *args, new)
    assert torch.equal(g.meta, torch.from_numpy(_old_pack(n, *args, cols, new)))
    assert calls == [(3, g.meta.device)]
    assert all((h[1] == -5).all() for h in g.hosts), "a copy still being read was overwritten"


@dataclass(slots=True)
class _Plan:
    items: torch.Tensor
    batch: int
    chunk0: int
    sealed_cols: int = 0
    tail_cols: int = 0
    calls: list = None

    def rows(self, sealed_lens, tail_lens):
        self.calls.append((tuple(sealed_lens), tuple(tail_lens)))
        if sum(tail_lens) > 1000:
            raise ValueError("no room")
        self.sealed_cols += 1       # rows() sets these: they must not split the cache
        return [self.chunk0, *sealed_lens, *tail_lens], [0, 1]


def test_rows_are_computed_once_per_plan_parameters_and_lengths():
    calls = []
    graphs = dg.DecodeGraphs()

    def graph(chunk0):
        p = _Plan(torch.zeros(4, 5), 1, chunk0, calls=calls)
        return dg._Graph(None, p, None, None, 5, (16, 16), dg._rows_sig(p))
    layer0, layer1, other = graph(16), graph(16), graph(32)
    lens = ([32], [100])
    a = graphs._rows_of(layer0, lens)
    b = graphs._rows_of(layer1, lens)          # the next layer of the step: no rows() call
    assert calls == [((32,), (100,))] and a is b and graphs.rows_hits == 1
    assert a[0].dtype == np.int32 and a[0].tolist() == [16, 32, 100] and a[1].tolist() == [0, 1]
    assert graphs._rows_of(other, lens)[0].tolist() == [32, 32, 100]      # another chunk0: its own rows
    graphs._rows_of(layer0, ([32], [101]))
    assert len(calls) == 3
    assert graphs._rows_of(layer0, ([32], [1001])) is None      # no room: not cached, asked again
    assert graphs._rows_of(layer0, ([32], [1001])) is None and len(calls) == 5
    graphs.clear()
    graphs._rows_of(layer0, lens)
    assert len(calls) == 6


def test_dropped_graphs_wait_for_their_copies():
    """Copies made through cupy are not known to torch's pinned pool: a graph
    that leaves (here by clear()) waits for its host copies' last copies first."""
    waited = []

    class Ev:
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            waited.append(self.name)
    n, _, cols, _ = _call()
    graphs = dg.DecodeGraphs()
    a, b = _graph(n, cols), _graph(n, cols)
    a.hosts[0][2], a.hosts[1][2], b.hosts[1][2] = Ev("a0"), Ev("a1"), Ev("b1")      # b's copy 0 never copied
    graphs.graphs.update({"ka": a, "kb": b})
    graphs.clear()
    assert sorted(waited) == ["a0", "a1", "b1"] and not graphs.graphs


def test_copies_through_the_runtime(monkeypatch):
    """With cupy's runtime (a stand-in copying host to host here), a graph's
    host copy goes in by memcpyAsync on the graph's stream, followed by a
    record of that copy's event; a copy whose event has not completed is
    passed by; on another device than the current one, torch's calls."""
    import ctypes
    log = []

    class Rt:
        memcpyHostToDevice = 1
        device = 0

        def getDevice(self):
            return self.device

        def eventQuery(self, e):
            return 0 if e not in busy else 600

        def memcpyAsync(self, dst, src, n, kind, s):
            log.append(("copy", dst, src, n, kind, s))
            ctypes.memmove(dst, src, n)

        def eventRecord(self, e, s):
            log.append(("record", e, s))

    class Ev:
        def __init__(self, handle):
            self.cuda_event = handle

        def query(self):
            return True

        def record(self, stream):
            log.append(("torch record", self.cuda_event))

    class St:
        cuda_stream = 77
    rt, busy = Rt(), set()
    monkeypatch.setattr(dg.cuda_rt, "runtime", lambda: rt)
    n, args, cols, new = _call()
    g = _graph(n, cols)
    g.stream = St()
    g.hosts[0][2], g.hosts[1][2] = Ev(11), Ev(12)
    graphs = dg.DecodeGraphs()
    want = _old_pack(n, *args, cols, new)
    meta, nbytes = g.meta.data_ptr(), g.meta.numel() * 4
    graphs._copy_meta(g, *args, new)
    assert torch.equal(g.meta, torch.from_numpy(want)) and g.turn == 1
    assert log == [("copy", meta, g.hosts[0][0].data_ptr(), nbytes, 1, 77), ("record", 11, 77)]
    log.clear()
    busy.add(12)                        # copy 1's last copy is still queued: copy 0 again
    g.meta.zero_()
    graphs._copy_meta(g, *args, new)
    assert torch.equal(g.meta, torch.from_numpy(want)) and g.turn == 1
    assert log == [("copy", meta, g.hosts[0][0].data_ptr(), nbytes, 1, 77), ("record", 11, 77)]
    log.clear()
    rt.device = 1                       # not the graph's device: torch's copy and record
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False: log.append(("torch copy",)))
    graphs._copy_meta(g, *args, new)
    assert log == [("torch copy",), ("torch record", 12)]      # turn 1: copy 1 (torch sees it done)


def test_new_tokens_are_written_before_an_attention_only_graph(monkeypatch):
    """An AppendAttend whose k and v are not at addresses a graph can capture
    (fresh tensors, inline bytes) replays the graph of its attention alone:
    its new token must be in the tail before that replay reads it, and the
    caller must not write it a second time, after the attention."""
    from types import SimpleNamespace as NS
    order = []
    monkeypatch.setattr(dg.cuda_rt, "current_stream", lambda dev: NS(cuda_stream=5))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    graphs = dg.DecodeGraphs()
    graphs.enabled = True

    def run(cache, layer, seqs, q, scale, out, lens, sealed, tail, cols, key, new):
        order.append(("attention", new is not None))
        return out
    monkeypatch.setattr(graphs, "_run", run)
    cache = NS(bs=16, is_pq=False,
               tail=NS(write_tokens=lambda layer, slots, k, v: order.append(("write", tuple(slots)))),
               decode_lens=lambda layer, seqs: ([s.layer_length(layer) for s in seqs],))
    seq = NS(sealed=[1], tail=[2], layer_length=lambda layer: 20)
    q = NS(device=torch.device("cpu"), dtype=torch.float16, data_ptr=lambda: 64)
    q.device = NS(type="cuda")
    out = NS(data_ptr=lambda: 128)
    k = NS(is_cuda=False, data_ptr=lambda: 256)         # not in a buffer a graph may read
    got, wrote = graphs.attend(cache, 0, [seq], q, 0.125, out, ([(2, 3)], k, k))
    assert got is out and wrote is True
    assert order == [("write", ((2, 3),)), ("attention", False)]
