"""The one place every script prints through: printing never ends a command (a failed stream is
dropped: GuardedStream), never commands the terminal (control characters escaped: shown), and a
command's own output says when stdout lost it (print_result). docs/output.md states the contract.
Standard library only, importing nothing of the repository: the floor trainkit/cli.py stands on.
"""

import os
import re
import sys


def is_rank0() -> bool:
    """Whether this process is rank 0 of a torchrun launch, or not launched by one (RANK unset or 0)."""
    return os.environ.get("RANK", "0") in ("", "0")


# C0 (ESC, BEL, CR, backspace, ...), DEL and C1 (among them the one-character CSI, U+009B): the
# characters a terminal may take as commands
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # all but \t (0x09) and \n (0x0a)


def _escape(match: re.Match) -> str:
    return f"\\x{ord(match[0]):02x}"


def shown(text: str, keep_newlines: bool = False) -> str:
    """text with each control character escaped (`\\x1b`); keep_newlines: newlines and tabs stay."""
    if text.isprintable():  # most text holds none: this check, in C, is 3x faster than the scan below
        return text
    return (_CONTROL_BUT_LINES if keep_newlines else _CONTROL).sub(_escape, text)


class GuardedStream:
    """A text stream whose writes raise no OSError: the first failure makes it lost (lost: the error),
    later writes are dropped, and its descriptor points at /dev/null so the flush at exit cannot fail."""

    def __init__(self, stream):
        self.stream, self.lost = stream, None

    def write(self, text: str) -> int:
        if self.lost is None:
            try:
                self.stream.write(text)
            except OSError as e:
                self._lose(e)
        return len(text)

    def flush(self) -> None:
        if self.lost is None:
            try:
                self.stream.flush()
            except OSError as e:
                self._lose(e)

    def _lose(self, error: OSError) -> None:
        self.lost = error
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self.stream.fileno())
            finally:
                os.close(devnull)
            self.stream.flush()  # what the failed write left in the buffer: into /dev/null now
        except OSError:  # no file descriptor left to open: the stream stays lost all the same
            pass

    def __getattr__(self, name):
        return getattr(self.stream, name)


def guard_streams() -> None:
    """sys.stdout and sys.stderr as GuardedStreams that backslash-escape what their encoding lacks (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, GuardedStream):
            continue
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
        setattr(sys, name, GuardedStream(stream))


def print_line(text: str = "", file=None, keep_newlines: bool = False) -> None:
    """text on file (default: stdout), control characters escaped (shown), flushed, from any rank."""
    print(shown(text, keep_newlines), file=file or sys.stdout, flush=True)


def print0(text: str = "", file=None, keep_newlines: bool = False) -> None:
    """print_line from rank 0 only: eight copies of each line would hide it."""
    if is_rank0():
        print_line(text, file, keep_newlines)


_result_lost = None  # the error that kept a command's result from stdout (print_result), for exit_code_of


def print_result(text: str, keep_newlines: bool = False) -> bool:
    """A piece of what the command exists to print, on stdout from rank 0: whether stdout took it (where
    not, cli.exit_code_of makes result_lost() the exit code; nothing is raised, so every rank ends alike)."""
    global _result_lost
    print0(text, keep_newlines=keep_newlines)
    lost = getattr(sys.stdout, "lost", None)
    if lost is not None and is_rank0():
        _result_lost = lost
    return _result_lost is None


def result_lost() -> OSError | None:
    """The error that kept a result from stdout (print_result), None while all of it was written."""
    return _result_lost
