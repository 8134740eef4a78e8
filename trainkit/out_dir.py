"""What a run writes into its --out-dir besides checkpoints, and who may write there: the lock
(one live run per folder, a flock on the folder itself), whose the folder is (claim_run: its
checkpoints must be of the resumed run's history, by run id), log.jsonl (one JSON record per
line, each naming its run, cut back exactly on resume, a copy of its own where it was shared),
branch folders (a resume from an earlier step sets the later checkpoints aside instead of
overwriting them, a fresh start the log of a run killed before its first checkpoint); the W&B /
TensorBoard sinks that get every record of the log are trainkit/run_trackers.py's.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import shutil
import stat

from trainkit import cli, json_file
from trainkit.atomic_write import fsync_dir, write_atomically
from trainkit.checkpoints import CKPT_NAME, checkpoint_step, list_checkpoints, same_file
from trainkit.resume import ResumePoint, in_history, log_summary, new_run, read_run, run_name
from trainkit.cli import UserError, reason_of
from trainkit.folder_lock import FolderLock
from trainkit.console import print0
from trainkit.own_files import move_entry, own_file, shared_as
from trainkit.run_trackers import open_sinks


class RunLog:
    """log.jsonl on rank 0: one JSON object per line, each with the "run" id of the run that wrote
    it (none for a run begun before run ids). Other ranks write nothing.

    Each record is one write, and a failed write (disk full) is cut back: the file always ends
    with a whole record. A checkpoint stores the log's length and the sha256 of its contents up
    to there (position()); resuming cuts the log back to that point (cut_back(), once a later
    branch has its copy) only when the log here is that run's log (an empty or missing log starts
    afresh), and refuses otherwise."""

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
        """Resuming: drop what the run logged after its checkpoint."""
        if self.file and self.resumed:
            try:
                self.file.truncate(self.size)
            except OSError as e:
                raise UserError(f"cannot cut {self.path} back to {self.resumed.path}: {reason_of(e)}") from None

    def write(self, **record):
        if self.file:
            mine = dict(record, run=self.run["id"]) if self.run and self.run["id"] else record
            self._append((json.dumps(strict_json_record(mine), allow_nan=False) + "\n").encode())
        for sink in list(self.sinks):
            self._to_sink(sink, f"at step {record['step']}", sink.write, record)

    def resend_step(self, step: int):
        """The sinks get the records of step that the log holds: a resumed run's step was evaluated
        before its checkpoint, so each tracker then holds what log.jsonl holds from that step on."""
        if not self.file:
            return
        with open(self.path, "rb") as f:
            for number, line in enumerate(f.read(self.size).splitlines(), start=1):
                record = json_file.parse(line, self.path, number)
                record.update(
                    {k: float(v) for k, v in record.pop("nonfinite", {}).items()}
                )  # strict_json_record undone
                record.pop("run", None)  # as write() sends them: a tracker has its own run
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
        """What a checkpoint taken now records of its run: the bytes of the log written so far and
        their sha256 (where a resume cuts the log back), and the run's identity."""
        return dict(log_offset=self.size, log_sha256=self.sha.hexdigest(), run=self.run)

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


def open_run_file(path: str, mode: str, **options):
    """open(path, mode) for a file a run folder holds (log.jsonl), where another program may have put
    a named pipe, a socket or a disk's block device: a UserError naming what it is, never a wait
    forever for a pipe's other end (the open does not block: O_NONBLOCK) nor writes onto a disk.
    A character device answers at once and stays allowed (/dev/null, /dev/full)."""
    # (a new file gets open()'s usual 0o666 less the umask: os.open's default mode is 0o777)
    f = open(path, mode, opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK, 0o666), **options)
    kind = os.fstat(f.fileno()).st_mode
    what = (
        "a named pipe (FIFO)"
        if stat.S_ISFIFO(kind)
        else "a socket"
        if stat.S_ISSOCK(kind)
        else "a block device"
        if stat.S_ISBLK(kind)
        else None
    )
    if what:
        f.close()
        raise UserError(
            f"{path} is {what}, not a regular file: a run would wait on it or write over it; remove it "
            "(the run makes its own), or choose another --out-dir"
        )
    return f


def read_log_up_to(path: str, resumed: ResumePoint | None) -> bytes:
    """What a run keeps of the log.jsonl at path: all of it, or resuming, its bytes up to the
    checkpoint's recorded (offset, sha256), when it is the log of the checkpoint's run (a missing or
    empty log is fine: a new one starts). Otherwise a UserError: cutting it would corrupt it."""
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
        change = (
            f"it holds {len(kept)} bytes, and was {resumed.log_offset} long then"
            if len(kept) < resumed.log_offset
            else f"its first {resumed.log_offset} bytes differ from then"
        )
        raise UserError(
            f"{path} is the log of {whose}, but not as it was when {resumed.path} was written ({change}): "
            "it was cut short or edited since, and resuming would cut it in the wrong place; restore it, "
            "or move it aside (the resume then starts a new log.jsonl)"
        )
    return kept


