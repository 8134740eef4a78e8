"""The command-line contract every script here keeps (train_gpt2.py, fineweb.py, hellaswag.py,
hf_interop.py, sample.py, plot_log.py):

- bad input (a UserError, or a flag argparse refuses) is one `error:` line on stderr and exit
  code 2, no traceback unless --debug; -h/--help prints the full help and exits 0;
- flags are whole words: `--max-step` is refused, not taken for `--max-steps`;
- Ctrl-C is `error: interrupted` and exit code 130 (128 + SIGINT, as a shell reports it), also
  while the script is still importing torch;
- under torchrun every rank exits with that code, but only rank 0 prints the line: the ranks run
  the same command on the same input, and eight copies of one error would hide it. An error only
  one rank can see (RankLocalError: a bad row of data it read, its own out-of-memory) is printed
  by that rank, named;
- a warning (something accepted that the user may not have meant) is one `warning:` line on
  stderr, from rank 0;
- every integer flag of every script is parsed by int_in (positive_int, non_negative_int): a
  count out of its range is a usage error naming the flag, never a default taken instead.

Standard library only, so that a script imports it before torch and numpy; nothing runs at import.
"""
import argparse
import os
import signal
import sys


class UserError(Exception):
    """A problem the user can fix: exit_code_of prints it as one `error:` line, exit code 2, no
    traceback. Every script raises this same class (they import it from here)."""


class RankLocalError(UserError):
    """A UserError that only the rank raising it knows of (the others stop when it leaves): that
    rank prints it, with its rank number under a launch of several processes."""


class Interrupted(KeyboardInterrupt):
    """A signal (SIGTERM, SIGHUP) that ends a command at once, as Ctrl-C does: exit code 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def flat(message) -> str:
    """message on one line (a wrapped f-string, a multi-line library error)."""
    return " ".join(str(message).split())


def is_rank0() -> bool:
    """Whether this process is rank 0 of a torchrun launch, or not launched by one (RANK unset or 0)."""
    return os.environ.get("RANK", "0") in ("", "0")


def print_line0(line: str) -> None:
    """One line on stderr, written by rank 0 only under torchrun (RANK unset or 0)."""
    if is_rank0():
        print(line, file=sys.stderr, flush=True)


def print_error(message) -> None:
    if isinstance(message, RankLocalError):  # with its rank, where RANK and WORLD_SIZE say there are several
        rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
        several = rank.isdigit() and world.isdigit() and int(world) > 1
        print(f"error: {f'rank {rank}: ' * several}{flat(message)}", file=sys.stderr, flush=True)
    else:
        print_line0(f"error: {flat(message)}")


def print_warning(message) -> None:
    print_line0(f"warning: {flat(message)}")


MAX_COUNT = 2**62  # the largest count a flag takes: step, row and token arithmetic stays inside int64


def _bound_text(n: int) -> str:
    """2**62 as '2**62', 2**64-1 as '2**64-1', small numbers as they are."""
    if n > 2**16 and n & (n - 1) == 0:
        return f"2**{n.bit_length() - 1}"
    if n > 2**16 and n & (n + 1) == 0:
        return f"2**{n.bit_length()}-1"
    return str(n)


def check_count(value: int, low: int, high: int = MAX_COUNT) -> int:
    """value, or argparse.ArgumentTypeError unless low <= value <= high (argparse prints it after
    the flag's name: `error: argument --batch-size: must be in 1..2**62, got 0`)."""
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
    """Shows each flag's default, except None and False (whose help says what happens instead) and
    where the help already says its default."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with whole flag names only (allow_abbrev=False) and a usage error as one `error:`
    line and exit code 2 (argparse prints the usage and `prog: error: ...`); -h/--help prints
    the full help. Subcommands' parsers are of this class too."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message: str):
        print_error(f"{message} (see {self.prog} --help)")
        sys.exit(2)


def _interrupted_while_starting(signum, frame):
    print_line0("error: interrupted")
    os._exit(130)  # mid-import: nothing to clean up, and unwinding it would be a traceback


def _import_failed(kind, error, trace):
    """sys.excepthook while a script imports its libraries: one that cannot load is one `error:`
    line and exit code 2, not a traceback from inside torch, saying what most likely fixes it: a
    memory limit such as `ulimit -v` too small for torch's shared libraries, the virtual environment
    beside the script not being the python that runs it (quickstart.sh's .venv, not activated), or
    a broken or missing install."""
    if not issubclass(kind, (ImportError, MemoryError)) or "--debug" in sys.argv:
        return sys.__excepthook__(kind, error, trace)
    reason = flat(error)
    script = sys.argv[0]
    venv = os.path.join(os.path.dirname(script), ".venv")
    if issubclass(kind, MemoryError) or any(sign in reason.lower() for sign in ("cannot allocate", "failed to map")):
        fix = "under a memory limit (ulimit -v) raise it, otherwise reinstall them (pip install -r requirements.txt)"
    elif (os.path.isfile(os.path.join(venv, "bin", "python"))
          and os.path.realpath(sys.prefix) != os.path.realpath(venv)):
        fix = (f"the virtual environment {venv} beside it is not active: run `. {venv}/bin/activate` first, "
               f"or {venv}/bin/python {script}")
    else:
        fix = "reinstall them (pip install -r requirements.txt)"
    print_line0(f"error: cannot import the libraries this script needs ({kind.__name__}: {reason}): {fix}")
    os._exit(2)  # mid-import: nothing to clean up


def exit_on_ctrl_c_while_starting() -> None:
    """For a script run as a program, before its slow imports (torch takes seconds): Ctrl-C from
    now until exit_code_of runs the action is `error: interrupted` and exit code 130, and a
    library that fails to import is one `error:` line and exit code 2 (_import_failed). A
    SIGINT that the parent left ignored (a background job) stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_starting)
    sys.excepthook = _import_failed


def exit_code_of(action, debug: bool = False, also_catch: tuple = (),
                 interrupted: str = "error: interrupted") -> int:
    """Run a command-line action: 0; or 2 and one `error:` line for a UserError (or one of
    also_catch); or 130 and the `interrupted` line for a Ctrl-C that no handler turned into a
    clean stop (128 + signum for another Interrupted signal). With debug, the traceback instead."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:  # Ctrl-C unwinds the action again
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.excepthook is _import_failed:  # the imports are done
        sys.excepthook = sys.__excepthook__
    try:
        action()
    except (UserError, *also_catch) as e:
        if debug:
            raise
        print_error(e)
        return 2
    except KeyboardInterrupt as e:
        if debug:
            raise
        signum = getattr(e, "signum", signal.SIGINT)
        print_line0(interrupted if signum == signal.SIGINT else f"error: stopped by {signal.Signals(signum).name}")
        return 128 + signum
    return 0


def one_line(e: BaseException) -> str:
    """Another library's exception as a short single line, to quote inside our message."""
    text = flat(e) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def os_error_reason(e: Exception) -> str:
    """'no space left on device', 'permission denied', ...: an OSError without the file name
    (which a failed write() does not carry anyway), to follow the name in our message; another
    exception (torch.save's RuntimeError, safetensors' error) as its text on one line."""
    reason = e.strerror if isinstance(e, OSError) and e.strerror else one_line(e)
    return reason[:1].lower() + reason[1:]
