"""A run's folder (--out-dir): made, locked (OutDirLock) and claimed for one run's history (claim_run), and its
log.jsonl (RunLog) with the --wandb / --tensorboard trackers. docs/resume-and-failures.md tells the guarantees."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import stat

from trainkit import cli, fileio
from trainkit.cli import UserError, check_a_thread_starts, optional_import, print0, reason_of
from trainkit.fileio import FolderLock, create_fresh, own_file, pinned, remove_if_same, shared_as
from trainkit.runfiles.checkpoints import CKPT_NAME, checkpoint_step, list_checkpoints, same_file
from trainkit.runfiles.resume import (
    ResumePoint,
    check_later_branch,
    choose_resume_checkpoint,
    in_history,
    log_summary,
    new_run,
    read_run,
    run_name,
    set_aside_later_branch,
    set_aside_log_without_checkpoint,
)

# --- the run folder -------------------------------------------------------------------------------


def claim_run(out_dir: str, resumed: ResumePoint | None) -> dict:
    """Rank 0, before anything in out_dir changes: the identity of the run about to write there; a checkpoint
    in out_dir that is not of its history (before the step, one it went through; past it, a later branch) is refused."""
    if resumed is None:
        return new_run()
    mine, later = resumed.run, False
    for path in list_checkpoints(out_dir):
        if same_file(path, resumed.path):
            continue
        theirs, step = read_run(path), checkpoint_step(path)
        later |= step > resumed.step
        if theirs and not (
            in_history(theirs["id"], step, mine, resumed.step)
            if step <= resumed.step
            else in_history(mine["id"], resumed.step, theirs, step)
        ):
            raise UserError(
                f"cannot resume {resumed.path} ({run_name(mine['id'])}, step {resumed.step}) in --out-dir {out_dir}: "
                f"its {os.path.basename(path)} is another run's ({run_name(theirs['id'])}), and one folder holds one "
                "run; resume into the --out-dir of the checkpoint's own run, or a new one"
            )
    continues = not later and same_file(os.path.dirname(resumed.path) or ".", out_dir)
    return mine if continues else new_run(mine, resumed.step)


def open_run_log(run, model_cfg, resumed: ResumePoint | None) -> RunLog:
    """Rank 0, for a run that trains: its identity, log.jsonl and trackers, every check before the first change
    to the folder (then the later branch moves aside and the log is cut back to the checkpoint)."""
    check_a_thread_starts()
    identity = claim_run(run.out_dir, resumed)
    if resumed and identity["id"] == resumed.run["id"] and shared_as(os.path.join(run.out_dir, "log.jsonl")):
        identity = new_run(resumed.run, resumed.step)  # a copied run folder (cp -al) goes on as a branch of its run
    sinks = open_sinks(run, model_cfg, resumed.step if resumed else None)
    if resumed is None:
        set_aside_log_without_checkpoint(run.out_dir)  # (its checks first)
    else:
        check_later_branch(run.out_dir, resumed.step)  # movable, and space for the log's copy
    log = RunLog(run.out_dir, True, resumed, identity)  # (after the sinks: no empty log where W&B cannot start)
    log.sinks = sinks
    try:
        if resumed:
            set_aside_later_branch(run.out_dir, resumed.step)
        log.cut_back()
    except UserError:
        log.close()
        raise
    if resumed:
        log.resend_step(resumed.step)
        branch = {} if identity["id"] == resumed.run["id"] else {"parent": resumed.run["id"]}
        log.write(event="resume", step=resumed.step, **branch)  # plot_log.py marks it on the curves
    return log


class OutDirLock(FolderLock):
    """One live run per --out-dir (fileio.FolderLock), taken by rank 0 once the input checks out."""

    writer = "this trainer"
    moved_as = ("this run", "nothing of this run")
    in_use_as = ("in use by another training run", " (then --resume continues it)")
    note = staticmethod(print0)
    made = False  # the folder was made by this run: one it left empty (a refused resume) goes again

    def check_claimed(self, last_checkpoint: str | None):
        """Rank 0, before the log opens and each checkpoint: check_held, naming the last checkpoint where it is now."""
        where = (self.moved_to() or ("unknown",))[0]
        if last_checkpoint and where != "unknown":
            last_checkpoint = os.path.join(where, os.path.basename(last_checkpoint))
        self.check_held(f". Last good checkpoint: {last_checkpoint or 'none'}")

    def release(self):
        held = self.fd is not None
        super().release()
        if held and self.made:  # (the folder it holds, never one put at its name since)
            remove_if_same(self.folder, self.identity)


# the names a run writes a file through (atomic_write's temporary files: checkpoints, log.jsonl's own copy)
_WRITTEN_THROUGH = re.compile(rf"(?:{CKPT_NAME.pattern}|log\.jsonl)\.tmp")


def prepare_out_dir(out_dir: str) -> bool:
    """Make --out-dir if needed and check it is writable: whether it was made now (removed again if left empty)."""
    made = not os.path.lexists(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(
            f"--out-dir {out_dir} is a file, not a folder: a run writes its checkpoints and log.jsonl "
            "into a folder; choose another --out-dir"
        )
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test_{os.getpid()}")
        os.close(create_fresh(probe))  # (a link planted at the name is replaced, never opened)
        os.remove(probe)
    except OSError as e:
        raise UserError(f"cannot write to --out-dir {out_dir}: {reason_of(e)}") from None
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        if CKPT_NAME.fullmatch(name) and not os.path.isfile(path):  # --keep-last would fail to delete it
            what = "a symbolic link to nothing" if os.path.islink(path) else "not a regular file"
            what = "a folder" if os.path.isdir(path) else what  # (mid-run, a save to write over it)
            raise UserError(
                f"--out-dir {out_dir} holds {name}, {what} named as this trainer names its checkpoints: --resume, "
                "--keep-last and the save of its step would take it for one; rename it, or choose another --out-dir"
            )
        if _WRITTEN_THROUGH.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
            raise UserError(  # (a file or a link there is replaced: fileio.create_fresh; a folder is not)
                f"--out-dir {out_dir} holds a folder {name}, at the name this trainer writes a new "
                f"{name.removesuffix('.tmp')} through: that write would fail, after the steps before it were "
                "trained; move it away, or choose another --out-dir"
            )
    return made


def claim_out_dir(run, out_dir_lock: OutDirLock) -> str | None:
    """Rank 0: make --out-dir, lock it for this run, and pick the checkpoint to resume."""
    out_dir_lock.made = prepare_out_dir(run.out_dir)
    out_dir_lock.acquire()
    return choose_resume_checkpoint(run)


# --- log.jsonl ------------------------------------------------------------------------------------


class RunLog:
    """log.jsonl on rank 0: one JSON record per line naming its run; a failed write is cut back to the last."""

    sinks = ()  # run trackers that get every record too (open_sinks)

    def __init__(self, out_dir: str, enabled: bool, resumed: ResumePoint | None = None, run: dict | None = None):
        self.path, self.file, self.run, self.resumed = os.path.join(out_dir, "log.jsonl"), None, run, resumed
        self.last_checkpoint = resumed.path if resumed else None  # named when a write fails
        self.size, self.sha = 0, hashlib.sha256()
        if not enabled:
            return
        if os.path.islink(self.path) and not os.path.exists(self.path):  # open() would create its target
            raise UserError(
                f"cannot open {self.path}: it is a symbolic link to {os.readlink(self.path)}, which "
                "does not exist; remove the link or point it at a file"
            )
        try:
            kept = read_log_up_to(self.path, resumed)
            held = resumed and not shared_as(self.path) and pinned(self.path)  # (a shared log is cut as a copy)
            if held and os.path.getsize(self.path) > len(kept):  # (before anything in the folder changes)
                raise UserError(
                    f"cannot cut {self.path} back to {resumed.path}: it is {held}; clear that attribute, or move "
                    "it aside (the resume then starts a new log.jsonl) (nothing was changed)"
                )
            note = own_file(self.path)  # a log shared with another run folder: this run appends to its own copy
            self.file = open_run_file(self.path, "ab", buffering=0)  # unbuffered: one write per record
        except OSError as e:
            raise UserError(
                f"cannot open {self.path}: {reason_of(e)}; make it a writable file, or choose another --out-dir"
            ) from None
        if note:
            print0(note)
        self.size = len(kept)
        self.sha.update(kept)

    def cut_back(self):
        """Resuming: drop what the run logged after its checkpoint (an append-only log that ends there resumes)."""
        if self.resumed:
            try:
                if os.fstat(self.file.fileno()).st_size > self.size:
                    self.file.truncate(self.size)
            except OSError as e:
                raise UserError(f"cannot cut {self.path} back to {self.resumed.path}: {reason_of(e)}") from None

    def write(self, **record):
        if self.file:
            mine = dict(record, run=self.run["id"]) if self.run else record
            self._append((json.dumps(strict_json_record(mine), allow_nan=False) + "\n").encode())
        for sink in list(self.sinks):
            self._to_sink(sink, f"at step {record['step']}", sink.write, record)

    def resend_step(self, step: int):
        """The sinks get the log's records of step (evaluated before the checkpoint a run resumes at)."""
        with open(self.path, "rb") as f:
            for number, line in enumerate(f.read(self.size).splitlines(), start=1):
                record = fileio.parse_json(line, self.path, number)
                record |= {k: float(v) for k, v in record.pop("nonfinite", {}).items()}  # strict_json_record undone
                record.pop("run", None)  # as write() sends them: a tracker has its own run
                if record["step"] == step:
                    for sink in list(self.sinks):
                        self._to_sink(sink, f"at step {step}", sink.write, record)

    def _to_sink(self, sink, when: str, call, *args):
        """A run tracker that fails gets no more records, with a warning: training and log.jsonl go on."""
        try:
            call(*args)
        except Exception as e:
            self.sinks = [s for s in self.sinks if s is not sink]
            cli.print_warning(
                f"{sink.flag} failed {when} ({reason_of(e, typed=True)}) and gets no more "
                f"records; {self.path} has them all"
            )

    def _append(self, data: bytes):
        try:
            view = memoryview(data)
            while view:  # a short write means the disk filled mid-record: the next write says why
                view = view[self.file.write(view) :]
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
        raise UserError(
            f"cannot write {self.path}: {reason_of(e)} (the log ends at its last whole record). "
            f"Last good checkpoint: {self.last_checkpoint or 'none'}"
        ) from None

    def position(self) -> dict:
        """What a checkpoint records of its run: the log's length and sha256 so far, and the run's identity."""
        return dict(log_offset=self.size, log_sha256=self.sha.hexdigest(), run=self.run)

    def close(self):
        if self.file:
            self.file.close()
        for sink in list(self.sinks):
            self._to_sink(sink, "at the end", sink.close)


