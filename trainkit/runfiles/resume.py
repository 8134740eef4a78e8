"""What --resume continues and whether it may, and the branch folders (out_dir/branch_NNNNNNN) that keep,
nothing deleted, what a run would otherwise overwrite. docs/resume-and-failures.md tells the guarantees."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import uuid
from dataclasses import dataclass

import torch

from trainkit import fileio
from trainkit.cli import UserError, print0, reason_of
from trainkit.data.shards import differing_file, shard_files
from trainkit.fileio import fsync_dir, move_entry, open_regular, pinned, shared_as, write_atomically
from trainkit.runfiles.checkpoint_checks import RESUME_KEYS, run_problem
from trainkit.runfiles.checkpoints import checkpoint_step, latest_checkpoint, list_checkpoints

# --- what --resume continues ----------------------------------------------------------------------


def new_run(branched_from: dict | None = None, step: int | None = None) -> dict:
    """A run's identity: a random 128-bit id, and for a branch {**its parent's identity, "step": step}."""
    return dict(id=uuid.uuid4().hex, parent=dict(branched_from, step=step) if branched_from else None)


def run_name(run_id: str | None) -> str:
    return f"run {run_id}" if run_id else "no run (its records name none: not a log this trainer wrote)"


def read_run(path: str) -> dict | None:
    """The run identity in checkpoint path, its tensors memory-mapped, not read; None where it cannot be read."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    run = ckpt.get("run") if isinstance(ckpt, dict) else None
    return run if run is not None and not run_problem(run) else None


def log_summary(path: str) -> tuple[str | None, str, bool, int | None]:
    """The log.jsonl at path's last "run", whose it is in words, whether it has a record, its last trained step."""
    last, trained, any_record = None, None, False
    with open_regular(path) as f:
        for line in f:
            with contextlib.suppress(fileio.JSONFileError):  # a line cut by a crash; a file of the user's
                record = fileio.parse_json(line, path)
                if isinstance(record, dict):
                    any_record, last = True, record.get("run")
                    if "loss" in record:
                        trained = record["step"] if type(record.get("step")) is int else trained or 0
    words = run_name(last) if any_record else "no run (no line of it is a JSON record: not a log this trainer wrote)"
    return last, words, any_record, trained


@dataclass
class ResumePoint:
    """Where a resumed run takes up its checkpoint's run: the file, its step, the log's length and sha256 then."""

    path: str
    step: int
    log_offset: int
    log_sha256: str
    run: dict

    @classmethod
    def of(cls, path: str, ckpt: dict) -> ResumePoint:
        return cls(path, ckpt["step"], ckpt["log_offset"], ckpt["log_sha256"], ckpt["run"])


def in_history(run_id: str | None, step: int, run: dict, at_step: int) -> bool:
    """Whether the state of run_id at step is one that `run` (or its parents) went through to at_step."""
    until = at_step
    while run is not None:
        if run["id"] == run_id and step <= until:
            return True
        run = run["parent"]
        until = min(until, run["step"]) if run else until
    return False


def find_resume_checkpoint(run) -> str | None:
    """The checkpoint --resume names: the newest in --out-dir ("latest") or in a given folder, or a file."""
    if run.resume is None:
        return None
    if run.resume == "latest":
        return latest_checkpoint(run.out_dir)
    if os.path.isdir(run.resume):
        return latest_checkpoint(run.resume) or run.resume  # (load_checkpoint says there is none)
    return run.resume


def choose_resume_checkpoint(run) -> str | None:
    """Rank 0, holding the lock: the checkpoint to resume (None: from scratch, where that mixes no runs)."""
    if path := find_resume_checkpoint(run):
        return path
    found = list_checkpoints(run.out_dir)
    if run.resume is None and found:
        owner = read_run(found[-1])
        of_run = f" of {run_name(owner['id'])}" if owner else ""
        raise UserError(
            f"--out-dir {run.out_dir} already holds checkpoints{of_run}: pass --resume to continue "
            "that run, or choose another --out-dir"
        )
    log = os.path.join(run.out_dir, "log.jsonl")
    if os.path.isfile(log) and os.path.getsize(log):
        _, whose, is_log, _ = log_summary(log)
        if not is_log:  # a file of the user's (a log of a run killed before its first checkpoint is set aside)
            raise UserError(
                f"--out-dir {run.out_dir} holds a log.jsonl of {whose} but no checkpoint to resume: "
                "move the log aside to start a new run there, or choose another --out-dir"
            )
    if run.resume is not None:
        print0(f"--resume: no checkpoint in {run.out_dir}, starting from scratch")
    return None


def data_change(saved: dict, now: dict) -> str | None:
    """How the shards of a checkpoint's run (data_files) and this run's differ, in words; None when they match."""
    for split in ("train", "val"):
        difference = saved[split] is not None and now[split] is not None and differing_file(saved[split], now[split])
        if difference:
            name, then, today = difference
            return f"{split} shard {name}: {then} then, {today} now"
    return None


def data_files(train_paths: list[str], val_paths: list[str] | None) -> dict:
    """The shards a run reads (names, sizes, contents, in order), kept by a checkpoint for data_change."""
    return dict(train=shard_files(train_paths), val=shard_files(val_paths) if val_paths else None)


def check_resume_compatible(ckpt: dict, run, model_cfg, path: str):
    """Refuse a resume whose model, rows or optimizer differ from the checkpoint's (run: as resolved)."""
    pairs = [(k, v, getattr(model_cfg, k)) for k, v in ckpt["model_config"].items()]
    pairs += [(k, ckpt["run_config"][k], getattr(run, k)) for k in RESUME_KEYS]
    diffs = [f"{k}: checkpoint {then} vs now {now}" for k, then, now in pairs if then != now]
    if diffs:
        raise UserError(
            f"cannot resume from {path}: {'; '.join(diffs)}. Use the same model, batch and "
            "optimizer flags (the number of GPUs may change)"
        )


