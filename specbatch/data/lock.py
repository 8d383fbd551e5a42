"""An exclusive lock on an output: `<output>.lock`, held with flock and naming its owner.

The kernel drops a flock when its process dies, so a lock file left by a killed run is stale by
construction and is simply taken over. Where flock is unavailable (some network filesystems),
the owner's host and pid decide: a lock of a dead pid on this host is stale.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from .rows import OutputError


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            info = json.loads(f.read() or "{}")
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(info: dict) -> str:
    if not info:
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"pid {info.get('pid')} on host {info.get('host')}, since {since}"


class OutputLock:
    """Held from acquire() to release(); a second holder is refused with one line naming the first."""

    def __init__(self, output: str):
        self.output = output
        self.path = output + ".lock"
        self._fd: int | None = None

    def acquire(self) -> "OutputLock":
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise OutputError(f"{self.path}: cannot create the output lock: {e.strerror} "
                                  f"({errno.errorcode.get(e.errno, e.errno)})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputError(f"{self.output} is in use by another specbatch run "
                                  f"({_describe(_owner(self.path))}); wait for it to finish or stop it") from None
            except OSError:       # no flock here: fall back on the owner's pid
                info = _owner(self.path)
                mine = info.get("host") == socket.gethostname()
                if info and (not mine or _alive(int(info.get("pid", 0)))) and info.get("pid") != os.getpid():
                    os.close(fd)
                    raise OutputError(f"{self.output} is in use by another specbatch run ({_describe(info)}); "
                                      f"wait for it to finish, or remove {self.path} if that run is gone") from None
            # The file may have been unlinked by its last holder between our open and flock.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
            os.ftruncate(fd, 0)
            os.pwrite(fd, body.encode(), 0)
            self._fd = fd
            return self
        raise OutputError(f"{self.path}: could not take the output lock (it keeps being replaced)")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)       # while still holding it: a waiter re-checks the inode
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None
