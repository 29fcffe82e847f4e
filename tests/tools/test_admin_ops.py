"""kvstore-admin as an operator uses it: numbers in --json are JSON numbers,
the stats text says nominal and effective bytes per token apart and reserved
vs used bytes per pool, a closed pipe (`| head -1`) ends it quietly,
delete-cache says what it dropped, and a call that reaches no daemon says why."""
import json
import shutil
import socket
import subprocess
import sys
import time
import types

import pytest
import torch

from kvstore.client import KVStoreClient
from kvstore.service.daemon import create_server
from kvstore.tools import admin

L, HQ, HKV, D = 2, 4, 2, 16


@pytest.fixture
def live(tmp_path):
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock)
    kv = KVStoreClient(f"unix://{sock}", heartbeat=False)
    kv.create_cache("pq", "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec="pq",
                    block_size=8, residual=8, num_blocks=64, max_sequences=16)
    g = torch.Generator().manual_seed(0)
    kv.train_codebooks("pq", torch.randn(L, 256, HKV, D, generator=g), torch.randn(L, 256, HKV, D, generator=g),
                       niter=2)
    kv.allocate("pq", "a", list(range(40)))
    k = torch.randn(L, 40, HKV, D).half()
    kv.append("pq", ["a"], k, k, token_ids=[list(range(40))])
    yield sock, kv
    kv.close()
    server.stop(0)


def run(capsys, *argv) -> str:
    admin.main(list(argv))
    return capsys.readouterr().out


def test_json_numbers_are_numbers(live, capsys):
    sock, _ = live
    c = json.loads(run(capsys, "--socket", sock, "--json", "stats"))["caches"][0]
    assert c["tokens"] == 40 and c["sequences"] == 1                   # uint64: numbers, not "40"
    assert c["main"]["capacity"] == 64 and c["tail_reserved_bytes"] > 0
    assert isinstance(c["effective_bytes_per_token"], float)
    s = json.loads(run(capsys, "--socket", sock, "--json", "seq", "a"))
    assert s["length"] == 40 and all(isinstance(b, int) for b in s["sealed_blocks"])


def test_stats_text_says_nominal_and_effective_apart(live, capsys):
    sock, kv = live
    c = kv.stats("pq").caches[0]
    # 40 tokens, R = 8, block 8: 3 blocks sealed, the rest fp16 in the tail.
    assert c.compression_ratio == 4.0 and c.fp16_bytes_per_token / c.effective_bytes_per_token < 2.0
    out = run(capsys, "--socket", sock, "stats")
    assert "nominal 64 B/token for sealed tokens (x4.00 vs fp16's 256)" in out
    eff = c.fp16_bytes_per_token / c.effective_bytes_per_token
    assert f"effective {c.effective_bytes_per_token:,.0f} B/token now (x{eff:.2f}: the main and tail pools' " \
           "used bytes / their tokens; 40 tokens in all tiers, 24 of them sealed)" in out
    # Reserved vs used per pool; the tail pool (16 sequences x 4 blocks x 8 tokens x 256 B) shows up.
    assert c.tail_reserved_bytes == 16 * 4 * 8 * 256 and c.tail_used_bytes == c.tail.used * 8 * 256
    tail_row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["tail"])
    assert tail_row[-4:] == ["128.0", "KiB", "4.0", "KiB"], tail_row
    assert c.reserved_bytes == c.main_reserved_bytes + c.tail_reserved_bytes
    assert c.used_bytes == c.main_used_bytes + c.tail_used_bytes