def claim_run(out_dir: str, resumed: ResumePoint | None) -> dict:
    """Rank 0, before anything in out_dir changes: the identity of the run about to write there. A
    fresh run gets a new one; a resume of out_dir's newest checkpoint (a requeued job) keeps its run's;
    any other resume is a branch, with a new id naming the checkpoint's run and step as its parent.
    Every checkpoint in out_dir must belong to that history: up to the resumed step, a state the
    resumed checkpoint went through; past it, a later branch that went through it (set aside next).
    Any other is another run's: a UserError naming both runs, whether or not a log.jsonl is there."""
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
                f"cannot resume {resumed.path} ({run_name(mine['id'])}, step {resumed.step}) in --out-dir "
                f"{out_dir}: its {os.path.basename(path)} is another run's ({run_name(theirs['id'])}), and "
                "one folder holds one run; resume into the --out-dir of the checkpoint's own run, or a "
                "new one"
            )
    continues = not later and same_file(os.path.dirname(resumed.path) or ".", out_dir)
    return mine if continues else new_run(mine, resumed.step)


def set_aside_later_branch(out_dir: str, step: int):
    """Resuming at `step` abandons what the run in out_dir did after it. Its later checkpoints move,
    with a copy of its log.jsonl if there is one, into a new out_dir/branch_NNNNNNN (the step that
    branch reached), a run folder of its own (--resume works on it): nothing is deleted or
    overwritten, --keep-last no longer counts them, and a plain --resume in out_dir continues the
    new branch. (claim_run and RunLog have checked that they and the log are this run's.)"""
    later = [p for p in list_checkpoints(out_dir) if checkpoint_step(p) > step]
    if not later:
        return
    log = os.path.join(out_dir, "log.jsonl")
    branch = new_branch_folder(out_dir, checkpoint_step(later[-1]))
    copied = os.path.isfile(log) and os.path.getsize(log) > 0  # (RunLog may just have made it, empty)
    try:
        if copied:
            with open(log, "rb") as source:
                write_atomically(
                    os.path.join(branch, "log.jsonl"),
                    lambda f: shutil.copyfileobj(source, f),
                    fsync_file=True,
                    fsync_folder=False,
                )  # (the folder's fsync follows)
        for path in later:
            move_entry(path, os.path.join(branch, os.path.basename(path)))  # (a symbolic link stays one)
        fsync_dir(branch)
        fsync_dir(out_dir)
    except OSError as e:
        raise UserError(
            f"could not move the later checkpoints of {out_dir} into {branch}: {reason_of(e)} (nothing was deleted)"
        ) from None
    names = os.path.basename(later[0]) + (f" ... {os.path.basename(later[-1])}" if len(later) > 1 else "")
    print0(
        f"resuming at step {step}: moved the later branch of this run ({len(later)} checkpoint"
        f"{'s' * (len(later) > 1)}, {names}){' with a copy of its log.jsonl' * copied} to {branch}; "
        "nothing was deleted"
    )


def new_branch_folder(out_dir: str, reached: int) -> str:
    """A new folder out_dir/branch_NNNNNNN for what a run did up to step `reached`, under a name no
    earlier branch took (branch_NNNNNNN_2, ...)."""
    branch = os.path.join(out_dir, f"branch_{reached:07d}")
    for n in itertools.count(2):
        try:
            os.mkdir(branch)
            return branch
        except FileExistsError:
            branch = os.path.join(out_dir, f"branch_{reached:07d}_{n}")


