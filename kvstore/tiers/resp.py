"""A small RESP2 client for the Redis tier's bulk reads (docs/scale.md, What limits it).

redis-py parses every reply into a bytes object: for 512 KiB values that is
a receive into its buffer, a copy into the object and later a copy out of it,
one Python object per value, and it reads about 0.5-0.8 GB/s a connection.
Here a pipeline of GETs is sent in one write and each bulk reply is received
with recv_into straight into the caller's buffers (the 88-byte header into
one row, the payload into a row of the pinned staging buffer): only what an
earlier receive read ahead into the connection's small buffer is copied.

Over TCP the socket is a blocking one whose timeouts are the kernel's
(SO_RCVTIMEO, SO_SNDTIMEO), so that the rest of a value is received by one
recv_into with MSG_WAITALL: one system call and one release of the GIL per
value, where a Python socket timeout makes every receive a poll() and a
recv() of whatever has arrived, often 64 KiB on loopback (docs/scale.md,
What limits it). A reply's line is read ahead at most LINE_READ bytes, so
that little of the payload after it goes through the connection's buffer.
The kernel's receive timeout bounds one call: a server that stops before a
value is noticed after one timeout, one that stops mid-value after at most
two (the call that was receiving it returns what came, the next one waits
a timeout for more). TLS sockets take no MSG_WAITALL: they keep Python's
timeout and receive what has arrived, call after call.

The connection speaks what the daemon's --redis URL says: TCP or TLS
(rediss://, with the URL's ssl_* options, as redis-py reads them), AUTH with
the URL's user and password, SELECT of its database. Control commands and
writes stay with redis-py (redis_store.py).
"""
from __future__ import annotations

import select
import socket
import ssl
import struct
from urllib.parse import parse_qs, unquote, urlsplit

# read_value: the value, no such key, an error reply or another length, or a cluster's
# answer that the key is served elsewhere or not now (MOVED, ASK, TRYAGAIN, CLUSTERDOWN).
HIT, MISS, OTHER, REDIRECT = 1, 2, 3, 4
CLUSTER_ERRORS = (b"-MOVED ", b"-ASK ", b"-TRYAGAIN", b"-CLUSTERDOWN")
BUFFER_BYTES = 64 << 10          # replies' lines, and whatever a receive reads past them
LINE_READ = 1024                 # a GET's reply line is read ahead at most this much (the header is 88 bytes)
MAX_LINE = 4096


class ReplyError(ConnectionError):
    """The server answered a control command (AUTH, SELECT, PING) with an error."""


class ProtocolError(ConnectionError):
    """A reply that is not RESP2 (the connection cannot be used further)."""


def _to_bool(v: str | None, default: bool) -> bool:
    """As redis-py reads a URL's boolean option."""
    if v is None or v == "":
        return default
    return v.upper() not in ("0", "F", "FALSE", "N", "NO")


def tls_context(query: str) -> ssl.SSLContext:
    """The TLS context of a rediss:// URL's options (redis_config.TLS_OPTIONS), with
    redis-py's defaults: certificates required, host names checked."""
    q = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    reqs = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL,
            "required": ssl.CERT_REQUIRED}[q.get("ssl_cert_reqs") or "required"]
    ctx = ssl.create_default_context(cafile=q.get("ssl_ca_certs") or None, capath=q.get("ssl_ca_path") or None)
    ctx.check_hostname = reqs != ssl.CERT_NONE and _to_bool(q.get("ssl_check_hostname"), True)
    ctx.verify_mode = reqs
    if q.get("ssl_certfile"):
        ctx.load_cert_chain(q["ssl_certfile"], q.get("ssl_keyfile") or None)
    return ctx


