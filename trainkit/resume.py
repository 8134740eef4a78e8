"""What --resume continues and whether it may: the run identity each checkpoint carries (whose it is, and
for a branch, whose branch), a log's summary, the checkpoint a resume chooses, and what a resume must keep
of the run it continues.
"""

from __future__ import annotations

import contextlib
import math
import os
import uuid
from dataclasses import dataclass

import torch

from trainkit import json_file
from trainkit.checkpoint_checks import RESUME_KEYS, run_problem
from trainkit.checkpoints import latest_checkpoint, list_checkpoints
from trainkit.cli import UserError
from trainkit.console import print0
from trainkit.regular_file import open_regular
from trainkit.shard_identity import differing_file, shard_files


def new_run(branched_from: dict | None = None, step: int | None = None) -> dict:
    """A run's identity: a random 128-bit id, and for a branch its parent run's identity and the
    step it branched at (parent: {**parent's identity, "step": step}), back to the first run."""
    parent = dict(branched_from, step=step) if branched_from else None
    return dict(id=uuid.uuid4().hex, parent=parent)


def run_name(run_id: str | None) -> str:
    return f"run {run_id}" if run_id else "no run (its records name none: not a log this trainer wrote)"


def read_run(path: str) -> dict | None:
    """The run identity in checkpoint path, read without loading its tensors (they stay memory-mapped);
    None where it cannot be read (damaged, removed meanwhile, not ours: loading it says why)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    run = ckpt.get("run") if isinstance(ckpt, dict) else None
    return run if run is not None and not run_problem(run) else None


def log_summary(path: str) -> tuple[str | None, str, bool, bool]:
    """What the log.jsonl at path holds: the "run" of its last record, whose it is in words (a run, or
    not a log: no record names a run, or none is JSON), whether it holds any record, and whether
    a trained step (a record with a loss). Read a line at a time: a log of a long run is big."""
    last, trained, any_record = None, False, False
    with open_regular(path) as f:
        for line in f:
            with contextlib.suppress(json_file.JSONFileError):  # a line cut by a crash; a file of the user's
                record = json_file.parse(line, path)
                if isinstance(record, dict):
                    any_record, last = True, record.get("run")
                    trained |= "loss" in record
    words = run_name(last) if any_record else "no run (no line of it is a JSON record: not a log this trainer wrote)"
    return last, words, any_record, trained


@dataclass
class ResumePoint:
    """Where a resumed run takes up the run of its checkpoint: the file, its step, the length and
    sha256 of that run's log.jsonl when it was written, and that run's identity."""

    path: str
    step: int
    log_offset: int
    log_sha256: str
    run: dict

    @classmethod
    def of(cls, path: str, ckpt: dict) -> ResumePoint:
        return cls(path, ckpt["step"], ckpt["log_offset"], ckpt["log_sha256"], ckpt["run"])


def in_history(run_id: str | None, step: int, run: dict, at_step: int) -> bool:
    """Whether the state of run_id at step is a state that `run` went through on its way to at_step:
    its own, or its parent's up to the step it branched at, and so on back."""
    until = at_step
    while run is not None:
        if run["id"] == run_id and step <= until:
            return True
        parent = run["parent"]
        until = min(until, parent["step"]) if parent else -math.inf
        run = parent
    return False


# run_config keys that fix which rows each step reads: resuming must keep them (and the model_config)


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
    """On rank 0, holding --out-dir's lock: the checkpoint to resume (None: start from scratch), or
    a UserError where starting from scratch would mix a new run into an earlier one's files."""
    path = find_resume_checkpoint(run)
    if path:
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
    """The shards a run reads (shard_identity.shard_files: names, sizes, contents, in order): a checkpoint keeps
    them, and a resume compares them (data_change). What the rows are made of, not how a manifest describes
    its inputs: shards made again, byte for byte, from a copy of the input read the same rows. (Checkpoints
    written before kept the manifest's sha256 too; it is not compared.)"""
    return dict(train=shard_files(train_paths), val=shard_files(val_paths) if val_paths else None)


def check_resume_compatible(ckpt: dict, run, model_cfg, path: str):
    """Refuse a resume whose model, rows or optimizer differ from the checkpoint's (run: as resolved, its
    sequence length and order decided)."""
    saved = ckpt["run_config"]
    diffs = [
        f"{k}: checkpoint {v} vs now {getattr(model_cfg, k)}"
        for k, v in ckpt["model_config"].items()
        if getattr(model_cfg, k) != v
    ]
    diffs += [
        f"{k}: checkpoint {saved[k]} vs now {getattr(run, k)}" for k in RESUME_KEYS if saved[k] != getattr(run, k)
    ]
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
