"""Calls over one long-lived bidirectional stream: request -> reply pairs in
order, with no per-call RPC setup on either side (AppendAttendStream).

    s = CallStream(channel, "/kvstore.v1.KVStore/AppendAttendStream", metadata=md)
    reply_bytes = s(request_bytes, timeout=60)     # one caller at a time
    s.close()

A status that ends the stream is raised like a unary call's error (a
grpc.RpcError with the same code and details), and the next call opens a new
stream. A daemon at its stream limit turns a new stream away before reading
the request (StreamRefused): the caller sends that request unary instead.
`timeout` bounds each call as a unary deadline would (DEADLINE_EXCEEDED;
the stream is cancelled and the next call opens another).

NOTE: the stream is driven from the calling thread alone, as grpc drives its
own blocking unary calls (a "segregated" call polling a completion queue of
its own). grpc's public API for bidirectional streams hands every request to
a consumer thread and every reply back from the channel's polling thread:
two thread switches a call, 215 µs against 138 µs for an echo on a 2-core
box (bench/bench_floor.py). That path uses grpc internals (grpc._channel,
cygrpc, as of grpcio 1.84): a grpcio without them falls back to the public
API, which works the same, only slower.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from kvstore.protocol.channel import STREAM_KEY

log = logging.getLogger("kvstore.client")

try:
    from grpc import _common as _grpc_common
    from grpc import _channel as _grpc_channel
    from grpc._cython import cygrpc as _cygrpc
    _CORE = all(hasattr(_cygrpc, n) for n in (
        "SendInitialMetadataOperation", "ReceiveInitialMetadataOperation", "ReceiveStatusOnClientOperation",
        "SendMessageOperation", "ReceiveMessageOperation", "SendCloseFromClientOperation", "PropagationConstants",
        "OperationType")) and hasattr(_grpc_common, "CYGRPC_STATUS_CODE_TO_STATUS_CODE")
except ImportError:      # pragma: no cover - another grpcio layout
    _CORE = False

# Tags of the batches on a core stream.
_T_MD, _T_RMD, _T_STATUS, _T_MSG, _T_CLOSE = range(5)


class StreamRefused(Exception):
    """The daemon turned the stream away before reading the request."""


class StreamError(grpc.RpcError, grpc.Call):
    """A stream's status, raised as a unary call's error would be (used when
    this grpcio has no _InactiveRpcError to raise)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing=()):
        super().__init__(f"<StreamError {code}: {details}>")
        self._code, self._details, self._trailing = code, details, tuple(trailing or ())

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing

    def initial_metadata(self):
        return ()

    def debug_error_string(self):
        return self._details

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False

    def __str__(self):
        return f"<StreamError of RPC that terminated with:\n\tstatus = {self._code}\n\tdetails = \"{self._details}\"\n>"


def rpc_error(code: grpc.StatusCode, details: str, trailing=()) -> grpc.RpcError:
    """The error a unary call with this status raises (grpc's own type)."""
    try:
        state = _grpc_channel._RPCState((), None, tuple(trailing or ()), code, details)
        return _grpc_channel._InactiveRpcError(state)
    except Exception:  # noqa: BLE001 - another grpcio: an equivalent of our own
        return StreamError(code, details, trailing)


