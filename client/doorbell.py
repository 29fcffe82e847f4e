"""The client end of the daemon's doorbell (kvstore/service/doorbell.py): AppendAttend
as one packet each way on a SOCK_SEQPACKET socket, for inputs and output in
a registered buffer.

    bell = Doorbell(path, token, timeout=60)      # from RegisterBufferReply
    dtype = bell.append_attend(buffer_id, cache, layer, seq_ids, dtype, offsets, shapes, scale)
    bell.close()

Errors are those of the unary call (grpc.RpcError with its code and
details). BellDown: the connection is gone before the request left, so the
daemon did nothing; Unfit: this doorbell cannot carry the request. Either way
the caller sends it over gRPC instead. One caller at a
time (the client's lock).
"""
from __future__ import annotations

import socket
import struct

import grpc

from kvstore.protocol import bell

from .stream import rpc_error

_STATUS = {c.value[0]: c for c in grpc.StatusCode}


class BellDown(Exception):
    """The doorbell could not take the request; nothing reached the daemon."""


class Unfit(BellDown):
    """A request this doorbell cannot carry (too large, ids outside int64, op 2 to a
    daemon that serves op 1 only); the daemon did nothing and the connection stays."""


class Doorbell:
    def __init__(self, path: str, token: bytes, timeout: float):
        self.timeout = timeout
        self.last_handler_us = 0       # the daemon's time in the last call, for breakdowns
        self.takes_tokens = True       # op 2 (query_tokens, token ids); False once the daemon refused it
        self._call = 0
        self._packets: dict[tuple, tuple[bytes, int]] = {}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(path)
            self._sock.sendall(bell.HELLO.pack(bell.HELLO_MAGIC, token))
            code, _, _, message = self._reply(self._sock.recv(bell.MAX_PACKET), 0)
        except OSError as e:
            self._sock.close()
            raise BellDown(f"doorbell {path}: {e}") from None
        if code:
            self._sock.close()
            raise BellDown(f"doorbell {path} refused the connection: {message}")

    def append_attend(self, buffer_id: str, cache: str, layer: int, seq_ids, dtype: int,
                      offsets: tuple[int, int, int, int], shapes: tuple, scale: float,
                      query_tokens: int = 1, token_ids=()) -> int:
        """offsets: of k, v, q, out in the buffer; shapes: the 9 dims of k, v, q;
        query_tokens and token_ids as in KVStoreClient.append_attend.
        -> the output's dtype (pb.DType)."""
        if not 1 <= query_tokens <= 0xFFFF:
            raise Unfit("query_tokens outside a descriptor's range")
        op2 = bell.is_op2(query_tokens, token_ids)
        if op2 and not self.takes_tokens:
            raise Unfit("the daemon's doorbell serves op 1 only")
        key = (buffer_id, cache, layer, tuple(seq_ids), dtype, offsets, shapes, scale, op2)
        body = self._packets.get(key)
        if body is None:
            if len(self._packets) >= 1024:
                self._packets.clear()
            ids = [s.encode() for s in seq_ids]
            if len(ids) > 0xFFFF or any(len(i) > 0xFFFF for i in ids):
                raise Unfit("sequence ids too long for a descriptor")
            op = bell.OP_APPEND_ATTEND_TOKENS if op2 else bell.OP_APPEND_ATTEND
            body = self._packets[key] = bell.pack_head(0, op, dtype, layer, scale, offsets, shapes,
                                                       buffer_id.encode(), cache.encode(), ids)[4:]
        if op2:
            try:
                body += bell.pack_tokens(query_tokens, token_ids)
            except struct.error as e:      # ids outside int64: the gRPC call names them
                raise Unfit(f"token ids: {e}") from None
        if len(body) + 4 > bell.MAX_PACKET:
            raise Unfit("descriptor larger than a doorbell packet")
        self._call = call = (self._call + 1) & 0xFFFFFFFF
        try:
            self._sock.sendall(call.to_bytes(4, "little") + body)
        except OSError as e:
            raise BellDown(str(e)) from None
        except BaseException:
            self.close()        # interrupted (a signal handler raised): a reply may still come
            raise
        try:
            data = self._sock.recv(bell.MAX_PACKET)
        except socket.timeout:
            self.close()        # its reply may still come: not on this connection
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except OSError as e:
            self.close()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"doorbell: {e} during the call") from None
        except BaseException:
            # interrupted (KeyboardInterrupt, an alarm's handler): the call may run, and its
            # reply would be read by the next call on this connection as that call's
            self.close()
            raise
        if not data:
            self.close()        # the daemon went away after taking the request: it may have run
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "doorbell: the daemon closed the connection during the call")
        try:
            code, dtype, self.last_handler_us, message = self._reply(data, call)
        except grpc.RpcError:
            self.close()        # replies out of step: none read on this connection is trusted again
            raise
        if op2 and code == grpc.StatusCode.UNIMPLEMENTED.value[0] and message.startswith("op:"):
            # a daemon whose doorbell predates op 2 refuses it by name, having done nothing
            self.takes_tokens = False
            raise Unfit("the daemon's doorbell serves op 1 only")
        if code:
            raise rpc_error(_STATUS.get(code, grpc.StatusCode.UNKNOWN), message)
        return dtype

    @staticmethod
    def _reply(data: bytes, call: int) -> tuple[int, int, int, str]:
        if len(data) < bell.REPLY.size:
            raise rpc_error(grpc.StatusCode.INTERNAL, f"doorbell: a {len(data)}-byte reply")
        got, code, dtype, us, n = bell.REPLY.unpack_from(data)
        if got != call and call:
            raise rpc_error(grpc.StatusCode.INTERNAL, f"doorbell: reply to call {got}, expected {call}")
        # An OK call's reply has no message: no slice or decode on the per-step path.
        msg = bytes(data[bell.REPLY.size:bell.REPLY.size + n]).decode("utf-8", "replace") if n else ""
        return code, dtype, us, msg

    @property
    def closed(self) -> bool:
        return self._sock.fileno() < 0

    def close(self) -> None:
        self._sock.close()
