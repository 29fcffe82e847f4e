"""The calls whose handlers are running, as the daemon's stop needs them.

gRPC's stop reports the server stopped once it has cancelled the calls
still open at the grace period's end, whether or not their handler threads
have returned: a handler inside faiss or a blocking wait ignores the
cancellation. Those threads belong to a ThreadPoolExecutor, which interpreter
exit joins, so the daemon asks this table rather than gRPC whether it can
exit normally (daemon.main)."""
from __future__ import annotations

import itertools
import time

import grpc

POLL_S = 0.05


class CallsInFlight(grpc.ServerInterceptor):
    """Every handler call, from its start to its return (a streaming reply's:
    to the end of its replies), by method name and start time."""

    def __init__(self):
        # dict and count operations are atomic under the GIL: no lock on the call path
        self._calls: dict[int, tuple[str, float]] = {}
        self._ids = itertools.count()
        self._wrapped: dict[str, tuple] = {}     # method -> (handler, wrapped handler)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        hit = self._wrapped.get(handler_call_details.method)
        if hit is not None and hit[0] is handler:   # handlers are fixed per method: wrap once
            return hit[1]
        wrapped = self._wrap(handler, handler_call_details.method.rsplit("/", 1)[-1])
        if len(self._wrapped) < 1024:               # unknown paths get no handler, so this stays small
            self._wrapped[handler_call_details.method] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler, method: str):
        calls, ids = self._calls, self._ids

        def unary(fn):
            def call(request, context):
                key = next(ids)
                calls[key] = (method, time.monotonic())
                try:
                    return fn(request, context)
                finally:
                    del calls[key]
            return call

        def streaming(fn):
            def call(request, context):
                key = next(ids)
                calls[key] = (method, time.monotonic())
                try:
                    yield from fn(request, context)
                finally:
                    del calls[key]
            return call

        return handler._replace(**{kind: (streaming if kind.endswith("_stream") else unary)(fn)
                                   for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
                                   if (fn := getattr(handler, kind)) is not None})

    def running(self) -> list[tuple[str, float]]:
        """-> (method, seconds it has run) of every call still running, the oldest first."""
        now = time.monotonic()
        return sorted(((m, now - t0) for m, t0 in self._calls.copy().values()), key=lambda c: -c[1])

    def wait(self, deadline: float) -> list[tuple[str, float]]:
        """Wait until no call runs or time.monotonic() reaches deadline -> running()."""
        while self._calls and time.monotonic() < deadline:
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        return self.running()


def describe(calls: list[tuple[str, float]]) -> str:
    """[("TrainCodebooks", 19.2)] -> 'TrainCodebooks (19 s)'."""
    return ", ".join(f"{m} ({s:.0f} s)" for m, s in calls)