def command(*args: bytes) -> bytes:
    """One command in RESP (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out += [b"$%d\r\n" % len(a), a, b"\r\n"]
    return b"".join(out)


class RespConnection:
    """One connection, used by one thread at a time. Every error is an
    OSError (socket errors, timeouts, ReplyError, ProtocolError): the caller
    closes the connection and its breaker decides when to try again."""

    def __init__(self, url: str, timeout_s: float):
        u = urlsplit(url)
        sock = socket.create_connection((u.hostname, u.port or 6379), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.timeout_s = timeout_s
            self.waitall = u.scheme != "rediss" and hasattr(socket, "MSG_WAITALL")
            if u.scheme == "rediss":
                sock = tls_context(u.query).wrap_socket(sock, server_hostname=u.hostname)
            elif self.waitall:        # blocking, the kernel's timeouts (module docstring)
                sec = int(timeout_s)
                tv = struct.pack("ll", sec, max(1 if sec == 0 else 0, round((timeout_s - sec) * 1e6)))
                sock.settimeout(None)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self.sock = sock
            self.buf = bytearray(BUFFER_BYTES)
            self.view = memoryview(self.buf)
            self.lo = self.hi = 0            # unread bytes: buf[lo:hi]
            if u.password:
                user = [unquote(u.username).encode()] if u.username else []
                self.call(b"AUTH", *user, unquote(u.password).encode())
            db = u.path.strip("/")
            if db and int(db):
                self.call(b"SELECT", db.encode())
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def closed_while_idle(self) -> bool:
        """Whether an idle connection (no reply pending) can be read from: the
        server closed it (it restarted) or sent what nobody asked for. Either
        way it is no use; asked before it is reused, so that a restarted Redis
        is not taken for one that is down."""
        if self.lo < self.hi or getattr(self.sock, "pending", lambda: 0)():
            return True
        poll = select.poll()                # not select(): a daemon may hold descriptors past 1024
        poll.register(self.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        try:
            return bool(poll.poll(0))
        except OSError:
            return True

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except BlockingIOError:      # a blocking socket's SO_SNDTIMEO ran out
            raise TimeoutError(f"timed out: the server took nothing for {self.timeout_s} s") from None

    def _recv(self, dst: memoryview, flags: int = 0) -> int:
        """Receive into dst (at least one byte; all of it with MSG_WAITALL, unless the timeout ends it)."""
        try:
            got = self.sock.recv_into(dst, 0, flags)
        except BlockingIOError:      # a blocking socket's SO_RCVTIMEO ran out with nothing received
            raise TimeoutError(f"timed out: no reply for {self.timeout_s} s") from None
        if not got:
            raise ConnectionError("the server closed the connection")
        return got

    def call(self, *args: bytes):
        """A control command -> its reply (simple string, integer, bulk or an array of them)."""
        self.send(command(*args))
        return self.reply(args[0].decode())

    def reply(self, what: str = "reply", depth: int = 0):
        """The next reply; an error reply raises ReplyError naming `what`."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"-":
            raise ReplyError(f"{what}: {rest.decode(errors='replace')}")
        if kind == b"$":
            n = self._length(rest)
            if n < 0:
                return None
            out = bytearray(n)
            self._into(memoryview(out))
            self._crlf()
            return bytes(out)
        if kind == b"*" and depth < 8:
            n = self._length(rest)
            return None if n < 0 else [self.reply(what, depth + 1) for _ in range(n)]
        raise ProtocolError(f"unexpected reply {line[:32]!r}")

    # ------------------------------------------------------------ replies
    def read_value(self, head: memoryview, payload: memoryview) -> int:
        """The next reply, to a GET: HIT (a bulk string of exactly
        len(head) + len(payload) bytes, now in head and payload), MISS (nil),
        OTHER (an error reply, e.g. WRONGTYPE, or a bulk string of another
        length: read and dropped), REDIRECT (CLUSTER_ERRORS)."""
        line = self._line(LINE_READ)
        kind = line[:1]
        if kind == b"$":
            n = self._length(line[1:])
            if n < 0:
                return MISS
            if n == len(head) + len(payload):
                self._into(head)
                self._into(payload)
                self._crlf(LINE_READ)
                return HIT
            self._skip(n)
            self._crlf(LINE_READ)
            return OTHER
        if kind == b"-":
            return REDIRECT if line.startswith(CLUSTER_ERRORS) else OTHER
        raise ProtocolError(f"unexpected reply to GET {line[:32]!r}")

    def _fill(self, most: int = BUFFER_BYTES) -> None:
        """Receive more into the buffer, at most `most` bytes (moving what is unread to its start)."""
        if self.lo == self.hi:
            self.lo = self.hi = 0
        elif self.hi == len(self.buf):
            n = self.hi - self.lo
            self.buf[:n] = self.buf[self.lo:self.hi]
            self.lo, self.hi = 0, n
        self.hi += self._recv(self.view[self.hi:self.hi + most])

    def _line(self, most: int = BUFFER_BYTES) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.lo, self.hi)
            if i >= 0:
                line = bytes(self.view[self.lo:i])
                self.lo = i + 2
                return line
            if self.hi - self.lo >= MAX_LINE:
                raise ProtocolError("a reply line longer than %d bytes" % MAX_LINE)
            self._fill(most)

    @staticmethod
    def _length(text: bytes) -> int:
        try:
            return int(text)
        except ValueError:
            raise ProtocolError(f"a bulk length that is not a number: {text[:32]!r}") from None

    def _into(self, dst: memoryview) -> None:
        """Exactly len(dst) bytes of the stream into dst: the buffered ones,
        then straight from the socket."""
        n = len(dst)
        k = min(n, self.hi - self.lo)
        dst[:k] = self.view[self.lo:self.lo + k]
        self.lo += k
        flags = socket.MSG_WAITALL if self.waitall else 0
        while k < n:
            k += self._recv(dst[k:], flags)

    def _skip(self, n: int) -> None:
        while n:
            if self.lo == self.hi:
                self._fill()
            k = min(n, self.hi - self.lo)
            self.lo += k
            n -= k

    def _crlf(self, most: int = BUFFER_BYTES) -> None:
        while self.hi - self.lo < 2:
            self._fill(most)
        if self.buf[self.lo:self.lo + 2] != b"\r\n":
            raise ProtocolError("a bulk string not followed by CRLF")
        self.lo += 2
