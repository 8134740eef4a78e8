"""What a run writes into its --out-dir besides checkpoints, and who may write there: the lock
(one live run per folder), log.jsonl (one JSON record per line, cut back exactly on resume),
branch folders (a resume from an earlier step sets the later checkpoints aside instead of
overwriting them), and the W&B / TensorBoard sinks that get every record of the log.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import shutil
import socket

import cli
from checkpoints import checkpoint_step, fsync_dir, list_checkpoints
from cli import UserError
from fineweb import one_line, os_error_reason
from launch import print0

class RunLog:
    """log.jsonl on rank 0: one JSON object per line. Other ranks write nothing.

    Each record is one write, and a failed write (disk full) is cut back: the file always ends
    with a whole record. A checkpoint stores the log's length and the sha256 of its contents up
    to there (position()); resuming cuts the log back to that point only when the log here is
    that run's log (an empty or missing log starts afresh), and refuses otherwise."""

    sinks = ()  # run trackers that get every record too (open_sinks)

    def __init__(self, out_dir: str, enabled: bool, resume_point: tuple | None = None, resumed_from: str = ""):
        self.path, self.file = os.path.join(out_dir, "log.jsonl"), None
        self.last_checkpoint = resumed_from or None  # named when a write fails
        self.size, self.sha = 0, hashlib.sha256()
        if not enabled:
            return
        if os.path.islink(self.path) and not os.path.exists(self.path):  # open() would create its target
            raise UserError(f"cannot open {self.path}: it is a symbolic link to {os.readlink(self.path)}, which "
                            "does not exist; remove the link or point it at a file")
        try:
            kept = read_log_up_to(self.path, resume_point, resumed_from)
            self.file = open(self.path, "ab", buffering=0)  # unbuffered: one write per record
            if resume_point:
                self.file.truncate(len(kept))  # drop what the run logged after its checkpoint
        except OSError as e:
            raise UserError(f"cannot open {self.path}: {os_error_reason(e)}; make it a writable file, or choose "
                            "another --out-dir") from None
        self.size = len(kept)
        self.sha.update(kept)

    def write(self, **record):
        if self.file:
            self._append((json.dumps(strict_json_record(record), allow_nan=False) + "\n").encode())
        for sink in list(self.sinks):
            self._to_sink(sink, f"at step {record['step']}", sink.write, record)

    def resend_step(self, step: int):
        """The sinks get the records of step that the log holds: a resumed run's step was evaluated
        before its checkpoint, so each tracker then holds what log.jsonl holds from that step on."""
        if not self.file:
            return
        with open(self.path, "rb") as f:
            for line in f.read(self.size).splitlines():
                record = json.loads(line)
                record.update({k: float(v) for k, v in record.pop("nonfinite", {}).items()})  # strict_json_record undone
                if record["step"] == step:
                    for sink in list(self.sinks):
                        self._to_sink(sink, f"at step {step}", sink.write, record)

    def _to_sink(self, sink, when: str, call, *args):
        """A run tracker that fails (W&B's service gone, a full disk) gets no more records, with a
        warning: the training and log.jsonl go on, and log.jsonl holds every record."""
        try:
            call(*args)
        except Exception as e:
            self.sinks = [s for s in self.sinks if s is not sink]
            cli.print_warning(f"{sink.flag} failed {when} ({type(e).__name__}: {one_line(e)}) and gets no more "
                              f"records; {self.path} has them all")

    def _append(self, data: bytes):
        try:
            view = memoryview(data)
            while view:  # a short write means the disk filled mid-record: the next write says why
                view = view[self.file.write(view):]
        except OSError as e:
            with contextlib.suppress(OSError):
                self.file.truncate(self.size)  # back to the last whole record
            self._fail(e)
        self.size += len(data)
        self.sha.update(data)

    def sync(self):
        """Make the log durable (before a checkpoint that points into it)."""
        if self.file:
            try:
                os.fsync(self.file.fileno())
            except OSError as e:
                self._fail(e)

    def _fail(self, e: OSError):
        raise UserError(f"cannot write {self.path}: {os_error_reason(e)} (the log ends at its last whole record). "
                        f"Last good checkpoint: {self.last_checkpoint or 'none'}") from None

    def position(self) -> tuple[int, str]:
        """(bytes written, sha256 of them): where a resume from a checkpoint taken now cuts the log."""
        return self.size, self.sha.hexdigest()

    def close(self):
        if self.file:
            self.file.close()
        for sink in list(self.sinks):
            self._to_sink(sink, "at the end", sink.close)


