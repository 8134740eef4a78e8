"""Writing a file whole or not at all: into a temporary file beside it, then renamed over it. Each
caller says the durability it needs: a rename alone survives a killed process (a reader sees the old
file or the new one, never part of one); fsync_file adds the new bytes surviving a power loss, and
fsync_folder the rename itself.

Nothing is written through a name that was there before. The temporary file is created, not opened
(create_fresh): whatever stands at its name, a killed writer's leftover, a symbolic link planted there, or
a name a copied folder (`cp -al`, `cp -as`) shares with another run's file, is unlinked and a new file made
in its place with an exclusive create that follows no link. The rename then replaces the target's name,
whatever stands there: a hard link or a symbolic link planted at it keeps what it named, and only a
folder in its place fails the write. A writer that holds its folder open (a run its --out-dir) names
path relative to that descriptor (dir_fd, as os.open's): the file lands in that folder even where its
name has come to name another one. Standard library only.
"""

from __future__ import annotations

import contextlib
import os

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def create_fresh(path: str, dir_fd: int | None = None) -> int:
    """A descriptor, open for writing, of a new empty file at path (0o666 less the umask, as open() makes
    one): what stood at that name is unlinked first, never opened, so a file or link another writer or
    another run left there keeps its bytes. An OSError where the name cannot be freed or taken (a folder
    stands there; another process took it in between)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path, dir_fd=dir_fd)  # (a folder: EISDIR or EPERM, raised)
    return os.open(path, _CREATE, 0o666, dir_fd=dir_fd)


def write_atomically(
    path: str, write, *, fsync_file: bool, fsync_folder: bool, tmp: str | None = None, dir_fd: int | None = None
):
    """write(f) into tmp (default path + ".tmp"; one name per process where processes may write the
    same path at once), made fresh (create_fresh) and opened for binary writing, then tmp renamed to
    path (both relative to the folder dir_fd where given). Any failure, an interruption too, removes tmp
    and is raised as it came (an OSError for the caller to word)."""
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
