"""placeholder"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def spawn_daemon(socket: str | None = None):
    """Start `server.py` on a Unix socket (a temp one by default) -> its target."""
    from .demo import wait_serving
    tmp = None
    if socket is None:
        tmp = tempfile.mkdtemp(prefix="kvstore-")
        socket = os.path.join(tmp, "kv.sock")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "server.py"), "--socket", socket, "--device", "cpu",
                             "--log-level", "WARNING"], stdout=subprocess.DEVNULL)
    target = f"unix://{socket}"
    try:
        wait_serving(target, proc)
        yield target
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
