"""What the LMDB store does at open when its last shutdown was not clean, or
when LMDB cannot read it (docs/operations.md, Crashes and the disk tier).

The store writes through LMDB's writable map with neither sync nor metasync
(lmdb_store.py): a non-durable commit is in the page cache only, and the
kernel writes its pages back in any order, the meta page included. LMDB's
own documentation says what follows: a *system* crash (power loss, a kernel
panic) can leave a meta page on disk that points at pages still holding
older bytes, or at pages a later transaction reused, so the database can be
corrupt, not merely missing its newest commits. A process that dies (a
SIGKILL, an OOM kill) loses nothing the kernel holds: the page cache keeps
every commit, and LMDB reopens at the last one.

So before its first non-durable commit after a sync the store writes a
marker file holding the kernel's boot id (written and fsynced before that
commit can reach the disk), and removes it once a sync has put everything
on disk (a durable batch, a clean close). At open:
- no marker: every commit reached the disk (or the store is new);
- a marker of this boot: the process died, the kernel did not; the page
  cache holds the last commit: it is synced and the marker goes;
- a marker of another boot (or no boot id to compare): the file is not
  trusted. Every value is read and checked against its checksum, and those
  that pass go into a fresh file that replaces it; any that fail (or that a
  broken tree hides) are dropped, counted and logged, and the old file is
  kept beside the store, renamed, for whoever wants to look at it.
A file LMDB refuses to open (its meta pages garbled, not an LMDB file) is
renamed aside the same way and the store starts empty, logged as an error.
An old file is replaced without a copy kept only when every entry it held
passed into the fresh one.
"""
from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("kvstore.lmdb")

MARKER = "unclean"                # in the store's directory: non-durable commits may be in flight
SALVAGE = "salvage.mdb"           # the verified copy being written, in the store's directory
COPY_BATCH = 256 << 20            # bytes per write transaction of the verified copy
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """The kernel's boot id ('' where there is none: every marker then counts
    as a system crash)."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def marker(path: str) -> str | None:
    """The boot id a marker in the store's directory holds, None if there is none."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def mark(path: str, why: str | None = None) -> None:
    """Record that non-durable commits may be in flight: on disk (file and
    directory entry) before this returns. why: in place of the boot id, so that
    the next open verifies the file whatever the boot (LMDB found it damaged)."""
    tmp = os.path.join(path, MARKER + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (why or boot_id()).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, os.path.join(path, MARKER))
    _fsync_dir(path)


def clear(path: str) -> None:
    """Everything is on disk: remove the marker. Not made durable itself: a
    removal the disk loses costs one needless verification, nothing else."""
    try:
        os.unlink(os.path.join(path, MARKER))
    except FileNotFoundError:
        pass


def damaged(path: str, e: Exception) -> None:
    """LMDB met a damaged page while the store ran: logged, and a marker no boot
    writes, so that the next open verifies the file whatever the boot."""
    log.error("LMDB store %s: LMDB found the file damaged (%s: %s): reads it cannot make are refused and counted "
              "(refused_values), writes that meet a damaged page fail; it is verified when the daemon restarts",
              path, type(e).__name__, e)
    mark(path, "damaged")


def truncated(path: str) -> str | None:
    """Why the store's data file cannot hold the pages its meta page names (cut short:
    a copy or restore that stopped, a filesystem that lost its end), or None. Read
    before the store opens it: the open allocates the file up to its map with zeros,
    which LMDB then reads as damaged pages, found only when a call meets one."""
    import lmdb
    try:
        size = os.path.getsize(os.path.join(path, "data.mdb"))
        env = lmdb.open(path, readonly=True, lock=False, max_dbs=2)
    except (OSError, lmdb.Error):
        return None             # no file yet, or one LMDB refuses: the open's to handle
    try:
        need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    finally:
        env.close()
    return f"its file holds {size} bytes of the {need} its pages take (cut short)" if size < need else None


def data_size(path: str) -> int | None:
    """The store's data file's size, None if there is none."""
    try:
        return os.path.getsize(os.path.join(path, "data.mdb"))
    except FileNotFoundError:
        return None