def strict_json_record(record: dict) -> dict:
    """record with its NaN and infinite numbers as null, listed by name and value under "nonfinite":
    JSON has no NaN or Infinity, and strict readers (jq, JavaScript, pandas' default) reject them."""
    bad = {k: str(v) for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
    return {**record, **dict.fromkeys(bad), "nonfinite": bad} if bad else record


def read_log_up_to(path: str, resume_point: tuple | None, resumed_from: str) -> bytes:
    """What a run keeps of the log.jsonl at path: all of it, or resuming, its bytes up to the
    checkpoint's recorded (offset, sha256), when it is the log of the checkpoint's run (a missing or
    empty log is fine: a new one starts). Otherwise a UserError: cutting it would corrupt it."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size  # (0 for a device: /dev/full reads zeros forever)
            kept = f.read(min(resume_point[0], size) if resume_point else size)
    except FileNotFoundError:
        return b""
    if resume_point and kept and (len(kept) != resume_point[0] or hashlib.sha256(kept).hexdigest() != resume_point[1]):
        raise UserError(f"{path} is not the log of the run that wrote {resumed_from}: resuming would "
                        "corrupt it; move it aside or resume into an --out-dir without a log.jsonl")
    return kept


def set_aside_later_branch(out_dir: str, step: int, resume_point: tuple | None, resumed_from: str):
    """Resuming at `step` abandons what the run in out_dir did after it. Its later checkpoints move,
    with a copy of its log.jsonl, into a new out_dir/branch_NNNNNNN (the step that branch reached),
    a run folder of its own (--resume works on it): nothing is deleted or overwritten, --keep-last
    no longer counts them, and a plain --resume in out_dir continues the new branch."""
    later = [p for p in list_checkpoints(out_dir) if checkpoint_step(p) > step]
    if not later:
        return
    log = os.path.join(out_dir, "log.jsonl")
    read_log_up_to(log, resume_point, resumed_from)  # a log that is not this run's: refused before anything moves
    reached = checkpoint_step(later[-1])
    branch = os.path.join(out_dir, f"branch_{reached:07d}")
    for n in itertools.count(2):  # a name no earlier branch took
        try:
            os.mkdir(branch)
            break
        except FileExistsError:
            branch = os.path.join(out_dir, f"branch_{reached:07d}_{n}")
    try:
        if os.path.isfile(log):
            shutil.copyfile(log, os.path.join(branch, "log.jsonl"))
            with open(os.path.join(branch, "log.jsonl"), "rb+") as f:
                os.fsync(f.fileno())
        for path in later:
            os.rename(path, os.path.join(branch, os.path.basename(path)))
        fsync_dir(branch)
        fsync_dir(out_dir)
    except OSError as e:
        raise UserError(f"could not move the later checkpoints of {out_dir} into {branch}: {os_error_reason(e)} "
                        "(nothing was deleted)") from None
    names = os.path.basename(later[0]) + (f" ... {os.path.basename(later[-1])}" if len(later) > 1 else "")
    print0(f"resuming at step {step}: moved the later branch of this run ({len(later)} checkpoint"
           f"{'s' * (len(later) > 1)}, {names}) with a copy of its log.jsonl to {branch}; nothing was deleted")


class OutDirLock:
    """One live run per --out-dir: rank 0 holds an exclusive flock on OUT/.lock, which names its pid
    and host for the refusal of a second run. The kernel drops the lock when the process ends, however
    it ends, so the file a killed run leaves blocks nothing; a run that ends normally removes it."""

    def __init__(self, out_dir: str):
        self.out_dir, self.path, self.file = out_dir, os.path.join(out_dir, ".lock"), None

    def acquire(self):
        try:
            import fcntl
        except ImportError:  # Windows
            return self._cannot_lock("no flock on this system")
        while True:
            f = open(self.path, "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                owner = f.read().strip() or "owner not yet recorded"
                f.close()
                raise UserError(f"--out-dir {self.out_dir} is in use by another training run ({owner}; it holds "
                                f"{self.path}): wait for it to end (then --resume continues it), or choose "
                                "another --out-dir") from None
            except OSError as e:  # a file system without locks (Lustre without -o flock)
                f.close()
                return self._cannot_lock(os_error_reason(e))
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    break
            f.close()  # a run that just ended removed this file after we opened it: lock the new one
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self.file = f

    def _cannot_lock(self, why: str):
        print0(f"note: cannot lock {self.path} ({why}): a second run on this --out-dir would not be stopped")

    def release(self):
        if self.file:
            with contextlib.suppress(OSError):
                os.remove(self.path)  # while still locked: whoever opens it next locks a new file
            self.file.close()
            self.file = None


def import_extra(module: str, flag: str, package: str):
    """An optional package, imported only when a flag asks for it: a UserError with the pip line if missing."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{flag} needs the {package} package: pip install {package}") from None


