"""Session leases: a client process that dies must not leak its sequences.

Every call may carry `x-kvstore-session: <id>` metadata (the client sends a
random id per KVStoreClient, and a Heartbeat every few seconds while idle).
A call renews the session's lease. When a lease lapses (no call for
`timeout_s`), a reaper thread frees the session's unpinned sequences through
the normal engine path (so pool invariants hold) and drops its buffers.
Sequences allocated with `persist` are offloaded to the disk tier instead
(freed if the daemon has none).
Sequences created without session metadata have no owner and never lapse.

Sessions are keyed by (tenant, session id): a tenant cannot keep another
tenant's session alive or expire it.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable

from kvstore.errors import InvalidArgument, KVStoreError, NotFound
from kvstore.protocol.channel import SESSION_KEY

log = logging.getLogger("kvstore.leases")
_SESSION_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
DEFAULT_TIMEOUT_S = 30.0


def session_of(context) -> str:
    """The caller's session id, "" if it sent none. Sent twice is refused, not one
    picked: which of two sessions a sequence lapses with is the caller's to say."""
    sent = [v for k, v in context.invocation_metadata() or () if k == SESSION_KEY]
    if len(sent) > 1:
        raise InvalidArgument(SESSION_KEY, f"sent {len(sent)} times: a call carries one session id")
    for v in sent:
        if not isinstance(v, str) or not _SESSION_RE.match(v):
            raise InvalidArgument(SESSION_KEY, f"session id must match {_SESSION_RE.pattern}")
        return v
    return ""