def move_aside(path: str, why: str, size: int | None = None) -> str:
    """Rename the store's data file to data.mdb.<why>-<UTC time> beside it
    (never deleted); the lock file goes (it holds no data). size: what the file
    held before an open that failed extended it (to LMDB's map, with zeros):
    cut back to it. Returns the new name."""
    aside = os.path.join(path, f"data.mdb.{why}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    os.rename(os.path.join(path, "data.mdb"), aside)
    if size is not None and os.path.getsize(aside) > size:
        os.truncate(aside, size)
    try:
        os.unlink(os.path.join(path, "lock.mdb"))
    except FileNotFoundError:
        pass
    _fsync_dir(path)
    return aside


def copy_verified(env, sums_db, sums_name: bytes, path: str, map_size: int,
                  verify) -> tuple[int, list[bytes], str | None, int]:
    """Every entry of env's main database that verify(key, value, stored
    checksum) passes, with its checksum record (sums_db, a database named
    sums_name in the main one), into a fresh file SALVAGE in path,
    synced. Returns (entries kept, keys dropped, why the walk stopped early
    or None, entries of the main database neither kept nor named). The walk
    goes over the checksum records' keys (small values, in the tree's own
    pages: a value's damaged pages cannot end it); an LMDB error in that tree
    ends it, and what lies behind is dropped (its keys cannot be read), as is
    a value with no checksum record."""
    import lmdb
    dst_path = os.path.join(path, SALVAGE)
    for p in (dst_path, dst_path + "-lock"):
        if os.path.exists(p):
            os.unlink(p)              # a verification cut short by a crash starts over
    dst = lmdb.open(dst_path, map_size=map_size, subdir=False, sync=False, metasync=False, max_dbs=2, lock=True)
    dst_sums = dst.open_db(sums_name)
    kept, dropped, stopped, behind = 0, [], None, 0
    try:
        with env.begin(buffers=True) as txn:
            cur = txn.cursor(db=sums_db)
            # Values are read in a transaction of their own: LMDB ends the one that meets a
            # damaged page, and the walk over the keys goes on past it.
            look = env.begin(buffers=True)
            out, nbytes = dst.begin(write=True), 0
            try:
                for k, s in cur:
                    k, s = bytes(k), bytes(s)
                    if k.startswith(b"\0"):      # the checksum format's record (lmdb_sums.FORMAT_KEY)
                        continue
                    try:
                        v = look.get(k)
                    except lmdb.Error:
                        look.abort()
                        look, v = env.begin(buffers=True), None
                    if v is None or not verify(k, v, s):
                        dropped.append(k)
                        continue
                    out.put(k, v)
                    out.put(k, s, db=dst_sums)
                    kept += 1
                    nbytes += len(v)
                    if nbytes >= COPY_BATCH:
                        out.commit()
                        out, nbytes = dst.begin(write=True), 0
            except lmdb.Error as e:
                stopped = f"{type(e).__name__}: {e}"
            look.abort()
            out.commit()
            behind = max(env.stat()["entries"] - 1 - kept - len(dropped), 0)    # less the sums database's record
            if behind:
                stopped = (f"{stopped}; " if stopped else "") + f"{behind} entries with no readable checksum dropped"
        dst.sync(True)
    finally:
        dst.close()
    os.unlink(dst_path + "-lock")
    return kept, dropped, stopped, behind


def refused_at_open(path: str, e: Exception, size: int | None) -> None:
    """LMDB cannot open the store's file: it goes aside (move_aside), untouched, logged,
    and so does the marker: the fresh file holds no commit of the old one's."""
    aside = move_aside(path, "corrupt", size)
    clear(path)
    log.error("LMDB store %s: LMDB cannot open it (%s); the file was moved to %s, untouched, and the store "
              "starts empty: everything it held is unavailable", path, e, aside)


def install_copy(path: str, kept: int, dropped: list[bytes], stopped: str | None, why: str | None = None) -> None:
    """The verified copy replaces the data file (one rename: a crash leaves
    one or the other, and the marker, so the next open verifies again). The
    old file stays beside the store when anything was dropped."""
    why = why or "not closed cleanly before the system restarted"
    data = os.path.join(path, "data.mdb")
    aside = None
    if dropped or stopped:
        aside = move_aside(path, "unclean")
    os.replace(os.path.join(path, SALVAGE), data)
    _fsync_dir(path)
    if aside is None:
        log.warning("LMDB store %s: %s; all %d entries passed their checksums and were copied into a fresh "
                    "file", path, why, kept)
    else:
        shown = ", ".join(k[:48].hex() for k in dropped[:8]) + (" ..." if len(dropped) > 8 else "")
        log.warning("LMDB store %s: %s; %d entries passed their checksums and were kept, %d failed and were "
                    "dropped (keys, hex: %s)%s; the old file is %s", path, why, kept, len(dropped), shown or "none",
                    f"; the walk stopped early ({stopped})" if stopped else "", aside)
