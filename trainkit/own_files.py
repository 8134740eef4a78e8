"""A run changes only files of its own, though a copied run folder (`cp -al`, `cp -as`) shares them: a file
changed in place (log.jsonl) is first made its own copy (own_file), a moved symbolic link keeps pointing at
its file (move_entry), and a file an attribute holds in place (pinned) is found before a run moves or cuts it.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import sys

from trainkit.atomic_write import write_atomically


def shared_as(path: str) -> str | None:
    """How the file at path is shared with other names, in words (None: its own, missing, or no regular file)."""
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
    """Before a run changes path in place: a shared file is replaced by a copy of its own (who copies a
    run folder means to branch it); returns the note line that says so (None: it was its own)."""
    shared = shared_as(path)
    if shared is None:
        return None
    with open(path, "rb") as source:
        write_atomically(path, lambda f: shutil.copyfileobj(source, f), fsync_file=True, fsync_folder=True)
    return f"note: {path} was {shared}: this run writes to a copy of its own, and the file it shared stays as it was"


def move_entry(source: str, destination: str):
    """Rename source to destination, a symbolic link with a relative target re-aimed from its new folder."""
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
    """How an attribute holds the regular file at path in place, for root too: "append-only (chattr +a)" or
    "immutable (chattr +i)"; None where neither does or the system cannot say."""
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
