"""The command-line contract every script keeps (one `error:` line, exit code 2; docs/resume-and-failures.md) and the one
printer every line goes through. Standard library only: the floor the repository stands on."""

import argparse
import errno
import os
import re
import signal
import sys
import time

# --- the error contract ---------------------------------------------------------------------------


class UserError(Exception):
    """A problem the user can fix: one `error:` line, exit code 2, no traceback (exit_code_of)."""


class RankLocalError(UserError):
    """A UserError only the raising rank knows of: that rank prints it, named by its rank."""


class Interrupted(KeyboardInterrupt):
    """A signal (SIGTERM, SIGHUP) that ends a command at once, as Ctrl-C does: exit code 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def flat(message) -> str:
    """message on one line (a wrapped f-string, a multi-line library error)."""
    return " ".join(str(message).split())


def clipped(value, limit: int = 24) -> str:
    """value as a message quotes it (a number as written, else repr), cut after limit characters with its length."""
    try:
        text = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)
    except ValueError:  # an int beyond Python's limit of digits for str()
        return f"a number of {value.bit_length()} bits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def print_error(message) -> None:
    """message as one `error:` line on stderr, from rank 0 (a RankLocalError: from its rank)."""
    if isinstance(message, RankLocalError):
        rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
        several = rank.isdigit() and world.isdigit() and int(world) > 1
        print_line(f"error: {f'rank {rank}: ' * several}{flat(message)}", file=sys.stderr)
    else:
        print0(f"error: {flat(message)}", file=sys.stderr)


def print_warning(message) -> None:
    print0(f"warning: {flat(message)}", file=sys.stderr)


MAX_COUNT = 2**62  # the largest count a flag takes: step, row and token arithmetic stays inside int64


def _bound_text(n: int) -> str:
    """2**62 as '2**62', 2**64-1 as '2**64-1', small numbers as they are."""
    if n > 2**16 and n & (n - 1) == 0:
        return f"2**{n.bit_length() - 1}"
    if n > 2**16 and n & (n + 1) == 0:
        return f"2**{n.bit_length()}-1"
    return str(n)


def check_count(value: int, low: int, high: int = MAX_COUNT) -> int:
    """value, or argparse.ArgumentTypeError unless low <= value <= high (printed after the flag's name)."""
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be in {low}..{_bound_text(high)}, got {value}")
    return value


def int_in(low: int, high: int = MAX_COUNT):
    """The argparse type of an integer flag in low..high: a whole number in decimal ('1_000' too)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        return check_count(value, low, high)

    parse.__name__ = f"int in {low}..{_bound_text(high)}"
    return parse


positive_int = int_in(1)  # sizes and counts that cannot be zero: --batch-size, --workers, --top-k
non_negative_int = int_in(0)  # counts where 0 means none or off: --max-steps, --val-every, --limit


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except None, False and where the help already says it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def may_be_empty(text: str) -> str:
    """The argparse type of the one kind of argument that may be empty: text such as a prompt."""
    return text


RANK0_GRACE_S = 3.0  # what a loaded machine may take to start rank 0's interpreter after another rank's


class ArgumentParser(argparse.ArgumentParser):
    """argparse with whole flag names only, no empty values (but may_be_empty's), a usage error one `error:` line."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def _get_value(self, action, arg_string):
        # every value passes here (an empty one: an unset shell variable); a subcommand's parser checks its own
        if (
            not arg_string.strip()
            and action.type is not may_be_empty
            and action.nargs != argparse.PARSER
            and arg_string is not action.default
        ):
            raise argparse.ArgumentError(action, f"got an empty value ({arg_string!r}: an unset shell variable?)")
        return super()._get_value(action, arg_string)

    # under torchrun only rank 0 prints a refusal, and torchrun SIGTERMs the rest once one exits: rank 0
    # ignores SIGTERM while it parses, and the others leave RANK0_GRACE_S later
    def parse_known_args(self, args=None, namespace=None):
        several = os.environ.get("WORLD_SIZE", "1") not in ("", "1") and is_rank0()
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if several else None
        try:
            return super().parse_known_args(args, namespace)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def error(self, message: str):
        print_error(f"{message} (see {self.prog} --help)")
        if os.environ.get("WORLD_SIZE", "1") not in ("", "1") and not is_rank0():
            time.sleep(RANK0_GRACE_S)
        sys.exit(2)


def _interrupted_while_starting(signum, frame):
    print0("error: interrupted", file=sys.stderr)
    os._exit(130)  # mid-import: nothing to clean up, and unwinding it would be a traceback


def _import_failed(kind, error, trace):
    """sys.excepthook while a script imports: a library that cannot load is one `error:` line with the likely fix."""
    if not issubclass(kind, (ImportError, MemoryError)) or "--debug" in sys.argv:
        return sys.__excepthook__(kind, error, trace)
    script = sys.argv[0]
    venv = os.path.join(os.path.dirname(script), ".venv")
    if issubclass(kind, MemoryError) or any(
        sign in str(error).lower() for sign in ("cannot allocate", "failed to map")
    ):
        fix = "under a memory limit (ulimit -v) raise it, otherwise reinstall them (pip install -r requirements.txt)"
    elif os.path.isfile(os.path.join(venv, "bin", "python")) and os.path.realpath(sys.prefix) != os.path.realpath(venv):
        fix = (
            f"the virtual environment {venv} beside it is not active: run `. {venv}/bin/activate` first, "
            f"or {venv}/bin/python {script}"
        )
    else:
        fix = "reinstall them (pip install -r requirements.txt)"
    print0(
        f"error: cannot import the libraries this script needs ({reason_of(error, typed=True)}): {fix}", file=sys.stderr
    )
    os._exit(2)  # mid-import: nothing to clean up


def exit_on_ctrl_c_while_starting() -> None:
    """A script's first act: streams guarded; Ctrl-C, a failed import, a deleted current folder one line each."""
    guard_streams()
    try:
        os.getcwd()
    except FileNotFoundError:
        print_error(
            "the current folder no longer exists (deleted while the shell was in it): cd to an existing folder "
            "and run the command again"
        )
        sys.exit(2)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_starting)
    sys.excepthook = _import_failed


def parse_before_imports(parse_args) -> None:
    """exit_on_ctrl_c_while_starting, then the command line parsed: --help answers before the slow imports."""
    exit_on_ctrl_c_while_starting()
    parse_args()


def optional_import(module: str, missing: str):
    """An optional package, imported where a command needs it; a UserError(missing) where it cannot be."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(missing) from None


def exit_code_of(action, debug: bool = False, also_catch: tuple = (), interrupted: str = "error: interrupted") -> int:
    """Run a command-line action and return its exit code, each failure one line (with debug: its traceback)."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:  # Ctrl-C unwinds the action again
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.excepthook is _import_failed:  # the imports are done
        sys.excepthook = sys.__excepthook__
    try:
        action()
    except (UserError, *also_catch, RuntimeError, MemoryError, KeyboardInterrupt) as e:
        if debug:
            raise
        if isinstance(e, KeyboardInterrupt):
            signum = getattr(e, "signum", signal.SIGINT)
            line = interrupted if signum == signal.SIGINT else f"error: stopped by {signal.Signals(signum).name}"
            print0(line, file=sys.stderr)
            return 128 + signum
        if isinstance(e, (UserError, *also_catch)):
            print_error(e)
        elif isinstance(e, MemoryError):  # (the trainer words a step's own: device.out_of_memory_error)
            print_error(RankLocalError(out_of_host_memory(e)))
        elif str(e) == "can't start new thread":  # threading's, where the system lets no more start
            print_error(RankLocalError(no_thread(e)))
        else:
            raise
        return 2
    return output_lost_code(_result_lost)


def check_a_thread_starts():
    """Start one thread and wait for it: where none can start, the RuntimeError comes before a run changes files."""
    import threading

    probe = threading.Thread(target=lambda: None, name="thread probe")
    probe.start()
    probe.join()


def soft_limit(name: str, unit: int = 1024) -> str | None:
    """This process's soft limit resource.RLIMIT_<name> in units (KiB by default), None where unlimited."""
    import resource

    soft = resource.getrlimit(getattr(resource, f"RLIMIT_{name}"))[0]
    return None if soft == resource.RLIM_INFINITY else str(soft // unit)


def no_thread(e: RuntimeError) -> str:
    """Why a thread could not start, with the limits that decide it and what to raise."""
    stack, space, processes = (soft_limit(*limit) or "unlimited" for limit in (("STACK",), ("AS",), ("NPROC", 1)))
    return (
        f"cannot start a thread ({e}): each takes its stack (ulimit -s, {stack} KiB) from the address space "
        f"(ulimit -v, {space} KiB) and counts as a process (ulimit -u, {processes}): raise ulimit -v or "
        "ulimit -u, or lower ulimit -s"
    )


def memory_limit() -> str | None:
    """'ulimit -v, N KiB' where this process runs under an address-space limit, else None."""
    return f"ulimit -v, {limit} KiB" if (limit := soft_limit("AS")) else None


def raised_in_import(e: BaseException) -> bool:
    """Whether e was raised while a module was imported (a frame of its traceback runs a module's body)."""
    import traceback

    return any(frame.f_code.co_name == "<module>" for frame, _ in traceback.walk_tb(e.__traceback__))


def out_of_host_memory(e: MemoryError) -> str:
    """The line for a MemoryError no training step raised: what ran out, and the memory limit where one is set."""
    what = "while importing a library" if raised_in_import(e) else "on the host"
    fix = f"under a memory limit ({limit}): raise it" if (limit := memory_limit()) else "free memory and run it again"
    return f"out of memory {what} ({reason_of(e, typed=True)}): {fix}"


def output_lost_code(error: OSError | None) -> int:
    """0, or for a result stdout lost: 141 (128 + SIGPIPE) for a reader that left, else 2 and one line."""
    if error is None:
        return 0
    if error.errno == errno.EPIPE:
        return 128 + 13
    print_error(f"cannot write the output to stdout: {reason_of(error)}")
    return 2


# a C++ source location leading a library's message: "[enforce fail at alloc_cpu.cpp:127] ", gloo's "[../pair.cc:553] "
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*:\d+\]\s*")


def reason_of(e: BaseException, typed: bool = False) -> str:
    """A library's exception as a short line (an OSError's strerror, else its first line); typed: 'Type: ...'."""
    if isinstance(e, OSError) and e.strerror:
        text = e.strerror[:1].lower() + e.strerror[1:]
    else:
        lines = _SOURCE_LOCATION.sub("", str(e).strip(), count=1).splitlines()
        text = flat(lines[0]) if lines else ""
    text = text if len(text) <= 300 else text[:297] + "..."
    if not text:
        return type(e).__name__
    return f"{type(e).__name__}: {text}" if typed else text


# --- the one printer ------------------------------------------------------------------------------


def is_rank0() -> bool:
    """Whether this process is rank 0 of a torchrun launch, or not launched by one (RANK unset or 0)."""
    return os.environ.get("RANK", "0") in ("", "0")


# C0 (ESC, BEL, CR, ...), DEL and C1 (the one-character CSI, U+009B among them): what a terminal may obey
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
    """A text stream whose writes raise no OSError: after the first (lost), writes go nowhere, fd onto /dev/null."""

    def __init__(self, stream):
        self.stream, self.lost = stream, None

    def write(self, text: str) -> int:
        self._guarded(self.stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._guarded(self.stream.flush)

    def _guarded(self, call, *args) -> None:
        if self.lost is None:
            try:
                call(*args)
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
    """What the command exists to print, on stdout from rank 0: whether stdout took it (nothing is raised)."""
    global _result_lost
    print0(text, keep_newlines=keep_newlines)
    if (lost := getattr(sys.stdout, "lost", None)) is not None and is_rank0():
        _result_lost = lost
    return _result_lost is None
