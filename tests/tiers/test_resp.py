"""The Redis tier's bulk reader (kvstore/tiers/resp.py, RedisStore.read_into):
replies cut anywhere across receives, missing keys, error replies, values of
another length or that do not check out, a server killed mid-batch (the store
reports it down, then reconnects), ACL users; and the value format's checksum."""
import shutil
import socket
import ssl
import subprocess
import threading
import time

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.tiers import redis_nodes, redis_store, resp
from kvstore.tiers.redis_format import HEADER_BYTES, block_key, check, checksum, header, pack_value
from kvstore.tiers.redis_store import HIT, MISS, REFUSED, SKIPPED, RedisConfig, RedisStore
from tests.tiers.redis_server import free_port, redis_server  # noqa: F401 (fixture)

FP = bytes(range(32))
W = 4096


def hashes(n: int) -> list[bytes]:
    return [i.to_bytes(32, "little") for i in range(n)]


def payloads(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, W), dtype=np.uint8)


class ScriptedServer:
    """A TCP server that answers a connection's first bytes with `reply`, cut
    into pieces of `piece` bytes sent one at a time (each its own receive on
    the other side), then closes it if `close`."""

    def __init__(self, reply: bytes, piece: int, close: bool = False):
        self.reply, self.piece, self.close = reply, piece, close
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        c, _ = self.srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.recv(1 << 16)
        for a in range(0, len(self.reply), self.piece):
            c.sendall(self.reply[a:a + self.piece])
            time.sleep(0.0005)
        if self.close:
            c.close()
        else:
            time.sleep(5)


def bulk(v: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(v), v)


@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 20])
def test_replies_cut_anywhere_land_whole_in_the_rows(piece):
    p = payloads(3)
    good = [pack_value(FP, h, row) for h, row in zip(hashes(3), p)]
    reply = (bulk(good[0]) + b"$-1\r\n" + b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
             + bulk(good[1][:-1]) + bulk(good[2]))
    srv = ScriptedServer(reply, piece)
    conn = resp.RespConnection(f"redis://127.0.0.1:{srv.port}/0", timeout_s=5)
    conn.send(b"GET ...")
    heads, rows = np.zeros((5, HEADER_BYTES), np.uint8), np.zeros((5, W), np.uint8)
    got = [conn.read_value(memoryview(heads[i]), memoryview(rows[i])) for i in range(5)]
    assert got == [resp.HIT, resp.MISS, resp.OTHER, resp.OTHER, resp.HIT]
    assert np.array_equal(rows[0], p[0]) and np.array_equal(rows[4], p[2])
    assert check(heads[0], rows[0], FP, hashes(3)[0]) and check(heads[4], rows[4], FP, hashes(3)[2])
    assert not rows[1].any() and not rows[2].any() and not rows[3].any()     # nothing written for those
    conn.close()


def test_a_connection_closed_mid_value_raises_and_a_garbled_reply_is_refused():
    v = pack_value(FP, hashes(1)[0], payloads(1)[0])
    srv = ScriptedServer(bulk(v)[:HEADER_BYTES + 100], 1000, close=True)
    conn = resp.RespConnection(f"redis://127.0.0.1:{srv.port}/0", timeout_s=5)
    conn.send(b"GET ...")
    with pytest.raises(ConnectionError, match="closed"):
        conn.read_value(memoryview(np.zeros(HEADER_BYTES, np.uint8)), memoryview(np.zeros(W, np.uint8)))
    srv = ScriptedServer(b"+OK\r\n", 1000)
    conn = resp.RespConnection(f"redis://127.0.0.1:{srv.port}/0", timeout_s=5)
    conn.send(b"GET ...")
    with pytest.raises(resp.ProtocolError):
        conn.read_value(memoryview(np.zeros(HEADER_BYTES, np.uint8)), memoryview(np.zeros(W, np.uint8)))


class CountingSocket:
    """A connection's socket, counting its receives."""

    def __init__(self, sock):
        self.sock, self.receives = sock, 0

    def recv_into(self, *args):
        self.receives += 1
        return self.sock.recv_into(*args)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_a_value_arriving_in_many_pieces_is_received_in_one_call():
    big = 1 << 20
    v = pack_value(FP, hashes(1)[0], np.random.default_rng(1).integers(0, 256, big, dtype=np.uint8))
    srv = ScriptedServer(bulk(v), 4096)                   # 257 pieces, 0.5 ms apart
    conn = resp.RespConnection(f"redis://127.0.0.1:{srv.port}/0", timeout_s=5)
    conn.sock = counting = CountingSocket(conn.sock)
    conn.send(b"GET ...")
    head, payload = np.zeros(HEADER_BYTES, np.uint8), np.zeros(big, np.uint8)
    assert conn.read_value(memoryview(head), memoryview(payload)) == resp.HIT
    assert check(head, payload, FP, hashes(1)[0])
    # The reply's line (with what follows it, up to LINE_READ bytes), the rest of the
    # value in one MSG_WAITALL receive, then its CRLF.
    assert counting.receives <= 4, counting.receives
    conn.close()


