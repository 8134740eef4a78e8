"""Writing a file whole or not at all: into a temporary file beside it, renamed over it (a killed process
leaves the old file or the new one); fsync_file and fsync_folder add surviving a power loss. Nothing is
written through a name that was there before: the temporary file is created fresh (create_fresh: no link
followed, no file a `cp -al` copy shares opened), and the rename replaces whatever stands at the target.
dir_fd: a folder a writer holds open, the file landing there even where its name now names another one.
"""

from __future__ import annotations

import contextlib
import os

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def create_fresh(path: str, dir_fd: int | None = None) -> int:
    """A descriptor, open for writing, of a new empty file at path: what stood at that name is unlinked
    first, never opened, so a file or link left there keeps its bytes (an OSError where a folder stands)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path, dir_fd=dir_fd)  # (a folder: EISDIR or EPERM, raised)
    return os.open(path, _CREATE, 0o666, dir_fd=dir_fd)


def write_atomically(
    path: str, write, *, fsync_file: bool, fsync_folder: bool, tmp: str | None = None, dir_fd: int | None = None
):
    """write(f) into tmp (default path + ".tmp"), made fresh and opened binary, then renamed to path; any
    failure, an interruption too, removes tmp and is raised as it came (an OSError for the caller to word)."""
    tmp = tmp or path + ".tmp"
    fd = create_fresh(tmp, dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if fsync_file:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp, dir_fd=dir_fd)
        raise
    if fsync_folder and dir_fd is not None:
        os.fsync(dir_fd)
    elif fsync_folder:
        fsync_dir(os.path.dirname(path) or ".")


def write_bytes_atomically(
    path: str, *blobs, fsync_file: bool, fsync_folder: bool, tmp: str | None = None, dir_fd: int | None = None
):
    """write_atomically of blobs (bytes or buffers), one after the other."""

    def write(f):
        for blob in blobs:
            f.write(blob)

    write_atomically(path, write, fsync_file=fsync_file, fsync_folder=fsync_folder, tmp=tmp, dir_fd=dir_fd)


def fsync_dir(path: str):
    """Make the entries of folder path (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
