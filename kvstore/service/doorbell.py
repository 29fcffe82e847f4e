"""The doorbell: a per-step fast lane for AppendAttend beside the gRPC control
plane (docs/design.md, Control plane and data planes), for local callers with a registered buffer.

A Python gRPC message costs ~150-250 µs a round trip (docs/rpc.md)
before any work, as much as a whole decode step's attention budget. Here a step is one small
struct-packed packet (protocol/bell.py) on a SOCK_SEQPACKET Unix socket next to the
daemon's, read by a thread of its own per connection, and one status packet
back. The connection is bound at its first packet to the (tenant, session)
whose token RegisterBuffer handed out, so calls see that caller's buffers and
renew its lease as its gRPC calls would; the work is gRPC's AppendAttend
path (handlers.py: same checks, errors, counters).

Like gRPC's, the socket is 0600 in a directory only the daemon's uid can
write (sockets.py), taken over only from a daemon that is gone and removed
at stop only while it is still ours; the token keeps one tenant's local
caller from acting as another.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import socket
import struct
import threading
import time

import grpc

from kvstore.errors import InvalidArgument, KVStoreError, Unimplemented
from kvstore.protocol import bell
from kvstore.v1 import kvstore_pb2 as pb

from . import sockets

log = logging.getLogger("kvstore.doorbell")
MAX_REQUESTS = 1024          # decoded requests kept per connection (a decode loop repeats a few shapes)
# A connection at the limit waits this long for a slot: a client that closed one a moment
# ago frees its slot only when that connection's thread sees the close.
SLOT_WAIT_S = 0.5
FLOOD_HELLO_WAIT_S = 0.005      # past the connections waiting for a slot: the accept thread's wait for a hello
_CODES = {c.name: c.value[0] for c in grpc.StatusCode}
_TAKEN = bell.pack_reply(0, _CODES["RESOURCE_EXHAUSTED"], 0, "doorbell: all connections are taken; call AppendAttend")


class Doorbell:
    """handlers: the Handlers (handlers.py) whose doorbell_append_attend serves calls;
    max_conns: open connections (each holds a thread while open)."""

    def __init__(self, path: str, handlers, max_conns: int = 64):
        self.path = path
        self.handlers = handlers
        self._slots = threading.BoundedSemaphore(max_conns)
        self._turning = threading.BoundedSemaphore(max_conns)     # connections waiting for a slot
        self._sessions: dict[bytes, tuple[str, str]] = {}      # token digest -> (tenant, session)
        self._tokens: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._ident: tuple[int, int] | None = None   # (device, inode) of the socket file we bound
        self.counters = dict(connections=0, calls=0, errors=0)
        # observe(method, code name, seconds): the daemon's metrics, which count
        # doorbell calls as method AppendAttendDoorbell (the interceptor never sees them).
        # Called once the reply is sent, off the caller's latency: a scrape may miss a
        # call whose reply left microseconds before it.
        self.observe = None

    # -------------------------------------------------------------- tokens
    def token_for(self, tenant: str, session: str) -> bytes:
        """The token of a caller (one per tenant and session, made on first ask)."""
        with self._lock:
            tok = self._tokens.get((tenant, session))
            if tok is None:
                tok = self._tokens[(tenant, session)] = secrets.token_bytes(bell.TOKEN_BYTES)
                self._sessions[_digest(tok)] = (tenant, session)
            return tok

    def revoke(self, tenant: str, session: str) -> None:
        """A lapsed session's token stops working (its open connections answer
        its next call with UNAUTHENTICATED and close)."""
        with self._lock:
            tok = self._tokens.pop((tenant, session), None)
            if tok is not None:
                del self._sessions[_digest(tok)]

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        sockets.claim(self.path, socket.SOCK_SEQPACKET)     # SocketError: a live daemon's
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        umask = os.umask(0o077)
        try:
            s.bind(self.path)
            self._ident = sockets.identity(self.path)
            os.chmod(self.path, 0o600)
            s.listen(64)
        except OSError:
            s.close()
            sockets.remove_if_ours(self.path, self._ident)
            raise
        finally:
            os.umask(umask)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), name="kvstore-doorbell", daemon=True).start()

    def stop(self) -> None:
        s, self._listener = self._listener, None
        if s is not None:
            s.shutdown(socket.SHUT_RDWR)
            s.close()
            sockets.remove_if_ours(self.path, self._ident)
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self, listener: socket.socket) -> None:
        failing = False
        while True:
            try:
                conn, _ = listener.accept()
            except OSError as e:
                if self._listener is not listener:
                    return          # stop() closed the listener
                # Out of descriptors (EMFILE, ENFILE) or a connection gone before it was
                # taken: the listener still works, and returning would end the doorbell.
                if not failing:
                    log.warning("doorbell: accept failed (%s); retrying until it works", e.strerror or e)
                failing = True
                time.sleep(0.05)
                continue
            failing = False
            if not self._turning.acquire(blocking=False):     # a flood: no thread for each
                self._turn_away(conn, FLOOD_HELLO_WAIT_S)     # on the accept thread, which serves everyone
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvstore-doorbell-conn", daemon=True).start()

    def _turn_away(self, conn: socket.socket, wait: float = 1.0) -> None:
        """RESOURCE_EXHAUSTED in reply to the hello, which is read first (waiting up to
        `wait` s for it: a client sends it as it connects): a socket closed with a packet
        unread resets the connection, and the client would get that instead."""
        with contextlib.suppress(OSError):
            conn.settimeout(wait)
            conn.recv(bell.MAX_PACKET)
        _send(conn, _TAKEN)
        conn.close()

    # -------------------------------------------------------------- serving
    def _serve(self, conn: socket.socket) -> None:
        if not self._slots.acquire(timeout=SLOT_WAIT_S):
            try:
                self._turn_away(conn)
            finally:
                self._turning.release()
            return
        self._turning.release()
        with self._lock:            # stop() may have come while this one waited: it lists _conns under the lock
            stopped = self._listener is None
            if not stopped:
                self._conns.add(conn)
        if stopped:
            conn.close()
            self._slots.release()
            return
        self.counters["connections"] += 1
        try:
            who = self._hello(conn)
            if who is not None:
                self._loop(conn, *who)
        except OSError:
            pass                # the client went away mid-reply: nothing to tell it
        except Exception:  # noqa: BLE001 - one connection must not take the daemon down
            log.exception("doorbell connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            self._slots.release()

    def _hello(self, conn: socket.socket) -> tuple[bytes, str, str] | None:
        data = conn.recv(bell.MAX_PACKET)
        if len(data) != bell.HELLO.size or data[:4] != bell.HELLO_MAGIC:
            _send(conn, bell.pack_reply(0, _CODES["INVALID_ARGUMENT"], 0,
                                        f"hello: {len(data)} bytes, expected {bell.HELLO.size} starting "
                                        f"{bell.HELLO_MAGIC!r}"))
            return None
        digest = _digest(bell.HELLO.unpack(data)[1])
        who = self._sessions.get(digest)
        if who is None:
            _send(conn, bell.pack_reply(0, _CODES["UNAUTHENTICATED"], 0, "doorbell_token: unknown or revoked"))
            return None
        conn.sendall(bell.pack_reply(0, 0, 0))
        return (digest, *who)

    def _loop(self, conn: socket.socket, digest: bytes, tenant: str, session: str) -> None:
        view = self.handlers.buffer_table.view(tenant, session)
        buf = bytearray(bell.MAX_PACKET)
        mv = memoryview(buf)
        registry = self.handlers.buffer_table.registry
        # descriptor -> [its request, its Resolved, the registry generation it was resolved in]
        requests: dict[bytes, list] = {}
        while True:
            n = conn.recv_into(buf, bell.MAX_PACKET, socket.MSG_TRUNC)
            if n == 0:
                return          # the client closed its end
            t0 = time.perf_counter_ns()
            call = int.from_bytes(mv[:4], "little") if n >= 4 else 0
            code, message, dtype, name = 0, "", 0, "OK"
            try:
                if self._sessions.get(digest) is None:
                    _send(conn, bell.pack_reply(call, _CODES["UNAUTHENTICATED"], 0,
                                                "doorbell_token: revoked (the session's lease lapsed)"))
                    return
                key, ids = _key(mv, n)
                entry = requests.get(key)
                if entry is None:
                    entry = [_decode(mv, n), None, -1]
                    if len(requests) >= MAX_REQUESTS:
                        requests.clear()
                    requests[key] = entry
                if ids is not None:          # op 2: this call's token ids (not part of the key)
                    del entry[0].token_ids[:]
                    entry[0].token_ids.extend(ids)
                gen = registry.generation
                dtype, resolved = self.handlers.doorbell_append_attend(
                    entry[0], tenant, session, view, entry[1] if entry[2] == gen else None)
                entry[1], entry[2] = resolved, gen
            except KVStoreError as e:
                name = e.code if e.code in _CODES else "INTERNAL"
                code, message = _CODES[name], str(e)
            except AssertionError as e:      # a broken invariant (debug builds check after every call)
                log.error("invariant broken after a doorbell AppendAttend: %s", e)
                name, message = "INTERNAL", f"invariant broken after AppendAttend: {e}"
                code = _CODES[name]
            except Exception as e:  # noqa: BLE001 - as the gRPC handler: INTERNAL, logged, keep serving
                log.exception("doorbell AppendAttend failed")
                name, message = "INTERNAL", f"{type(e).__name__}: {e}"
                code = _CODES[name]
            self.counters["calls"] += 1
            self.counters["errors"] += code != 0
            ns = time.perf_counter_ns() - t0
            conn.sendall(bell.pack_reply(call, code, ns // 1000, message, dtype))
            if self.observe is not None:
                self.observe("AppendAttendDoorbell", name, ns / 1e9)


def _tokens(mv: memoryview, n: int) -> tuple[int, int, int] | None:
    """An op 2 packet's (query tokens, number of ids, where the ids start), from the
    TOKENS at its end; None for op 1 or a packet too short to hold them."""
    if n < bell.REQUEST.size + bell.TOKENS.size or n > bell.MAX_PACKET or \
            int.from_bytes(mv[4:6], "little") != bell.OP_APPEND_ATTEND_TOKENS:
        return None
    t, n_ids = bell.TOKENS.unpack_from(mv, n - bell.TOKENS.size)
    at = n - bell.TOKENS.size - 8 * n_ids
    return (t, n_ids, at) if at >= bell.REQUEST.size else None


def _key(mv: memoryview, n: int) -> tuple[bytes, tuple | None]:
    """-> (the packet less its call id and token ids: what its decoded request and
    resolved buffers are kept under, its token ids or None)."""
    tok = _tokens(mv, n)
    if tok is None:
        return bytes(mv[4:min(n, bell.MAX_PACKET)]), None
    _, n_ids, at = tok
    return bytes(mv[4:at]) + bytes(mv[n - bell.TOKENS.size:n]), struct.unpack_from(f"<{n_ids}q", mv, at)


def _decode(mv: memoryview, n: int) -> pb.AppendAttendRequest:
    """A request packet -> the AppendAttendRequest it stands for, less op 2's token
    ids; InvalidArgument naming the part that is wrong."""
    if n > bell.MAX_PACKET:
        raise InvalidArgument("descriptor", f"{n} bytes, at most {bell.MAX_PACKET}")
    if n < bell.REQUEST.size:
        raise InvalidArgument("descriptor", f"{n} bytes, shorter than the {bell.REQUEST.size}-byte header")
    (_, op, dtype, layer, scale, k_off, v_off, q_off, out_off, *dims, n_buf, n_cache,
     n_seqs) = bell.REQUEST.unpack_from(mv)
    if op not in (bell.OP_APPEND_ATTEND, bell.OP_APPEND_ATTEND_TOKENS):
        raise Unimplemented("op", f"{op}: the doorbell serves AppendAttend (ops {bell.OP_APPEND_ATTEND} and "
                            f"{bell.OP_APPEND_ATTEND_TOKENS}) only")
    t, end = 0, n       # op 1: query_tokens unset (one), as by gRPC
    if op == bell.OP_APPEND_ATTEND_TOKENS:     # (its token ids: _key's, set per call)
        tok = _tokens(mv, n)
        if tok is None:
            raise InvalidArgument("descriptor", f"{n} bytes do not hold the token ids and query tokens "
                                  "that end an op 2 packet")
        t, _, end = tok
    o = bell.REQUEST.size
    lens = struct.unpack_from(f"<{n_seqs}H", mv, o) if o + 2 * n_seqs <= end else None
    o += 2 * n_seqs
    if lens is None or o + n_buf + n_cache + sum(lens) != end:
        raise InvalidArgument("descriptor", f"{n} bytes do not hold the buffer id, cache and {n_seqs} "
                              "sequence ids its header announces")
    parts = []
    for field, size in (("buffer_id", n_buf), ("cache", n_cache), *(("sequence_ids", m) for m in lens)):
        try:
            parts.append(str(mv[o:o + size], "utf-8"))
        except UnicodeDecodeError:
            raise InvalidArgument(field, "is not UTF-8") from None
        o += size
    bid, cache, seq_ids = parts[0], parts[1], parts[2:]

    def tensor(off, shape):
        return pb.Tensor(shape=shape, dtype=dtype, ref=pb.BufferRef(buffer_id=bid, offset=off))
    return pb.AppendAttendRequest(cache=cache, layer=layer, sequence_ids=seq_ids, scale=scale,
                                  k=tensor(k_off, dims[0:3]), v=tensor(v_off, dims[3:6]), q=tensor(q_off, dims[6:9]),
                                  out=pb.OutputRef(buffer_id=bid, offset=out_off), query_tokens=t)


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _send(conn: socket.socket, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:
        pass