def eval_checkpoint(run) -> str | None:
    """--eval-only's checkpoint: --resume's (None: --init-from's weights are evaluated)."""
    path = find_resume_checkpoint(run)
    if run.resume is not None and not path:
        raise UserError(f"--eval-only --resume: no checkpoint (ckpt_*.pt) in --out-dir {run.out_dir}")
    return path


# --- branch folders -------------------------------------------------------------------------------


def later_checkpoints(out_dir: str, step: int) -> list[str]:
    """The checkpoints in out_dir past step, oldest first: the later branch a resume at step sets aside."""
    return [p for p in list_checkpoints(out_dir) if checkpoint_step(p) > step]


def check_later_branch(out_dir: str, step: int):
    """Before anything changes: a UserError where setting the later branch aside would fail part way."""
    later = later_checkpoints(out_dir, step)
    for path in later:
        if held := pinned(path):
            raise UserError(
                f"cannot resume at step {step} in {out_dir}: {path}, of the later branch that the resume moves "
                f"into a branch folder, is {held} and cannot be moved; clear that attribute, or resume "
                "into another --out-dir (nothing was changed)"
            )
    log = os.path.join(out_dir, "log.jsonl")
    if later and os.path.isfile(log):
        need = os.path.getsize(log) * (2 if shared_as(log) else 1)
        try:
            st = os.statvfs(out_dir)
        except (OSError, AttributeError):  # (no statvfs: the copy itself says so)
            return
        free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize  # (root may use the reserve)
        if free < need:
            raise UserError(
                f"cannot resume at step {step} in {out_dir}: the later branch moves into a branch folder with "
                f"a copy of {log} ({need:,} bytes), and {out_dir} has {free:,} bytes free; free space, then run "
                "the same command again (nothing was changed)"
            )


def set_aside_later_branch(out_dir: str, step: int):
    """Resuming at `step`: the later checkpoints, with a copy of log.jsonl, move into a new branch folder."""
    later = later_checkpoints(out_dir, step)
    if not later:
        return
    log = os.path.join(out_dir, "log.jsonl")
    copied = os.path.isfile(log) and os.path.getsize(log) > 0  # (RunLog may just have made it, empty)
    moved = lambda branch: f"the later checkpoints of {out_dir} into {branch}"
    branch = move_into_branch(out_dir, checkpoint_step(later[-1]), later, copied, moved)
    names = os.path.basename(later[0]) + (f" ... {os.path.basename(later[-1])}" if len(later) > 1 else "")
    print0(
        f"resuming at step {step}: moved the later branch of this run ({len(later)} checkpoint"
        f"{'s' * (len(later) > 1)}, {names}){' with a copy of its log.jsonl' * copied} to {branch}; "
        "nothing was deleted"
    )


def move_into_branch(out_dir: str, reached: int, paths: list[str], copy_log: bool, moved) -> str:
    """A new folder out_dir/branch_NNNNNNN (reached) with paths moved in (and a copy of log.jsonl); an OSError
    removes it where still empty and is a UserError saying what moved(branch) failed to move."""
    branch = os.path.join(out_dir, f"branch_{reached:07d}")
    try:
        for n in itertools.count(2):
            try:
                os.mkdir(branch)
                break
            except FileExistsError:
                branch = os.path.join(out_dir, f"branch_{reached:07d}_{n}")
        if copy_log:
            with open(os.path.join(out_dir, "log.jsonl"), "rb") as source:
                copy = lambda f: shutil.copyfileobj(source, f)
                write_atomically(os.path.join(branch, "log.jsonl"), copy, fsync_file=True, fsync_folder=False)
        for path in paths:
            move_entry(path, os.path.join(branch, os.path.basename(path)))
        fsync_dir(branch)
        fsync_dir(out_dir)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.rmdir(branch)  # (where nothing was moved into it yet)
        raise UserError(f"could not move {moved(branch)}: {reason_of(e)} (nothing was deleted)") from None
    return branch


def set_aside_log_without_checkpoint(out_dir: str):
    """A fresh start over a log.jsonl without checkpoint: moved into a branch folder (removed if untrained)."""
    log = os.path.join(out_dir, "log.jsonl")
    if not (os.path.isfile(log) and os.path.getsize(log)):
        return
    _, whose, _, trained = log_summary(log)
    if held := pinned(log):  # (before the branch folder is made: a refusal changes nothing)
        raise UserError(
            f"cannot start a new run in {out_dir}: {log}, of {whose} (stopped before its first checkpoint), is "
            f"{held} and cannot be set aside; clear that attribute, or choose another --out-dir (nothing was changed)"
        )
    if trained is not None:
        branch = move_into_branch(out_dir, trained + 1, [log], False, lambda branch: f"{log} aside")
        print0(
            f"note: {log} holds {trained + 1} trained step{'s' * (trained > 0)} of {whose} but no checkpoint (it "
            f"stopped before its first): moved to {branch}/log.jsonl, nothing was deleted; this run starts afresh"
        )
        return
    try:
        os.remove(log)  # (the name only: a file it shared keeps its bytes)
    except OSError as e:
        raise UserError(f"could not move {log} aside: {reason_of(e)} (nothing was deleted)") from None
    print0(
        f"note: {log} holds no trained step (of {whose}, which stopped before its first step): "
        "this run starts it afresh"
    )
