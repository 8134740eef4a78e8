"""Stop signals: SIGTERM, SIGINT and SIGHUP finish the step, checkpoint and exit 0."""

from __future__ import annotations

import os
import signal

from trainkit import cli


# a stop as requested: preemption, Ctrl-C, and a closed terminal or ssh session (no SIGHUP on Windows)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))


class StopSignal:
    """SIGTERM, SIGINT and SIGHUP ask the run to finish its step, checkpoint and exit 0; a second SIGINT
    aborts; at_once (nothing to save): each ends it as cli.Interrupted. A SIGHUP ignored (nohup) stays so."""

    def __init__(self, at_once: bool = False):
        self.requested, self.at_once = False, at_once
        self.terminal_fds = [fd for fd in (1, 2) if os.isatty(fd)]  # a hung-up terminal no longer says it is one
        self.previous = {
            s: signal.signal(s, self._handle)
            for s in STOP_SIGNALS
            if not (s == getattr(signal, "SIGHUP", None) and signal.getsignal(s) == signal.SIG_IGN)  # nohup's
        }

    def _handle(self, signum, frame):
        if signum == getattr(signal, "SIGHUP", None):
            self.leave_terminal()
        if self.at_once or (self.requested and signum == signal.SIGINT):
            raise cli.Interrupted(signum)
        self.requested = True

    def leave_terminal(self):
        """After SIGHUP writing to the gone terminal fails (EIO): what went there goes to /dev/null."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in self.terminal_fds:
            os.dup2(devnull, fd)
        os.close(devnull)

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def ignore_sigterm_from_now(self):
        """After another rank died torchrun SIGTERMs the survivors: this one still prints its line."""
        self.previous[signal.SIGTERM] = signal.SIG_IGN


def stopped_line(path: str, step: int) -> str:
    """What a run stopped by a signal prints last: its checkpoint, how to go on, and under torchrun that
    torchrun's own SignalException traceback after it is harmless."""
    line = (
        f"stopped by signal at step {step}; checkpoint {path} is complete and safe. Resume with the same "
        "command plus --resume"
    )
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # set by torchrun in every process it starts
        line += " (torchrun's SignalException traceback, if one follows, only reports the signal it passed on)"
    return line