class CallStream:
    """Request -> reply calls (serialized bytes) over one stream of `method`.
    One caller at a time: the caller serialises its calls (the client's lock).
    metadata: sent when a stream opens (session, token). core=False forces
    grpc's public API."""

    def __init__(self, channel: grpc.Channel, method: str, metadata=(), core: bool = True):
        self._channel = channel
        self._method = method
        self._md = tuple(metadata)
        self._core = core and _CORE and hasattr(getattr(channel, "_channel", None), "segregated_call")
        self._call = None            # the open stream (a cygrpc SegregatedCall, or a grpc rendezvous)
        self._due: set[int] = set()  # core: batches not completed yet
        self._status = None          # core: the stream's ReceiveStatusOnClient operation, once done
        self._q: queue.SimpleQueue | None = None
        self.opened = 0              # streams opened so far
        # Deadlines: a watchdog thread cancels a call past its timeout.
        self._wlock = threading.Lock()
        self._deadline = 0.0         # monotonic; 0: no call in progress
        self._expired = False
        self._watch: threading.Thread | None = None
        self._watch_stop = threading.Event()
        self._period = 1.0
        self._armed = 0.0            # the timeout _period was set for

    # ------------------------------------------------------------ calls
    def takes(self, metadata) -> bool:
        """Whether a call with this metadata can go on the stream: none is open (it opens
        with the call's), or the open one was opened with the same."""
        return self._call is None or metadata is None or tuple(metadata) == self._md

    def __call__(self, data: bytes, timeout: float | None = None, metadata=None) -> bytes:
        """metadata: what a stream opened for this call opens with (default: the
        constructor's, or the last call's); see takes()."""
        if timeout is not None:
            self._arm(timeout)
        try:
            if self._call is not None and self._expired:   # the watchdog cancelled it as its call came back
                if self._core:
                    while self._due:
                        self._next_core()
                self._call = None
            if self._call is None:
                if metadata is not None:
                    self._md = tuple(metadata)
                self._open()
            return self._call_core(data) if self._core else self._call_public(data)
        finally:
            if timeout is not None:
                with self._wlock:
                    self._deadline = 0.0

    def close(self, timeout: float = 5.0) -> None:
        """End the open stream (half-close, then its status), stop the watchdog."""
        try:
            if self._call is not None:
                self._arm(timeout)
                try:
                    self._close_core() if self._core else self._close_public()
                except grpc.RpcError:
                    pass
                finally:
                    with self._wlock:
                        self._deadline = 0.0
        finally:
            self._call = None
            if self._watch is not None:
                self._watch_stop.set()
                self._watch = None

    # -------------------------------------------------------------- core
    def _open(self) -> None:
        self._expired = False
        if self._core:
            try:
                self._open_core()
            except (TypeError, AttributeError) as e:     # grpc internals of another shape
                log.warning("grpc internals differ (%s): streams go through grpc's public API", e)
                self._core = False
        if not self._core:
            self._q = queue.SimpleQueue()
            self._call = self._channel.stream_stream(self._method)(iter(self._q.get, None), metadata=self._md)
        self.opened += 1

    def _open_core(self) -> None:
        c = _cygrpc
        ops = (((c.SendInitialMetadataOperation(self._md, 0),), _T_MD),
               ((c.ReceiveInitialMetadataOperation(0),), _T_RMD),
               ((c.ReceiveStatusOnClientOperation(0),), _T_STATUS))
        self._status = None
        self._call = self._channel._channel.segregated_call(
            c.PropagationConstants.GRPC_PROPAGATE_DEFAULTS, self._method.encode(), None, None, self._md, None, ops,
            None, None)
        self._due = {_T_MD, _T_RMD, _T_STATUS}

    def _call_core(self, data: bytes) -> bytes:
        c = _cygrpc
        if self._call.operate((c.SendMessageOperation(data, 0), c.ReceiveMessageOperation(0)), _T_MSG):
            self._due.add(_T_MSG)
        reply = None
        while _T_MSG in self._due:
            reply = self._next_core() or reply
        if reply is None:           # the stream ended: its status says why
            while self._due:
                self._next_core()
            raise self._ended(*self._core_status())
        return reply

    def _next_core(self) -> bytes | None:
        try:
            ev = self._call.next_event()
        except BaseException:      # a signal handler raised while polling: grpc has released the call
            self._call, self._due = None, set()
            raise
        self._due.discard(ev.tag)
        if ev.tag == _T_MSG:
            for op in ev.batch_operations:
                if op.type() == _cygrpc.OperationType.receive_message:
                    return op.message()
        elif ev.tag == _T_STATUS:
            self._status = ev.batch_operations[0]
        return None

    def _core_status(self) -> tuple[grpc.StatusCode, str, tuple]:
        op = self._status
        if op is None:
            return grpc.StatusCode.UNKNOWN, "the stream ended without a status", ()
        code = _grpc_common.CYGRPC_STATUS_CODE_TO_STATUS_CODE.get(op.code(), grpc.StatusCode.UNKNOWN)
        details = op.details()
        return code, details.decode() if isinstance(details, bytes) else details, tuple(op.trailing_metadata() or ())

    def _close_core(self) -> None:
        if self._due and self._call.operate((_cygrpc.SendCloseFromClientOperation(0),), _T_CLOSE):
            self._due.add(_T_CLOSE)
        while self._due:
            self._next_core()

    @staticmethod
    def _cancel_core(call) -> None:
        call.cancel(_grpc_common.STATUS_CODE_TO_CYGRPC_STATUS_CODE[grpc.StatusCode.DEADLINE_EXCEEDED],
                    "Deadline Exceeded")

    # ------------------------------------------------------------ public
    def _call_public(self, data: bytes) -> bytes:
        self._q.put(data)
        try:
            return next(self._call)
        except StopIteration:       # the daemon ended the stream without an error: not ours to leave open
            raise self._ended(grpc.StatusCode.INTERNAL, "the stream ended without a reply", ()) from None
        except grpc.RpcError as e:
            raise self._ended(e.code(), e.details() or "", tuple(e.trailing_metadata() or ())) from None
        except BaseException:      # e.g. KeyboardInterrupt: its reply may still come, so not on this stream
            call, self._call = self._call, None
            call.cancel()
            raise

    def _close_public(self) -> None:
        self._q.put(None)
        self._call.code()           # waits for the status

    @staticmethod
    def _cancel_public(call) -> None:
        call.cancel()

    # ------------------------------------------------------------ errors
    def _ended(self, code: grpc.StatusCode, details: str, trailing: tuple) -> Exception:
        """The stream is over: forget it, and say why as a unary call would."""
        self._call = None
        if (STREAM_KEY, "refused") in trailing:
            return StreamRefused(details)
        if self._expired:
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        return rpc_error(code, details, trailing)

    def _arm(self, timeout: float) -> None:
        with self._wlock:
            self._deadline = time.monotonic() + timeout
        if timeout != self._armed:      # the watchdog looks every tenth of the timeout (at most 1 s)
            self._armed, self._period = timeout, min(1.0, max(0.005, timeout / 10))
        if self._watch is None:
            self._watch_stop = threading.Event()
            self._watch = threading.Thread(target=self._watchdog, args=(self._watch_stop,),
                                           name="kvstore-stream-deadline", daemon=True)
            self._watch.start()

    def _watchdog(self, stop: threading.Event) -> None:
        while not stop.wait(self._period):
            with self._wlock:
                call = self._call
                if self._deadline and time.monotonic() > self._deadline and call is not None:
                    self._expired = True
                    self._deadline = 0.0
                    self._cancel_core(call) if self._core else self._cancel_public(call)
