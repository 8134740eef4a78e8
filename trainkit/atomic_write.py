"""Writing a file whole or not at all: into a temporary file beside it, then renamed over it. Each
caller says the durability it needs: a rename alone survives a killed process (a reader sees the old
file or the new one, never part of one); fsync_file adds the new bytes surviving a power loss, and
fsync_folder the rename itself. The rename makes a new file: whatever else shared the old one (a hard
link, the target of a symbolic link put in its place) keeps its bytes. Standard library only.
"""

from __future__ import annotations

import contextlib
import os


def write_atomically(path: str, write, *, fsync_file: bool, fsync_folder: bool, tmp: str | None = None):
    """write(f) into tmp (default path + ".tmp"; one name per process where processes may write the
    same path at once), opened for binary writing, then tmp renamed to path. Any failure, an
    interruption too, removes tmp and is raised as it came (an OSError for the caller to word)."""
    tmp = tmp or path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            if fsync_file:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if fsync_folder:
        fsync_dir(os.path.dirname(path) or ".")


def write_bytes_atomically(path: str, *blobs, fsync_file: bool, fsync_folder: bool, tmp: str | None = None):
    """write_atomically of blobs (bytes or buffers), one after the other."""

    def write(f):
        for blob in blobs:
            f.write(blob)

    write_atomically(path, write, fsync_file=fsync_file, fsync_folder=fsync_folder, tmp=tmp)


def fsync_dir(path: str):
    """Make the entries of folder path (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
