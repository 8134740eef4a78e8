"""A run changes only files of its own. A run folder may share files with another one: a hard-linked
copy (`cp -al runA runB`, a cheap and common way to branch a run) shares every file's bytes, and a
folder of symbolic links points into another. A file a run changes in place (log.jsonl: appended to,
cut back) is first made its own, a copy under the same name (own_file); a name a run moves (a
checkpoint set aside into a branch folder) moves as what it is, a symbolic link still pointing at its
file (move_entry). Removing a name (--keep-last) and renaming a new file over one (a checkpoint, the
lock note) change no other name's bytes. A file an attribute holds in place (pinned: append-only or
immutable) is found before a run sets out to move or cut it. Standard library only.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import sys

from trainkit.atomic_write import write_atomically


def shared_as(path: str) -> str | None:
    """How the file at path is shared with other names, in words (None: it is its own, or missing, or not a
    regular file: whoever opens it says what it is)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link to {os.readlink(path)}" if os.path.isfile(path) else None
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        return f"a hard link to a file with {st.st_nlink - 1} other name{'s' * (st.st_nlink > 2)} (as `cp -al` makes)"
    return None


def own_file(path: str) -> str | None:
    """Before a run changes the file at path in place: a file shared with other names (shared_as) is
    replaced by a copy of its bytes, written beside it and renamed over the link, so that the run's
    changes go to a file of its own and every other name keeps its bytes (copying, rather than refusing:
    who copies a run folder means to branch it). Returns the note line that says so, or None when path
    was its own already. An OSError is the caller's to word."""
    shared = shared_as(path)
    if shared is None:
        return None
    with open(path, "rb") as source:
        write_atomically(path, lambda f: shutil.copyfileobj(source, f), fsync_file=True, fsync_folder=True)
    return f"note: {path} was {shared}: this run writes to a copy of its own, and the file it shared stays as it was"


def move_entry(source: str, destination: str):
    """Rename source to destination (one file system), a symbolic link with a relative target given
    the target that names the same file from its new folder (renamed as it is, it would point
    elsewhere, or nowhere)."""
    if os.path.islink(source) and not os.path.isabs(os.readlink(source)):
        target = os.path.join(os.path.dirname(source), os.readlink(source))
        os.symlink(os.path.relpath(target, os.path.dirname(destination) or "."), destination)
        os.remove(source)
        return
    os.rename(source, destination)


# <linux/fs.h>: FS_IOC_GETFLAGS, _IOR('f', 1, long), and the two flags that hold a file in place
_FS_IOC_GETFLAGS = 0x80006601 | struct.calcsize("l") << 16
_FS_IMMUTABLE_FL, _FS_APPEND_FL = 0x10, 0x20


def pinned(path: str) -> str | None:
    """How an attribute holds the regular file at path in place, in words: "append-only (chattr +a)" (it
    may only grow: no move, removal or cut) or "immutable (chattr +i)" (no change at all), for root too;
    None where neither does, where path is no regular file (a symbolic link moves as itself), or where
    the system cannot say (Linux's FS_IOC_GETFLAGS; BSD's and macOS's st_flags)."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return None
        if hasattr(st, "st_flags"):
            flags = st.st_flags
            append, immutable = (
                flags & (stat.UF_APPEND | stat.SF_APPEND),
                flags & (stat.UF_IMMUTABLE | stat.SF_IMMUTABLE),
            )
        else:
            import fcntl

            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
            try:
                flags = int.from_bytes(fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(8))[:4], sys.byteorder)
            finally:
                os.close(fd)
            append, immutable = flags & _FS_APPEND_FL, flags & _FS_IMMUTABLE_FL
    except (OSError, ImportError):  # gone, unreadable, or a file system without the flags (ENOTTY)
        return None
    return "immutable (chattr +i)" if immutable else "append-only (chattr +a)" if append else None
