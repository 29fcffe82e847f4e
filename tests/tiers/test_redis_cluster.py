"""The Redis tier on a real 3-node Redis Cluster (tests/tiers/redis_server.py):
found from any node's URL, blocks put by one engine read back bit-identical
by another with every node holding a share, a corrupted value refused and
counted, a node killed (its blocks miss, the others' are served, nothing
fails), and a stale slot map read again after MOVED."""
import time

import numpy as np
import torch

from kvstore.tiers.redis_format import HEADER_BYTES, block_key, check, pack_value
from kvstore.tiers.redis_nodes import SLOTS, key_slot
from kvstore.tiers.redis_store import HIT, MISS, SKIPPED, RedisConfig, RedisStore
from tests.tiers.redis_server import redis_cluster  # noqa: F401 (fixture)
from tests.tiers.test_redis_tier import BS, SEALED, T, engine, fill, prompt, rstats, wait_for

PROMPTS = 4


def owner(cluster, key: bytes) -> int:
    """The index of the node whose slots hold key (LocalCluster's equal ranges)."""
    n = len(cluster.ports)
    return next(i for i in range(n) if key_slot(key) < (i + 1) * SLOTS // n)


def test_blocks_cross_engines_through_the_cluster_spread_over_every_node(redis_cluster):
    c = redis_cluster
    a = engine(f"redis://127.0.0.1:{c.ports[2]}/0")           # any node's URL finds the whole cluster
    assert a.redis.topology.cluster and len(a.redis.topology.nodes) == 3
    for i in range(PROMPTS):
        fill(a, f"a{i}", prompt(i))
    wait_for(lambda: rstats(a)["blocks_out"] == PROMPTS * SEALED, what="A's puts")
    assert rstats(a)["dropped_puts"] == 0 and a.redis.stats()["state"] == "up"
    fp = a.cache("c").fingerprint
    keys = {i: [block_key(fp, h) for h in list(a.sequence_info("c", T, f"a{i}").block_hashes)[:SEALED]]
            for i in range(PROMPTS)}
    per_node = [c.client(n).dbsize() for n in range(3)]
    expect = [sum(owner(c, k) == n for ks in keys.values() for k in ks) for n in range(3)]
    assert per_node == expect and min(per_node) > 0 and sum(per_node) == PROMPTS * SEALED, per_node

    b = engine(c.url)
    for i in range(PROMPTS):
        assert b.allocate("c", T, f"b{i}", prompt(i)).cached_tokens == SEALED * BS
        for x, y in zip(a.retrieve("c", T, f"a{i}", 0, SEALED * BS), b.retrieve("c", T, f"b{i}", 0, SEALED * BS)):
            assert torch.equal(x, y)                      # the same codes, bit for bit
    assert rstats(b)["prefix_hits"] == PROMPTS * SEALED and rstats(b)["refused"] == 0

    j = 5                                                 # a corrupted value: refused, counted, never served
    k = keys[0][j]
    good = c.client(owner(c, k)).get(k)
    flipped = bytearray(good)
    flipped[HEADER_BYTES + 7] ^= 0x10
    c.client(owner(c, k)).set(k, bytes(flipped))
    e = engine(c.url)
    assert e.allocate("c", T, "x", prompt(0)).cached_tokens == j * BS
    assert rstats(e)["refused"] == 1 and rstats(e)["prefix_hits"] == j

    dead = 1                                              # a node killed: its blocks miss, the others' are served
    c.kill(dead)
    f = engine(c.url, timeout_s=1)
    for i in range(PROMPTS):
        first_dead = next((n for n, k in enumerate(keys[i]) if owner(c, k) == dead), SEALED)
        got = f.allocate("c", T, f"f{i}", prompt(i)).cached_tokens
        if i:                                             # prompt 0 has the corrupted block
            assert got == first_dead * BS, (i, got, first_dead)
    s = f.redis.stats()
    assert s["state"] == "down" and s["nodes"] == 3 and s["nodes_down"] == 1 and s["outages"] == 1
    assert f"127.0.0.1:{c.ports[dead]}" in s["last_error"]
    fill(f, "g", prompt(50), lookup=False)               # puts: the live nodes' share stored, the rest dropped
    wait_for(lambda: rstats(f)["blocks_out"] + rstats(f)["dropped_puts"] == SEALED, what="F's puts")
    hs = list(f.sequence_info("c", T, "g").block_hashes)[:SEALED]
    on_dead = sum(owner(c, block_key(fp, h)) == dead for h in hs)
    assert rstats(f)["blocks_out"] == SEALED - on_dead and rstats(f)["dropped_puts"] == on_dead
    f.check_invariants()


def test_a_stale_slot_map_is_read_again_after_moved(redis_cluster):
    c = redis_cluster
    fp, n, w = bytes(range(32)), 30, 4096
    hs = [i.to_bytes(32, "little") for i in range(n)]
    keys = [block_key(fp, h) for h in hs]
    p = np.random.default_rng(0).integers(0, 256, size=(n, w), dtype=np.uint8)
    for k, h, row in zip(keys, hs, p):
        c.client(owner(c, k)).set(k, pack_value(fp, h, row))
    store = RedisStore(RedisConfig(c.url, timeout_s=5))

    def read():
        heads, rows = np.zeros((n, HEADER_BYTES), np.uint8), np.zeros((n, w), np.uint8)
        chunks = store.read_into(keys, heads, rows, lambda i: check(heads[i], rows[i], fp, hs[i]))
        return [v for _, _, f in chunks for v in f.result()], rows
    got, rows = read()
    assert got == [HIT] * n and np.array_equal(rows, p)
    nodes, owners = store.topology._map
    store.topology._map = (nodes, np.zeros_like(owners))  # as if every slot had moved to node 0
    first = next(i for i, k in enumerate(keys) if owner(c, k) != 0)
    got, _ = read()
    assert got[:first] == [HIT] * first and got[first] == MISS and set(got[first + 1:]) <= {HIT, MISS, SKIPPED}
    time.sleep(0.15)                                      # refreshes are at most 10 a second
    got, rows = read()
    assert got == [HIT] * n and np.array_equal(rows, p), "the map was read again"
    assert store.stats()["state"] == "up" and store.stats()["errors"] == 0
    store.close()