@pytest.mark.parametrize("sent", ["nothing", "half a value"])
def test_a_server_that_stops_answering_times_out(sent):
    v = pack_value(FP, hashes(1)[0], payloads(1)[0])
    srv = ScriptedServer(b"" if sent == "nothing" else bulk(v)[:len(v) // 2], 1000)    # then silent for 5 s
    conn = resp.RespConnection(f"redis://127.0.0.1:{srv.port}/0", timeout_s=0.3)
    conn.send(b"GET ...")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        conn.read_value(memoryview(np.zeros(HEADER_BYTES, np.uint8)), memoryview(np.zeros(W, np.uint8)))
    assert time.monotonic() - t0 < 2 * 0.3 + 1.0, "one timeout before the value, at most two within it"
    conn.close()


def test_a_server_that_takes_nothing_times_out_the_send():
    srv = socket.create_server(("127.0.0.1", 0))           # accepts (the backlog), never reads
    conn = resp.RespConnection(f"redis://127.0.0.1:{srv.getsockname()[1]}/0", timeout_s=0.3)
    with pytest.raises(TimeoutError):
        conn.send(bytes(256 << 20))                       # more than both sockets' buffers hold
    conn.close()
    srv.close()


def test_checksum_catches_what_it_promises():
    p = payloads(1)[0]
    c = checksum(p)
    assert c == checksum(p.copy()) == checksum(p.tobytes()), "a function of the bytes alone"
    for pos in (0, 1, W // 2 + 3, W - 1):                 # one bit anywhere, at either end
        for bit in (0, 7):
            q = p.copy()
            q[pos] ^= np.uint8(1 << bit)
            assert checksum(q) != c
    q = p.copy()
    q.view("<u8")[[3, 9]] ^= np.uint64(1 << 63)            # the same bit of two 64-bit words
    assert checksum(q) != c
    q = p.copy()
    q[[0, 4]] = q[[4, 0]]                                 # two words' bytes swapped
    assert q[0] == q[4] or checksum(q) != c
    odd = p[:W - 3]                                       # a length that is not a multiple of 4
    assert checksum(odd) == checksum(odd.copy()) and checksum(odd) != checksum(p[:W - 2])
    assert header(FP, hashes(1)[0], p)[-8:] == c.to_bytes(8, "little")
    assert header(FP, hashes(1)[0], p)[4:6] == (3).to_bytes(2, "little")


def fill_redis(srv, n: int, seed: int = 0) -> np.ndarray:
    p = payloads(n, seed)
    r = srv.client()
    for h, row in zip(hashes(n), p):
        r.set(block_key(FP, h), pack_value(FP, h, row))
    return p


def read(store, n: int, keys=None):
    """-> (verdicts, rows) of a read_into of n blocks, checked as a lookup checks them."""
    hs = hashes(n)
    heads, rows = np.zeros((n, HEADER_BYTES), np.uint8), np.zeros((n, W), np.uint8)
    chunks = store.read_into(keys or [block_key(FP, h) for h in hs], heads, rows,
                             lambda i: check(heads[i], rows[i], FP, hs[i]))
    verdicts = []
    for a, b, f in chunks:
        got = f.result()
        verdicts += got if got is not None else [None] * (b - a)
    return verdicts, rows


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 rows: a 40-block read over 4 connections crosses every lane several times."""
    monkeypatch.setattr(redis_store, "GET_CHUNK_BYTES", 3 * (W + HEADER_BYTES))


def test_read_into_stops_at_a_missing_or_corrupt_value(redis_server, small_chunks):
    p = fill_redis(redis_server, 40)
    store = RedisStore(RedisConfig(redis_server.url, timeout_s=5, read_connections=4))
    got, rows = read(store, 40)
    assert got == [HIT] * 40 and np.array_equal(rows, p)
    r = redis_server.client()
    r.delete(block_key(FP, hashes(40)[20]))
    got, rows = read(store, 40)
    assert got[:20] == [HIT] * 20 and got[20] == MISS and np.array_equal(rows[:20], p[:20])
    assert set(got[21:]) <= {HIT, SKIPPED}
    # Lanes run on their own threads, so the others may have read past the miss
    # before it is found; one lane sends at most the next chunk ahead of the one
    # it reads, and nothing after a miss is found.
    one = RedisStore(RedisConfig(redis_server.url, timeout_s=5, read_connections=1))
    got, _ = read(one, 40)
    assert got[:20] == [HIT] * 20 and got[20] == MISS
    assert got[21:24] in ([HIT] * 3, [SKIPPED] * 3) and got[24:] == [SKIPPED] * 16, \
        "chunks past the miss are not asked"
    one.close()
    bad = bytearray(pack_value(FP, hashes(40)[20], p[20]))
    bad[-1] ^= 1
    r.set(block_key(FP, hashes(40)[20]), bytes(bad))
    got, _ = read(store, 40)
    assert got[:20] == [HIT] * 20 and got[20] == REFUSED
    assert store.stats()["state"] == "up" and store.stats()["errors"] == 0
    store.close()


@pytest.mark.parametrize("conns", [1, 3])
def test_a_lookup_reads_over_its_connections_each_checking_what_it_received(redis_server, small_chunks, conns,
                                                                              monkeypatch):
    p = fill_redis(redis_server, 40)
    store = RedisStore(RedisConfig(redis_server.url, timeout_s=5, read_connections=conns))
    hs, received, checked = hashes(40), {}, {}
    heads, rows = np.zeros((40, HEADER_BYTES), np.uint8), np.zeros((40, W), np.uint8)
    real, row_at = resp.RespConnection.read_value, {rows[i].ctypes.data: i for i in range(40)}
    together = threading.Barrier(conns, timeout=10)     # no lane finishes before the others start

    def read_value(self, head, payload):
        if threading.current_thread().name not in received.values():
            together.wait()
        r = real(self, head, payload)
        received[row_at[np.asarray(payload).ctypes.data]] = threading.current_thread().name
        return r
    monkeypatch.setattr(resp.RespConnection, "read_value", read_value)

    def verify(i):
        checked[i] = threading.current_thread().name
        return check(heads[i], rows[i], FP, hs[i])
    got = [v for _, _, f in store.read_into([block_key(FP, h) for h in hs], heads, rows, verify) for v in f.result()]
    assert got == [HIT] * 40 and np.array_equal(rows, p)
    assert checked == received and all(t.startswith("kvstore-redis-read") for t in checked.values())
    # The server saw the lookup's connections (kept for the next one) beside redis-py's.
    names = [c for c in redis_server.client().client_list() if c["cmd"] in ("get", "getex")]
    assert len(names) == conns
    store.close()
    for bad in (-1, redis_store.MAX_READ_CONNECTIONS + 1):
        with pytest.raises(InvalidArgument, match="redis-read-connections"):
            RedisConfig(redis_server.url, read_connections=bad)


def test_by_default_a_lookup_reads_over_as_many_connections_as_its_server_serves_fastest(redis_server,
                                                                                       small_chunks):
    p = fill_redis(redis_server, 40)
    r = redis_server.client()
    valkey = r.info("server").get("server_name") == "valkey"
    want = redis_nodes.VALKEY_LANES if valkey else redis_nodes.REDIS_LANES

    def lookup_connections(url):
        store = RedisStore(RedisConfig(url, timeout_s=5))
        r.client_kill_filter(_type="normal", skipme=True)
        got, rows = read(store, 40)
        assert got == [HIT] * 40 and np.array_equal(rows, p)
        lanes = store.read_lanes(store.topology.seed)
        used = len([c for c in r.client_list() if c["cmd"] in ("get", "getex")])
        store.close()
        return lanes, used
    assert lookup_connections(redis_server.url) == (want, want)
    # An ACL user that may not ask the server what it is: one connection, lookups served.
    r.acl_setuser("noinfo", enabled=True, passwords=["+pw"], keys=["kvstore:*"], commands=["+@all", "-info"])
    assert lookup_connections(f"redis://noinfo:pw@127.0.0.1:{redis_server.port}/0") == (1, 1)
    # A server that does not answer what it is fails the lookup after one timeout, as a lane would.
    slow = RedisStore(RedisConfig(redis_server.url, timeout_s=0.3, backoff_s=5))
    redis_server.pause()
    try:
        t0 = time.monotonic()
        got, _ = read(slow, 40)
        took = time.monotonic() - t0
    finally:
        redis_server.resume()
    assert got == [None] * 40 and took < 0.3 + 0.25, took
    assert slow.stats()["state"] == "down" and slow.stats()["errors"] == 1
    slow.close()
    # --redis-read-connections says how many, whatever the server.
    store = RedisStore(RedisConfig(redis_server.url, timeout_s=5, read_connections=3))
    assert store.read_lanes(store.topology.seed) == 3
    store.close()


def test_a_server_killed_mid_batch_puts_the_store_down_and_it_reconnects(redis_server, small_chunks, monkeypatch):
    p = fill_redis(redis_server, 40)
    store = RedisStore(RedisConfig(redis_server.url, timeout_s=2, backoff_s=0.5, read_connections=4))
    hs = hashes(40)
    heads, rows = np.zeros((40, HEADER_BYTES), np.uint8), np.zeros((40, W), np.uint8)
    real, calls = resp.RespConnection.read_value, []

    def read_value(self, head, payload):
        calls.append(1)
        if len(calls) == 11:
            redis_server.kill()           # mid-batch: the lanes are reading their chunks
        return real(self, head, payload)
    monkeypatch.setattr(resp.RespConnection, "read_value", read_value)
    chunks = store.read_into([block_key(FP, h) for h in hs], heads, rows,
                             lambda i: check(heads[i], rows[i], FP, hs[i]))
    results = [f.result() for _, _, f in chunks]
    monkeypatch.setattr(resp.RespConnection, "read_value", real)
    assert None in results, "a lane saw the server go"
    assert store.stats()["state"] == "down" and store.stats()["outages"] == 1
    for (a, b, _), got in zip(chunks, results):      # whatever a lane reported as a hit is the value
        for i, v in zip(range(a, b), got or []):
            assert v != HIT or np.array_equal(rows[i], p[i])
    got, _ = read(store, 40)
    assert got == [None] * 40, "the breaker skips Redis for its back-off"
    redis_server.start()                   # its AOF kept the values
    deadline = time.monotonic() + 10
    while read(store, 40)[0] != [HIT] * 40:
        assert time.monotonic() < deadline, "the store did not reconnect"
        time.sleep(0.1)
    assert store.stats()["state"] == "up"
    store.close()


def test_read_connections_log_in_as_the_urls_acl_user_and_getex_renews(redis_server):
    fill_redis(redis_server, 5)
    r = redis_server.client()
    r.acl_setuser("kv", enabled=True, passwords=["+s3cr et"], keys=["kvstore:*"], commands=["+@all"])
    store = RedisStore(RedisConfig(f"redis://kv:s3cr%20et@127.0.0.1:{redis_server.port}/0", timeout_s=5, ttl_s=50))
    got, _ = read(store, 5)
    assert got == [HIT] * 5 and all(0 < r.ttl(block_key(FP, h)) <= 50 for h in hashes(5))
    store.close()
    with pytest.raises(resp.ReplyError, match="WRONGPASS") as e:
        resp.RespConnection(f"redis://kv:nope@127.0.0.1:{redis_server.port}/0", timeout_s=5)
    assert "nope" not in str(e.value)
    with pytest.raises(resp.ReplyError, match="SELECT"):       # a database the server does not have
        resp.RespConnection(f"redis://127.0.0.1:{redis_server.port}/99", timeout_s=5)


@pytest.mark.skipif(shutil.which("openssl") is None or shutil.which("redis-server") is None,
                    reason="needs openssl (a certificate) and redis-server")
def test_tls_url_reads_through_tls(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                             "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"rediss://localhost:{port}/0?ssl_ca_certs={cert}"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                resp.RespConnection(url, timeout_s=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "redis-server with TLS did not start"
                time.sleep(0.05)
        store = RedisStore(RedisConfig(url, timeout_s=5))        # redis-py (PING, puts) and resp.py (reads)
        p = payloads(6)
        for h, row in zip(hashes(6), p):
            store.client.set(block_key(FP, h), pack_value(FP, h, row))
        got, rows = read(store, 6)
        assert got == [HIT] * 6 and np.array_equal(rows, p)
        store.close()
        with pytest.raises(ssl.SSLError):                        # without the CA, the self-signed server is refused
            resp.RespConnection(f"rediss://localhost:{port}/0", timeout_s=5)
    finally:
        proc.kill()
        proc.wait()
