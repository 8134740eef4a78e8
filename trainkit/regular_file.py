"""What a program reads from a path a user gave is a regular file (links followed): a named pipe would
block forever, a link to /dev/zero read until memory runs out. open_regular opens without blocking and
checks what it opened, so a pipe swapped in between is refused too."""

from __future__ import annotations

import os
import stat

from trainkit.cli import UserError

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_regular(path: str, st: os.stat_result) -> UserError | None:
    """The refusal of path whose (followed) status is st, or None where it is a regular file."""
    if stat.S_ISREG(st.st_mode):
        return None
    kind = next((words for is_kind, words in _KINDS if is_kind(st.st_mode)), "not a file")
    target = f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else ""
    return UserError(f"{path} is {kind}{target}, not a regular file: it cannot be read as one")


def check_regular(path: str) -> os.stat_result:
    """path's status, links followed, or a UserError unless it is a regular file."""
    st = os.stat(path)
    refusal = not_regular(path, st)
    if refusal:
        raise refusal
    return st


def open_regular(path: str):
    """path open for binary reading, or a UserError unless it is a regular file (O_NONBLOCK: a pipe returns at once)."""
    check_regular(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        refusal = not_regular(path, os.fstat(fd))
        if refusal:
            raise refusal
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