class TensorBoardSink:
    """--tensorboard: each record's numbers as scalars and its strings as text, tagged with their
    log.jsonl keys at the record's step, in event files in --out-dir. A resumed run hides what
    earlier attempts logged from its step on (purge_step), as log.jsonl is cut back there."""

    flag = "--tensorboard"

    def __init__(self, out_dir: str, purge_step: int | None):
        tensorboard = import_extra("torch.utils.tensorboard", "--tensorboard", "tensorboard")
        self.writer = tensorboard.SummaryWriter(out_dir, purge_step=purge_step)

    def write(self, record: dict):
        for key, value in record.items():
            if key != "step":
                add = self.writer.add_text if isinstance(value, str) else self.writer.add_scalar
                add(key, value, record["step"])

    def close(self):
        self.writer.close()


class WandbSink:
    """--wandb PROJECT: each record as a wandb.log at its step (W&B merges the records of one step
    into one row). WANDB_MODE=offline keeps the run in OUT/wandb for `wandb sync`. Each launch,
    a resume too, is a new W&B run that starts at its first step."""

    flag = "--wandb"

    def __init__(self, project: str, out_dir: str, config: dict):
        wandb = import_extra("wandb", "--wandb", "wandb")
        try:
            self.run = wandb.init(project=project, dir=out_dir, config=config)
        except Exception as e:  # no API key, no network, a bad project name...
            reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise UserError(f"--wandb: could not start a W&B run ({type(e).__name__}: {reason}); "
                            "run `wandb login` or set WANDB_MODE=offline") from None
        if getattr(self.run, "disabled", False):
            cli.print_warning("--wandb: W&B is disabled here (WANDB_MODE=disabled or WANDB_DISABLED), so the W&B "
                              "run stays empty; log.jsonl gets every record")

    def write(self, record: dict):
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self):
        self.run.finish()


def open_sinks(run, model_cfg, resumed_at: int | None) -> list:
    """The trackers the run asked for (a resumed one's from its step on: RunLog.resend_step)."""
    sinks = []
    if run.tensorboard:
        sinks.append(TensorBoardSink(run.out_dir, purge_step=resumed_at))
    if run.wandb:
        config = dict(run=dataclasses.asdict(run), model=dataclasses.asdict(model_cfg))
        sinks.append(WandbSink(run.wandb, run.out_dir, config))
    return sinks

def prepare_out_dir(out_dir: str):
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test_{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UserError(f"cannot write to --out-dir {out_dir}: {e.strerror}") from None