def set_aside_log_without_checkpoint(out_dir: str):
    """A run that starts afresh in out_dir (no checkpoint there to resume) where log.jsonl holds records:
    a run killed before its first checkpoint (out of memory, preempted), whose job is run again. A log
    with trained steps moves into a new out_dir/branch_NNNNNNN (the steps it reached), as a later branch
    does: nothing is deleted, and the same command starts again; a log without one (a run that stopped
    before its first step) holds nothing to keep and starts afresh. (choose_resume_checkpoint has refused
    a log.jsonl that is not a log.)"""
    log = os.path.join(out_dir, "log.jsonl")
    if not (os.path.isfile(log) and os.path.getsize(log)):
        return
    _, whose, _, trained = log_summary(log)
    try:
        if not trained:
            os.remove(log)  # (the name only: a file it shared keeps its bytes)
            print0(
                f"note: {log} holds no trained step (of {whose}, which stopped before its first step): "
                "this run starts it afresh"
            )
            return
        reached = last_trained_step(log) + 1
        branch = new_branch_folder(out_dir, reached)
        move_entry(log, os.path.join(branch, "log.jsonl"))
        fsync_dir(branch)
        fsync_dir(out_dir)
    except OSError as e:
        raise UserError(f"could not move {log} aside: {reason_of(e)} (nothing was deleted)") from None
    print0(
        f"note: {log} holds {reached} trained step{'s' * (reached > 1)} of {whose} but no checkpoint (it stopped "
        f"before its first): moved to {branch}/log.jsonl, nothing was deleted; this run starts afresh"
    )


def last_trained_step(path: str) -> int:
    """The step of the last record with a loss in the log.jsonl at path (log_summary found one)."""
    last = 0
    with open(path, "rb") as f:
        for line in f:
            with contextlib.suppress(ValueError, RecursionError):
                record = json.loads(line)
                if isinstance(record, dict) and "loss" in record and type(record.get("step")) is int:
                    last = record["step"]
    return last


def open_run_log(run, model_cfg, resumed: ResumePoint | None) -> RunLog:
    """Rank 0, for a run that trains: its identity, log.jsonl and trackers. Every check comes before
    the first change to the folder: whose its checkpoints are (claim_run), the trackers (a W&B
    without a login), the log (whose it is, whether it opens); only then does the later branch move
    aside and the log get cut back to the checkpoint. (A fresh run sets aside the log of a run killed
    before its first checkpoint just before its own opens; a log shared with another folder is copied
    as it opens: own_files.own_file.)"""
    identity = claim_run(run.out_dir, resumed)
    if resumed and identity["id"] == resumed.run["id"] and shared_as(os.path.join(run.out_dir, "log.jsonl")):
        identity = new_run(resumed.run, resumed.step)  # a copied run folder (cp -al) goes on as a branch of its run
    sinks = open_sinks(run, model_cfg, resumed.step if resumed else None)
    if resumed is None:
        set_aside_log_without_checkpoint(run.out_dir)
    log = RunLog(run.out_dir, True, resumed, identity)  # (after the sinks: a W&B that cannot start leaves
    log.sinks = sinks  # no empty log.jsonl behind)
    try:
        if resumed:
            set_aside_later_branch(run.out_dir, resumed.step)
        log.cut_back()
    except UserError:
        log.close()
        raise
    if resumed:
        log.resend_step(resumed.step)
        log.write(event="resume", step=resumed.step)  # plot_log.py marks it on the curves
    return log


class OutDirLock(FolderLock):
    """One live run per --out-dir (trainkit/folder_lock.py's FolderLock, as fineweb.py holds its own --out-dir): rank 0
    takes it once the input checks out, and the refusal of a second run says how to continue the first."""

    writer = "this trainer"

    def __init__(self, out_dir: str):
        super().__init__(out_dir)
        self.made = False  # the folder was made by this run: one it left empty (a refused resume) goes again

    def in_use(self, holder: str) -> str:
        return (
            f"--out-dir {self.folder} is in use by another training run ({holder}; it holds a lock on the "
            "folder): wait for it to end (then --resume continues it), or choose another --out-dir"
        )

    def note(self, line: str):
        print0(line)

    def release(self):
        held = self.fd is not None
        super().release()
        if held and self.made:
            with contextlib.suppress(OSError):  # (fails unless empty)
                os.rmdir(self.folder)


def prepare_out_dir(out_dir: str) -> bool:
    """Make --out-dir if needed and check it is writable: whether it was made now (OutDirLock.release
    removes it again if the run wrote nothing there)."""
    made = not os.path.lexists(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(
            f"--out-dir {out_dir} is a file, not a folder: a run writes its checkpoints and log.jsonl "
            "into a folder; choose another --out-dir"
        )
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test_{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UserError(f"cannot write to --out-dir {out_dir}: {reason_of(e)}") from None
    for name in sorted(filter(CKPT_NAME.fullmatch, os.listdir(out_dir))):
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path):  # --keep-last would fail to delete it mid-run, a save to write over it
            what = (
                "a folder"
                if os.path.isdir(path)
                else "a symbolic link to nothing"
                if os.path.islink(path)
                else "not a regular file"
            )
            raise UserError(
                f"--out-dir {out_dir} holds {name}, {what} named as this trainer names its "
                "checkpoints: --resume, --keep-last and the save of its step would take it for one; "
                "rename it, or choose another --out-dir"
            )
    return made
