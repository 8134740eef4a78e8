"""The one place every script prints through: what a program prints cannot kill it, and cannot
command the terminal it prints to.

- guard_streams() (each script's first act, through cli.exit_on_ctrl_c_while_starting) puts a
  GuardedStream around sys.stdout and sys.stderr. A write or flush that fails with an OSError (the
  reader of a pipe left: EPIPE, `| head`; a full device: ENOSPC, `> /dev/full`; a hung-up terminal:
  EIO) raises nothing: the stream is lost from then on, what is written to it later is dropped, and
  its file descriptor is pointed at /dev/null so that the interpreter's flush at exit cannot fail either
  (the SIGPIPE note of Python's signal docs). A long run goes on: its log.jsonl is the record.
  Text that the stream's encoding lacks (PYTHONIOENCODING=ascii, a C locale) is written
  backslash-escaped instead of raising UnicodeEncodeError.
- shown(text) escapes the control characters of text the program did not write itself (a sample
  of the model, a checkpoint's key, a file name): ESC, BEL and the rest of C0, DEL and C1 are
  written as `\\x1b`, so a model trained on terminal escape sequences cannot retitle, clear or
  reprogram the terminal that shows its samples. print_line, print0 and print_result print through
  it; what writes to the streams directly (tqdm's progress bars, with their own \\r) is left as it is.
- print_result(text) prints a piece of what a command exists to print (sample.py's texts,
  hellaswag.py's score): where stdout could not take it, result_lost() says why, and cli.exit_code_of
  turns that into the command's exit code (141 for a reader that left, else one `error:` line and 2).

Standard library only, and it imports no other module of the repository: the floor that the
error contract (trainkit/cli.py) stands on. Nothing runs at import.
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
    """text with each control character written as its escape (`\\x1b`, `\\x07`, `\\x0a`, ...), so
    that printing it cannot command a terminal; keep_newlines (a sample's text): newlines and tabs
    stay as they are."""
    if text.isprintable():  # most text holds none: this check, in C, is 3x faster than the scan below
        return text
    return (_CONTROL_BUT_LINES if keep_newlines else _CONTROL).sub(_escape, text)


class GuardedStream:
    """A text stream (sys.stdout, sys.stderr) whose writes raise no OSError: the first one that
    fails makes it lost (lost: that error), what is written to it after is dropped, and its file
    descriptor is pointed at /dev/null (the buffer that the failed write left behind is flushed
    there at exit, silently). Everything else (fileno, isatty, encoding, buffer) is the stream's."""

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
    """sys.stdout and sys.stderr as GuardedStreams that escape what their encoding lacks (once;
    a stream that is None, where the process has none, stays None)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, GuardedStream):
            continue
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
        setattr(sys, name, GuardedStream(stream))


def print_line(text: str = "", file=None, keep_newlines: bool = False) -> None:
    """text on file (default: stdout) as one line, control characters escaped (shown), flushed:
    from whichever rank calls it (print0: from rank 0 only)."""
    print(shown(text, keep_newlines), file=file or sys.stdout, flush=True)


def print0(text: str = "", file=None, keep_newlines: bool = False) -> None:
    """print_line from rank 0 only (RANK unset or 0): the ranks of a launch run the same command,
    and eight copies of each line would hide it."""
    if is_rank0():
        print_line(text, file, keep_newlines)


_result_lost = None  # the error that kept a command's result from stdout (print_result), for exit_code_of


def print_result(text: str, keep_newlines: bool = False) -> bool:
    """A piece of what the command exists to print (sample.py's texts, hellaswag.py's score,
    --eval-only's record), on stdout from rank 0: whether stdout took it. Where it did not,
    result_lost() gives the error and cli.exit_code_of makes it the exit code (nothing is raised
    here, so that every rank of a launch ends its work alike)."""
    global _result_lost
    print0(text, keep_newlines=keep_newlines)
    lost = getattr(sys.stdout, "lost", None)
    if lost is not None and is_rank0():
        _result_lost = lost
    return _result_lost is None


def result_lost() -> OSError | None:
    """The error that kept a result from stdout (print_result), None while all of it was written."""
    return _result_lost
