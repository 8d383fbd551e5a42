"""Durable file operations of the output: atomic writes (temp, fsync, rename), one-line
filesystem errors, and content hashes (a finished JSONL output is recognised by its hash)."""
from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from typing import BinaryIO

from .rows import OutputError


def fs_error(path: str, e: OSError) -> OutputError:
    """One line naming the path and the errno."""
    name = errno.errorcode.get(e.errno or 0, str(e.errno))
    return OutputError(f"{path}: {e.strerror or e} ({name})")


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(final: str, write: Callable[[BinaryIO], None]) -> None:
    """Call write(file) on `<final>.tmp`, fsync, then rename over `final`."""
    tmp = final + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as e:
        try:
            if os.path.lexists(tmp):
                os.remove(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise fs_error(final, e) from None
        raise
    fsync_dir(os.path.dirname(os.path.abspath(final)))


def file_hash(path: str) -> tuple[int, str]:
    h = hashlib.blake2b(digest_size=16)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


class HashingFile:
    """A binary file wrapper that hashes what is written (the JSONL sidecar records it)."""

    def __init__(self, f: BinaryIO):
        self.f, self.h, self.size = f, hashlib.blake2b(digest_size=16), 0

    def write(self, data: bytes) -> int:
        self.h.update(data)
        self.size += len(data)
        return self.f.write(data)