def strict_json_record(record: dict) -> dict:
    """record with NaN and infinities as null, listed under "nonfinite" (strict JSON readers reject them)."""
    bad = {k: str(v) for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
    return {**record, **dict.fromkeys(bad), "nonfinite": bad} if bad else record


def open_run_file(path: str, mode: str, **options):
    """open(path, mode) for log.jsonl, never blocking: a pipe, socket or block device is a UserError."""
    f = open(path, mode, opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK, 0o666), **options)
    kind = os.fstat(f.fileno()).st_mode
    if what := (None if stat.S_ISCHR(kind) else fileio.file_kind(kind)):
        f.close()
        raise UserError(
            f"{path} is {what}, not a regular file: a run would wait on it or write over it; remove it "
            "(the run makes its own), or choose another --out-dir"
        )
    return f


def read_log_up_to(path: str, resumed: ResumePoint | None) -> bytes:
    """The bytes of log.jsonl a run keeps: all, or resuming, those up to its checkpoint's; else a UserError."""
    try:
        with open_run_file(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size  # (0 for a device: /dev/full reads zeros forever)
            kept = f.read(min(resumed.log_offset, size) if resumed else size)
    except FileNotFoundError:
        return b""
    if resumed and kept and (len(kept) != resumed.log_offset or hashlib.sha256(kept).hexdigest() != resumed.log_sha256):
        last, whose, _, _ = log_summary(path)
        if last != resumed.run["id"]:
            raise UserError(
                f"{path} is not the log of the run that wrote {resumed.path} (the log is of {whose}, the "
                f"checkpoint of {run_name(resumed.run['id'])}): resuming would corrupt it; resume into "
                "the --out-dir of the checkpoint's own run, or a new one"
            )
        change = f"its first {resumed.log_offset} bytes differ from then"
        if len(kept) < resumed.log_offset:
            change = f"it holds {len(kept)} bytes, and was {resumed.log_offset} long then"
        raise UserError(
            f"{path} is the log of {whose}, but not as it was when {resumed.path} was written ({change}): "
            "it was cut short or edited since, and resuming would cut it in the wrong place; restore it, "
            "or move it aside (the resume then starts a new log.jsonl)"
        )
    return kept


# --- the run trackers -----------------------------------------------------------------------------


class TensorBoardSink:
    """--tensorboard: numbers as scalars, strings as text, at each record's step; purge_step as log.jsonl is cut."""

    flag = "--tensorboard"

    def __init__(self, out_dir: str, purge_step: int | None):
        tensorboard = optional_import(
            "torch.utils.tensorboard", "--tensorboard needs the tensorboard package: pip install tensorboard"
        )
        self.writer = tensorboard.SummaryWriter(out_dir, purge_step=purge_step)

    def write(self, record: dict):
        for key, value in record.items():
            if key != "step":
                add = self.writer.add_text if isinstance(value, str) else self.writer.add_scalar
                add(key, value, record["step"])

    def close(self):
        self.writer.close()


class WandbSink:
    """--wandb PROJECT: each record as a wandb.log at its step; each launch, a resume too, is a new W&B run."""

    flag = "--wandb"

    def __init__(self, project: str, out_dir: str, config: dict):
        wandb = optional_import("wandb", "--wandb needs the wandb package: pip install wandb")
        try:
            self.run = wandb.init(project=project, dir=out_dir, config=config)
        except Exception as e:  # no API key, no network, a bad project name...
            raise UserError(
                f"--wandb: could not start a W&B run ({reason_of(e, typed=True)}); "
                "run `wandb login` or set WANDB_MODE=offline"
            ) from None
        if getattr(self.run, "disabled", False):
            cli.print_warning(
                "--wandb: W&B is disabled here (WANDB_MODE=disabled or WANDB_DISABLED), so the W&B "
                "run stays empty; log.jsonl gets every record"
            )

    def write(self, record: dict):
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self):
        self.run.finish()


def open_sinks(run, model_cfg, resumed_at: int | None) -> list:
    """The trackers the run asked for (a resumed one's from its step on)."""
    sinks = []
    if run.tensorboard:
        sinks.append(TensorBoardSink(run.out_dir, purge_step=resumed_at))
    if run.wandb:
        config = dict(run=dataclasses.asdict(run), model=dataclasses.asdict(model_cfg))
        sinks.append(WandbSink(run.wandb, run.out_dir, config))
    return sinks
