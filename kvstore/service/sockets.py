"""The daemon's Unix socket files (gRPC's and the doorbell's SOCKET.bell).

- Their directory is one that only we can write into: a missing one is made
  0700; one of ours that others can write is made 0700; one of another user's
  is refused (its owner could swap the socket for theirs). Shared sticky
  directories such as /tmp are used as they are: there nobody can remove or
  rename our socket, and the socket itself is 0600.
- A path is taken over only from a daemon that is gone: a socket nobody
  listens on is stale and removed; one that answers belongs to a live daemon,
  and we refuse to start rather than cut its clients off.
- At exit a daemon removes a socket only while it is still the one it bound
  (same inode): a later daemon may have taken the path over.
"""
from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
import stat

log = logging.getLogger("kvstore.sockets")
PROBE_TIMEOUT_S = 2.0


class SocketError(RuntimeError):
    """Why the daemon cannot serve on a socket path, in one line."""


def claim(path: str, kind: int = socket.SOCK_STREAM) -> None:
    """Make `path` free to bind a socket of `kind` (SOCK_STREAM for gRPC,
    SOCK_SEQPACKET for the doorbell): check its directory, remove a stale
    socket. SocketError if a live daemon serves there or the path is not
    ours to take."""
    _own_directory(os.path.dirname(os.path.abspath(path)))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketError(f"{path} exists and is not a socket; remove it or choose another --socket")
    if _answers(path, kind):
        raise SocketError(f"a daemon is already serving on {path}; stop it first or choose another --socket")
    os.unlink(path)         # a stale socket of a daemon that died
    log.info("removed the stale socket %s", path)


def staging_path(path: str) -> str:
    """A fresh hidden name beside path, no longer than its name (a socket
    path has at most 107 bytes), to bind before renaming into place."""
    d, base = os.path.split(os.path.abspath(path))
    return os.path.join(d, "." + secrets.token_hex(8)[:max(3, len(base) - 1)])


def identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at path, None if there is none."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def remove_if_ours(path: str, ident: tuple[int, int] | None) -> bool:
    """Unlink path if it is still the socket we bound (identity() then)."""
    if ident is None or identity(path) != ident:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _own_directory(d: str) -> None:
    if not os.path.exists(d):
        os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise SocketError(f"socket directory {d} is not a directory")
    me = os.getuid()
    if st.st_uid not in (me, 0):
        raise SocketError(f"socket directory {d} belongs to uid {st.st_uid}, not to this daemon's uid {me}: "
                          "its owner could replace the socket; choose a directory of yours (--socket)")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        if st.st_uid != me:
            raise SocketError(f"socket directory {d} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                              "choose a directory only you can write (--socket)")
        os.chmod(d, 0o700)
        log.warning("socket directory %s was mode %04o, writable by others: made it 0700", d,
                    stat.S_IMODE(st.st_mode))


def _answers(path: str, kind: int) -> bool:
    """Whether something listens on the socket at path."""
    s = socket.socket(socket.AF_UNIX, kind)
    s.settimeout(PROBE_TIMEOUT_S)
    try:
        s.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except TimeoutError:
        return True         # a full backlog: a daemon that is alive, if busy
    except OSError as e:
        if e.errno == errno.EPROTOTYPE:
            return True     # a listener of another socket type
        raise SocketError(f"cannot tell whether a daemon serves on {path}: {e.strerror}") from None
    finally:
        s.close()
