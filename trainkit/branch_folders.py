"""Branch folders: what a run would otherwise overwrite, moved into a new run folder out_dir/branch_NNNNNNN,
nothing deleted: the checkpoints after a resume's step, and the log of a run killed before its first
checkpoint when the same command starts afresh.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil

from trainkit.atomic_write import fsync_dir, write_atomically
from trainkit.checkpoints import checkpoint_step, list_checkpoints
from trainkit.resume import log_summary
from trainkit.cli import UserError, reason_of
from trainkit.console import print0
from trainkit.own_files import move_entry, pinned, shared_as


def later_checkpoints(out_dir: str, step: int) -> list[str]:
    """The checkpoints in out_dir past step, oldest first: the later branch a resume at step sets aside."""
    return [p for p in list_checkpoints(out_dir) if checkpoint_step(p) > step]


def check_later_branch(out_dir: str, step: int):
    """Before anything in out_dir changes: a UserError where setting the later branch aside would fail part
    way (a checkpoint held by chattr +a or +i, too little space for the copies of log.jsonl)."""
    later = later_checkpoints(out_dir, step)
    for path in later:
        held = pinned(path)
        if held:
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
    """Resuming at `step`: the later checkpoints, with a copy of log.jsonl, move into a new
    out_dir/branch_NNNNNNN (the step it reached), a run folder --resume works on; nothing is deleted, and a
    failed copy leaves no branch folder behind (check_later_branch has checked that they can move)."""
    later = later_checkpoints(out_dir, step)
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
        with contextlib.suppress(OSError):
            os.rmdir(branch)  # (where nothing was moved into it yet)
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
    """A new folder out_dir/branch_NNNNNNN (reached), under a name no earlier branch took (..._2, ...)."""
    branch = os.path.join(out_dir, f"branch_{reached:07d}")
    for n in itertools.count(2):
        try:
            os.mkdir(branch)
            return branch
        except FileExistsError:
            branch = os.path.join(out_dir, f"branch_{reached:07d}_{n}")


def set_aside_log_without_checkpoint(out_dir: str):
    """A fresh start in out_dir over the log.jsonl of a run killed before its first checkpoint: a log with
    trained steps moves into a new branch folder, nothing deleted; one without any is removed."""
    log = os.path.join(out_dir, "log.jsonl")
    if not (os.path.isfile(log) and os.path.getsize(log)):
        return
    _, whose, _, trained = log_summary(log)
    held = pinned(log)
    if held:  # (before the branch folder is made: a refusal changes nothing)
        raise UserError(
            f"cannot start a new run in {out_dir}: {log}, of {whose} (stopped before its first checkpoint), is "
            f"{held} and cannot be set aside; clear that attribute, or choose another --out-dir (nothing was changed)"
        )
    branch = None
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
        if branch:
            with contextlib.suppress(OSError):
                os.rmdir(branch)  # (where the log did not move into it)
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