def test_a_closed_pipe_ends_it_quietly(live):
    sock, _ = live
    # watch writes again after head has gone: that write is the one that meets the closed pipe.
    r = subprocess.run(["bash", "-c", "set -o pipefail; \"$0\" -m kvstore.tools.admin --socket \"$1\" --json watch "
                        "--count 20 --interval 0.1 | head -1", sys.executable, sock],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["caches"][0]["tokens"] == 40, (r.stdout, r.stderr)
    assert r.stderr == "", r.stderr


def test_watch_into_a_pipe_shows_each_refresh_as_it_comes(live):
    sock, _ = live
    p = subprocess.Popen([sys.executable, "-m", "kvstore.tools.admin", "--socket", sock, "watch", "--interval", "60"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The first refresh, read while watch sleeps until the next: nothing waits in a buffer.
        lines = [p.stdout.readline() for _ in range(3)]
        assert lines[1].startswith("kvstore unix:") and lines[2].startswith("cache pq: 1 sequences"), lines
    finally:
        p.kill()
        p.communicate()


def test_delete_cache_says_what_went(live, capsys):
    sock, kv = live
    with pytest.raises(SystemExit, match="FAILED_PRECONDITION: force: cache 'pq': 1 of its 1 sequences") as e:
        admin.main(["--socket", sock, "delete-cache", "pq"])
    assert "or pass --force to drop them too" in str(e.value)
    out = run(capsys, "--socket", sock, "delete-cache", "pq", "--force")
    assert out.startswith("deleted cache pq: 1 sequences (1 held by live leases, 0 pinned, 0 with a disk copy")
    assert "blocks dropped: 3 main, 2 tail, 0 host, 0 cached prefix" in out      # 24 sealed + 16 tail tokens, all held
    assert run(capsys, "--socket", sock, "stats").strip() == "no caches"


def test_no_daemon_says_how_to_start_one(tmp_path):
    sock = str(tmp_path / "none.sock")
    with pytest.raises(SystemExit) as e:
        admin.main(["--socket", sock, "--timeout", "2", "stats"])
    assert str(e.value).startswith("kvstore-admin: UNAVAILABLE: ")
    assert f"no daemon answers at unix://{sock}: start one (kvstore-server, or make serve)" in str(e.value)


def _cert(d, name: str) -> str:
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    return str(cert)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_a_tls_port_reached_without_tls_names_tls_ca_not_a_missing_daemon(tmp_path):
    from kvstore.service.auth import Authenticator
    cert, other = _cert(tmp_path, "daemon"), _cert(tmp_path, "other")
    key = open(cert.replace(".pem", ".key"), "rb").read()
    server, port, _ = create_server(socket_path=str(tmp_path / "kv.sock"), port=0, host="localhost",
                                    auth=Authenticator({"tok": "t"}), tls=(open(cert, "rb").read(), key))
    with socket.socket() as s:      # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]

    def error(*argv) -> str:
        with pytest.raises(SystemExit) as e:
            admin.main([*argv, "--timeout", "3", "stats"])
        assert str(e.value).startswith("kvstore-admin: UNAVAILABLE: "), str(e.value)
        return str(e.value)
    try:
        plain = error("--target", f"localhost:{port}", "--token", "tok")
        assert (f"localhost:{port} took the connection and closed it: if the daemon serves TLS there (--tls-cert), "
                "pass --tls-ca CA.pem (and --token TOKEN)") in plain
        assert "no daemon answers" not in plain
        wrong_ca = error("--target", f"localhost:{port}", "--token", "tok", "--tls-ca", other)
        assert f"a TLS handshake with localhost:{port} failed: --tls-ca must name the CA that signed" in wrong_ca
        refused = error("--target", f"localhost:{closed}", "--token", "tok")
        assert f"no daemon answers at localhost:{closed}: start one" in refused
        # a CA file that is not there, or holds no certificate: named, not "no daemon answers"
        (tmp_path / "notes.txt").write_text("not a certificate\n")
        for path, says in ((str(tmp_path / "none.pem"), "cannot read"), (str(tmp_path / "notes.txt"), "holds no PEM")):
            with pytest.raises(SystemExit) as e:
                admin.main(["--target", f"localhost:{port}", "--token", "tok", "--tls-ca", path, "stats"])
            assert str(e.value).startswith(f"kvstore-admin: --tls-ca {path}: {says}"), str(e.value)
        # a token read with its line's newline (an env file) is the token
        with KVStoreClient(f"localhost:{port}", token="tok\n", tls_ca=cert, heartbeat=False) as kv:
            assert kv.stats() is not None
    finally:
        server.stop(0)


@pytest.fixture
def empty(tmp_path):
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(socket_path=sock)
    kv = KVStoreClient(f"unix://{sock}", heartbeat=False)
    yield sock, kv
    kv.close()
    server.stop(0)


def _put(kv, cache: str, sid: str, prompt: list[int], seed: int) -> None:
    hit = kv.allocate(cache, sid, prompt)
    k = torch.randn(L, len(prompt) - hit, HKV, D, generator=torch.Generator().manual_seed(seed)).half()
    kv.append(cache, [sid], k, k, token_ids=[prompt[hit:]])


@pytest.mark.parametrize("codec", ["fp16", "pq"])
def test_blocks_counts_each_pool_block_once_by_its_holders(empty, capsys, codec):
    sock, kv = empty
    kv.create_cache("c", "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec=codec,
                    block_size=8, residual=8, num_blocks=16, max_sequences=8)
    if codec == "pq":
        g = torch.Generator().manual_seed(0)
        kv.train_codebooks("c", torch.randn(L, 256, HKV, D, generator=g),
                           torch.randn(L, 256, HKV, D, generator=g), niter=2)
    n = 32 if codec == "fp16" else 40
    _put(kv, "c", "long", list(range(n)), 0)
    _put(kv, "c", "short", list(range(n - 16)) + [999] * 4, 1)      # a prefix hit of long's first blocks
    long, short = (kv.sequence_info("c", s) for s in ("long", "short"))
    st = kv.stats("c").caches[0]
    if codec == "fp16":
        # One pool: long's second sealed block is the first of short's tail.
        assert list(long.sealed_blocks) == [0, 1] and list(short.sealed_blocks) == [0]
        assert list(short.tail_blocks)[0] == 1 and st.main.used == 5
        want = {"1": 3, "2": 2}           # blocks 0 and 1 shared, 2, 3 (long's tail) and 4 (short's) not
    else:
        # Tail ids name the tail pool: tail block 0 is not main block 0.
        assert list(long.sealed_blocks) == [0, 1, 2] and list(short.sealed_blocks) == [0, 1]
        assert list(long.tail_blocks) == [0, 1] and (st.main.used, st.tail.used) == (3, 4)
        want = {"1": 5, "2": 2}           # main 0, 1 shared; main 2 and the 4 tail blocks not
    js = json.loads(run(capsys, "--socket", sock, "--json", "blocks"))["c"]
    assert js["refs_histogram"] == want
    assert sum(js["refs_histogram"].values()) == sum(int(p["used"]) for p in js["tiers"].values())
    out = run(capsys, "--socket", sock, "blocks")
    assert f"GPU blocks by this tenant's sequences referencing them: 1 seq: {want['1']}, 2 seqs: {want['2']}" in out


def test_blocks_counts_no_holes_of_a_sliding_window(empty, capsys):
    sock, kv = empty
    kv.create_cache("w", "m", num_layers=L, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, codec="fp16",
                    block_size=8, residual=8, num_blocks=32, max_sequences=8, layer_windows=[9, 9])
    for i, sid in enumerate(("a", "b")):
        _put(kv, "w", sid, [1000 * i + t for t in range(48)], i)
    a = kv.sequence_info("w", "a")
    # 4 sealed blocks left the window: each a hole naming the null block, which no sequence holds.
    assert a.window_freed_blocks == 4 and len(set(a.sealed_blocks)) == 1 and len(a.tail_blocks) == 2
    js = json.loads(run(capsys, "--socket", sock, "--json", "blocks"))["w"]
    assert js["refs_histogram"] == {"1": 4}       # the two tails, not one block that 8 holes share
    assert int(js["tiers"]["main"]["used"]) == 4      # not the null block, the cache's own


@pytest.mark.parametrize("argv, flag, said", [
    (["watch", "--interval", "-1", "--count", "2"], "--interval", "must be > 0, got -1"),
    (["watch", "--interval", "0"], "--interval", "must be > 0, got 0"),
    (["watch", "--count", "-5"], "--count", "must be >= 0, got -5"),
    (["--timeout", "0", "stats"], "--timeout", "must be > 0, got 0"),
    (["--timeout", "-1", "health"], "--timeout", "must be > 0, got -1"),
    (["--timeout", "nan", "stats"], "--timeout", "must be > 0, got nan"),
])
def test_bad_flag_values_are_refused_before_any_call(live, capsys, monkeypatch, argv, flag, said):
    # Before: a refresh and then a traceback (sleep), DEADLINE_EXCEEDED naming no flag,
    # or --count -5 taken as "forever". The daemon is up: only the parse can refuse them.
    sock, _ = live

    def sleep(s):
        raise AssertionError(f"watch refreshed and slept {s} s")
    monkeypatch.setattr(admin, "time", types.SimpleNamespace(sleep=sleep, time=time.time, strftime=time.strftime))
    with pytest.raises(SystemExit) as e:
        admin.main(["--socket", sock, *argv])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.splitlines()[-1].endswith(f"error: argument {flag}: {said}"), err


def test_stats_shows_the_disk_tier_with_no_cache(tmp_path, capsys):
    """Right after a restart no cache exists yet, and what is on disk is what an operator
    asks first: stats shows the store with no cache, as Stats carries it apart from them."""
    from kvstore.engine.engine import Engine
    from tests.helpers import config, kv as kv_of
    lmdb = str(tmp_path / "lmdb")
    e = Engine(lmdb_path=lmdb)
    e.create_cache(config(codec="fp16"))
    k, v = kv_of(2, 24, 2, 16)
    e.allocate("c", "default", "s", list(range(24)))
    e.append("c", "default", ["s"], k, v, [24], token_ids=[list(range(24))])
    e.offload("c", "default", ["s"])
    e.close()
    e.cold_store.close()                   # the daemon gone: its store's lock with it
    sock = str(tmp_path / "kv.sock")
    server, _, _ = create_server(Engine(lmdb_path=lmdb), socket_path=sock)     # the restart: no cache yet
    try:
        with KVStoreClient(f"unix://{sock}", heartbeat=False) as kv:
            reply = kv.stats()
        assert not reply.caches and reply.disk.entries > 0 and reply.disk.held_bytes > 0
        out = run(capsys, "--socket", sock, "stats")
        assert out.startswith(f"disk (shared by every cache): {reply.disk.entries} entries"), out
        assert "held by sequences" in out and "no caches" not in out
    finally:
        server.stop(0)
