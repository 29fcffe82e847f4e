"""Buffers clients register once and name per call: shared memory or CUDA
IPC allocations (with their interprocess events), and each tenant's view of
them (a caller sees only its tenant's buffers; a session's go with its lease)."""
from __future__ import annotations

import errno
import math
import mmap
import os
import secrets
import threading

import torch

from kvstore.core.names import check_name
from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, quote

MAX_VIEWS = 4096          # cached typed views of registered buffers (see BufferRegistry.view)
# Descriptors RegisterBuffer leaves to the daemon's own work: connections, imports, its
# files. Each registered shared-memory buffer keeps one open; without this margin one
# caller registering buffers until none is left would make every tenant's next call that
# opens a file fail (INTERNAL) and new connections hang.
FD_RESERVE = 256


class BufferRegistry:
    """Shared-memory buffers a client registered once and names per call.

    NOTE: typed views of a buffer's bytes are cached by (buffer_id, offset,
    shape, dtype), since a client names the same ranges call after call.
    Unregistering a buffer drops its views under the lock, and a view is
    cached only while its buffer is registered, so a released buffer never
    serves a stale view (ids are random per registration, never reused)."""

    def __init__(self, shm_dir: str = "/dev/shm"):
        self.shm_dir = shm_dir
        self._bufs: dict[str, tuple[mmap.mmap, torch.Tensor, str]] = {}
        self._views: dict[tuple, torch.Tensor] = {}
        self._files: dict[str, tuple[int, int, str]] = {}     # shm buffers: (descriptor, registered size, name)
        self.cuda_buffers = 0        # how many are CUDA buffers (none: calls skip the CUDA scope)
        self.generation = 0          # +1 per unregister: views and scopes resolved before it may be stale
        self._lock = threading.Lock()

    def register_shm(self, name: str, size: int, owner: str = "") -> str:
        check_name("name", name)     # a file name under shm_dir: no '/', ASCII
        if size <= 0:
            raise InvalidArgument("size", "must be > 0")
        path = os.path.join(self.shm_dir, name)
        _check_descriptors(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise NotFound("name", f"no shared memory named {quote(name)}") from None
        except PermissionError:
            raise InvalidArgument("name", f"shared memory {quote(name)} is not readable and writable by the daemon") from None
        except OSError as e:   # ".", "..": a directory, not a shared-memory object
            if e.errno in (errno.EMFILE, errno.ENFILE):     # each registered buffer keeps its descriptor
                raise ResourceExhausted("name", f"cannot open shared memory {quote(name)}: {e.strerror} "
                                                "(unregister buffers no longer used)") from None
            raise InvalidArgument("name", f"cannot open shared memory {quote(name)}: {e.strerror}") from None
        try:
            have = os.fstat(fd).st_size
            if have < size:
                raise InvalidArgument("size", f"{size} bytes asked, shared memory {quote(name)} has {have}")
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        view = torch.frombuffer(mm, dtype=torch.uint8)
        buffer_id = "shm-" + secrets.token_hex(8)
        with self._lock:
            self._bufs[buffer_id] = (mm, view, owner)
            self._files[buffer_id] = (fd, size, name)
        return buffer_id

    def check_size(self, buffer_id: str) -> None:
        """FailedPrecondition if a shared-memory buffer's file shrank below its
        registered size: a read or write of the pages past its end would fault
        (SIGBUS) and stop the daemon. Checked at every use; a shrink that races
        with a call between this check and the access still faults."""
        with self._lock:        # unregister closes the descriptor under it: never a reused number
            f = self._files.get(buffer_id)
            if f is None:
                return
            have = os.fstat(f[0]).st_size
        if have < f[1]:
            raise FailedPrecondition("buffer_id", f"shared memory {quote(f[2])} has {have} bytes, fewer than the "
                                                  f"{f[1]} it was registered with: register it again")

    def register_cuda(self, handle: bytes, offset: int, size: int, device_uuid: str,
                      ready_event: bytes, done_event: bytes, owner: str = "") -> str:
        """Open a client's CUDA staging buffer (once) and its event pair."""
        from kvstore.cuda import ipc as cuda_ipc
        if size <= 0:
            raise InvalidArgument("size", "must be > 0")
        if not torch.cuda.is_available():
            raise FailedPrecondition("kind", "CUDA_IPC: the daemon has no CUDA device; register SHM buffers instead")
        dev = cuda_ipc.device_by_uuid(device_uuid)
        alloc = cuda_ipc.ImportedAllocation(handle, offset + size, dev)
        view = alloc.bytes[offset:offset + size]
        events = None
        if ready_event or done_event:
            try:
                events = (cuda_ipc.open_event(dev, ready_event), cuda_ipc.open_event(dev, done_event))
            except Exception as e:  # a malformed handle: refuse, and let go of the memory
                alloc.close()
                raise InvalidArgument("ready_event", f"cannot open the interprocess events: {e}") from None
        buffer_id = "cuda-" + secrets.token_hex(8)
        with self._lock:
            self._bufs[buffer_id] = ((alloc, events), view, owner)
            self.cuda_buffers += 1
        return buffer_id

    def cuda_events(self, buffer_id: str):
        """(ready, done) events of a CUDA buffer, or None."""
        entry = self._bufs.get(buffer_id)
        if entry is None or not buffer_id.startswith("cuda-"):
            return None
        return entry[0][1]

    def unregister(self, buffer_id: str) -> None:
        with self._lock:
            entry = self._bufs.pop(buffer_id, None)
            f = self._files.pop(buffer_id, None)
            if f is not None:
                os.close(f[0])          # the mapping stays valid without it
            if entry is not None:
                self.generation += 1
                self.cuda_buffers -= buffer_id.startswith("cuda-")
                for key in [k for k in self._views if k[0] == buffer_id]:
                    del self._views[key]
        if entry is None:
            raise NotFound("buffer_id", f"no buffer {quote(buffer_id)}")
        # The mmap closes when the last tensor view of it is gone.

    def get(self, buffer_id: str) -> torch.Tensor:
        entry = self._bufs.get(buffer_id)
        if entry is None:
            raise NotFound("buffer_id", f"no buffer {quote(buffer_id)}")
        return entry[1]         # its size is read, not its pages: view() checks the file

    def view(self, buffer_id: str, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of a buffer as a tensor of shape and
        dtype; the caller has checked the range and alignment."""
        key = (buffer_id, offset, shape, dtype)
        v = self._views.get(key)
        if v is not None:
            self.check_size(buffer_id)
            return v
        v = self.get(buffer_id)[offset:offset + _nbytes(shape, dtype)].view(dtype).view(shape)
        self.check_size(buffer_id)
        with self._lock:
            if buffer_id in self._bufs:       # not unregistered meanwhile
                if len(self._views) >= MAX_VIEWS:
                    self._views.clear()
                self._views[key] = v
        return v

    def __len__(self) -> int:
        return len(self._bufs)


def _nbytes(shape, dtype: torch.dtype) -> int:
    return dtype.itemsize * math.prod(shape)


class TenantBuffers:
    """Which tenant and session registered each buffer. A caller sees only
    its tenant's buffers (others are NOT_FOUND, as if absent), and a session's
    buffers are dropped when its lease lapses."""

    def __init__(self, registry):
        self.registry = registry
        self._owners: dict[str, tuple[str, str]] = {}
        self._lock = threading.Lock()

    def view(self, tenant: str, session: str) -> "_BufferView":
        return _BufferView(self, tenant, session)

    def release_session(self, tenant: str, session: str) -> int:
        with self._lock:
            ids = [b for b, o in self._owners.items() if o == (tenant, session)]
            for b in ids:
                del self._owners[b]
        for b in ids:
            try:
                self.registry.unregister(b)
            except NotFound:
                pass
        return len(ids)

    def __len__(self) -> int:
        return len(self._owners)


def _check_descriptors(name: str) -> None:
    """ResourceExhausted naming name where registering one more buffer would leave the
    daemon fewer than FD_RESERVE descriptors."""
    import resource
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY:
        return
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:          # no /proc: the open's own EMFILE answers
        return
    if used + 1 + FD_RESERVE > limit:
        raise ResourceExhausted("name", f"cannot register shared memory {quote(name)}: {used} of the daemon's "
                                        f"{limit} file descriptors are open and {FD_RESERVE} stay for its own "
                                        "work (each registered buffer keeps one: unregister buffers no longer used)")


class _BufferView:
    """Duck-types the BufferRegistry methods protocol/wire.py and the servicer call."""

    def __init__(self, table: TenantBuffers, tenant: str, session: str):
        self.t, self.tenant, self.session = table, tenant, session

    def _check(self, buffer_id: str) -> None:
        owner = self.t._owners.get(buffer_id)
        if owner is None or owner[0] != self.tenant:
            raise NotFound("buffer_id", f"no buffer {quote(buffer_id)}")

    def _own(self, buffer_id: str) -> str:
        with self.t._lock:
            self.t._owners[buffer_id] = (self.tenant, self.session)
        return buffer_id

    def register_shm(self, name: str, size: int) -> str:
        return self._own(self.t.registry.register_shm(name, size, owner=self.tenant))

    def register_cuda(self, *args, **kw) -> str:
        return self._own(self.t.registry.register_cuda(*args, owner=self.tenant, **kw))

    def get(self, buffer_id: str):
        self._check(buffer_id)
        return self.t.registry.get(buffer_id)

    def view(self, buffer_id: str, offset: int, shape: tuple, dtype):
        self._check(buffer_id)
        return self.t.registry.view(buffer_id, offset, shape, dtype)

    def check_size(self, buffer_id: str) -> None:
        self._check(buffer_id)
        self.t.registry.check_size(buffer_id)

    def cuda_events(self, buffer_id: str):
        if self.t._owners.get(buffer_id, ("",))[0] != self.tenant:
            return None     # not ours: the lookup that follows answers NOT_FOUND
        return self.t.registry.cuda_events(buffer_id)

    def unregister(self, buffer_id: str) -> None:
        self._check(buffer_id)
        with self.t._lock:
            self.t._owners.pop(buffer_id, None)
        self.t.registry.unregister(buffer_id)