class LeaseManager:
    """engine: the Engine (set later if the daemon builds it after the server).
    release_buffers(tenant, session) -> number of buffers dropped."""

    def __init__(self, engine=None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 release_buffers: Callable[[str, str], int] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if not timeout_s > 0:
            raise ValueError(f"lease timeout must be > 0, got {timeout_s}")
        self.engine = engine
        self.timeout_s = timeout_s
        self.release_buffers = release_buffers
        self.clock = clock
        self._seen: dict[tuple[str, str], float] = {}
        # Calls in flight a session: live while one runs, however long (a call that
        # waits behind a cache's lock, or runs longer than timeout_s, is not silence).
        self._busy: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counters = dict(expired=0, freed_sequences=0, offload_requests=0, offload_failed=0, released_buffers=0)

    def touch(self, tenant: str, session: str) -> None:
        if session:
            with self._lock:
                self._seen[(tenant, session)] = self.clock()

    def enter(self, tenant: str, session: str) -> None:
        """A call of the session begins (touch(), and live until leave())."""
        if session:
            with self._lock:
                key = (tenant, session)
                self._seen[key] = self.clock()
                self._busy[key] = self._busy.get(key, 0) + 1

    def leave(self, tenant: str, session: str) -> None:
        """A call enter() began ends: the lease runs from now."""
        if session:
            with self._lock:
                key = (tenant, session)
                self._seen[key] = self.clock()
                n = self._busy.pop(key, 0) - 1
                if n > 0:
                    self._busy[key] = n

    def is_live(self, tenant: str, session: str) -> bool:
        """Whether the session's lease is current: it called within timeout_s, or has a
        call in flight (as the reaper reads it)."""
        with self._lock:
            key = (tenant, session)
            return key in self._seen and not self._lapsed_at(key, self.clock())

    def sessions(self) -> int:
        return len(self._seen)

    def stats(self) -> dict:
        return dict(sessions=self.sessions(), timeout_s=self.timeout_s, **self.counters)

    # ------------------------------------------------------------- reaping
    def reap(self) -> list[tuple[str, str]]:
        """Expire every lapsed session now; returns them."""
        if self.engine is None:
            return []
        with self._lock:     # the common case, nothing lapsed, without touching the caches' locks
            if not self._lapsed(self.clock()):
                return []
        # Holding every cache's lock, no call of the session is half done in any
        # cache: a call that renewed the lease after we looked keeps its
        # sequences, and one that arrives later runs after the frees.
        with self.engine.locked_caches():
            now = self.clock()
            with self._lock:
                lapsed = self._lapsed(now)
                for key in lapsed:
                    del self._seen[key]
            for tenant, session in lapsed:
                try:
                    self._expire(tenant, session)
                except Exception:  # noqa: BLE001 - the next lapsed session's sequences must still go
                    log.exception("lease of session %s (tenant %s) lapsed: freeing its sequences failed",
                                  session, tenant)
        for tenant, session in lapsed:
            if self.release_buffers is not None:
                self.counters["released_buffers"] += self.release_buffers(tenant, session)
        return lapsed

    def _lapsed(self, now: float) -> list[tuple[str, str]]:
        """Sessions silent past the timeout with no call in flight (self._lock held)."""
        return [key for key in self._seen if self._lapsed_at(key, now)]

    def _lapsed_at(self, key: tuple[str, str], now: float) -> bool:
        """The session (seen) was silent past the timeout with no call in flight (self._lock held)."""
        return now - self._seen[key] > self.timeout_s and key not in self._busy

    def _expire(self, tenant: str, session: str) -> None:
        owned = self.engine.owned_sequences(tenant, session)
        n = kept = cut = 0
        refused = self.counters["offload_failed"]
        for cache, seqs in owned.items():
            to_free = []
            for seq_id, persist in seqs:
                dropped = self._offload(cache, tenant, seq_id) if persist else None
                if dropped is None:
                    to_free.append(seq_id)
                else:
                    kept, cut = kept + 1, cut + dropped
            if not to_free:      # every one persisted: Free refuses an empty batch
                continue
            try:
                self.engine.free(cache, tenant, to_free)
                n += len(to_free)
            except NotFound:
                pass   # the cache went away under us; nothing of it is held
        release = getattr(self.engine, "release_mappings", None)
        mapped = release(tenant, session) if release is not None else 0
        self.counters["expired"] += 1
        self.counters["freed_sequences"] += n
        # An idle client's lapse is routine (DEBUG); one that freed or moved sequences, or cut a
        # step short, an operator may miss is INFO.
        refused = self.counters["offload_failed"] - refused     # persist ones that stay in memory (warned)
        log.log(logging.INFO if n or kept else logging.DEBUG, "lease of session %s (tenant %s) lapsed: freed %d "
                "sequences%s%s%s", session, tenant, n,
                (f", offloaded {kept - refused} persist sequence(s) to disk" if kept > refused else "")
                + (f", kept {refused} persist sequence(s) in memory" if refused else ""),
                f" (dropping {cut} token(s) of a step they were in)" if cut else "",
                f", released {mapped} pool mapping(s)" if mapped else "")

    def _offload(self, cache: str, tenant: str, seq_id: str) -> int | None:
        """The persistence hook: the tokens of a cut-off step it dropped if the sequence
        stays, for a later session to find: durable on the disk tier, or, where the disk
        tier refuses it (its byte bound), in memory, as a pinned sequence would (the
        daemon's stop offloads it, past the bound if it must); None: free it (an engine
        that cannot offload)."""
        self.counters["offload_requests"] += 1
        offload = getattr(self.engine, "offload", None)
        if offload is None:
            log.warning("sequence %s/%s asked to persist, but the engine cannot offload: freeing it", cache, seq_id)
            return None
        try:
            # A step the lapse cut off is dropped; the sequence refuses its other layers (write_path.py).
            return offload(cache, tenant, [seq_id], drop_uncommitted=True) or 0
        except KVStoreError as e:   # e.g. the disk bound: nobody is left to tell, and what persist asked is kept
            self.counters["offload_failed"] += 1
            log.warning("sequence %s/%s asked to persist, offload failed (%s): kept where it is (Free frees it)",
                        cache, seq_id, e)
            return 0

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - the reaper must outlive a bad free
                log.exception("lease reaper failed; retrying")

    def start(self) -> None:
        if self._thread is None:
            period = min(1.0, self.timeout_s / 4)
            self._thread = threading.Thread(target=self._run, args=(period,), name="kvstore-lease-reaper",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
