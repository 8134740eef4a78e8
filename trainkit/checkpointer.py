"""A run's checkpoints as the Trainer uses them: Checkpointer.save(step) writes one, checked first, and
names the newest on disk (last); resume_state() puts a resumed checkpoint back into the live objects."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from trainkit import cli
from trainkit.checkpoints import checkpoint_path, save_checkpoint
from trainkit.cli import UserError
from trainkit.console import print0
from trainkit.launch import checked_on_every_rank
from trainkit.resume import ResumePoint, data_change
from trainkit.training_state import restore_training_state, training_state
from trainkit.update_guard import nonfinite_state


class Checkpointer:
    """Saves the run's training state with both records, the RunConfig asked for and the LaunchPlan
    resolved; last: the newest checkpoint on disk (None: none yet), named when a run stops."""

    def __init__(
        self, run, plan, dist_state, trainer_state, shard_check, log, shards_read: dict, rows_per_epoch, run_folder
    ):
        """trainer_state: (raw model, optimizer, update guard, GradScaler or None, device), as training_state
        takes; run_folder: the OutDirLock of --out-dir, which holds the folder this run claimed."""
        self.run, self.plan, self.dist_state, self.trainer_state = run, plan, dist_state, trainer_state
        self.shard_check, self.log, self.shards_read = shard_check, log, shards_read
        self.rows_per_epoch, self.run_folder = rows_per_epoch, run_folder
        self.last = plan.resume_from

    def state(self, step: int) -> dict:
        """Everything a resume needs: the training state, the log's position, the shards, and both records."""
        next_row = step * self.plan.rows_per_rank * self.dist_state.world_size
        return training_state(
            *self.trainer_state,
            step=step,
            model_config=dataclasses.asdict(self.plan.model),
            run_config=dataclasses.asdict(self.run),
            launch=dataclasses.asdict(self.plan),
            world_size=self.dist_state.world_size,
            next_row=next_row,
            epoch=next_row // self.rows_per_epoch,
            data_files=self.shards_read,
            **self.log.position(),  # the log's length and sha256 at this step, and the run's identity
        )

    def save(self, step: int, stopping: bool = False):
        """Checkpoint at step, unless the weights or optimizer state hold NaN or inf (every rank checks
        its tensors; one all-reduce makes them agree), or a rank's shards are not what their manifest
        records (no checkpoint of steps on them; the save waits for that check to end, except a stop
        signal's: a job's grace time is short, and a checkpoint in it is worth more)."""
        path = checkpoint_path(self.run.out_dir, step)
        checked_on_every_rank(self.dist_state, lambda: self.shard_check.result(wait=not stopping))
        model, optimizer, _, _, device = self.trainer_state
        where = nonfinite_state(model, optimizer, device)
        if where:
            raise UserError(
                f"step {step}: not writing {path}: the {where} hold non-finite values. "
                f"Last good checkpoint: {self.last or 'none'}"
            )
        # under --fsdp every rank takes part in gathering the state to rank 0
        state = self.state(step) if self.dist_state.is_main or self.run.fsdp else None
        if self.dist_state.is_main:
            self.run_folder.check_claimed(self.last)  # --out-dir moved or replaced mid-run: stop, write nothing
            self.log.sync()  # the log up to the checkpoint's position is on disk before the checkpoint
            save_checkpoint(path, state, self.run.keep_last, self.run_folder.fd)  # (into the folder held)
            self.last = path  # on disk: named if a peer dies in the barrier below
        if self.dist_state.enabled:
            dist.barrier()  # no rank runs ahead (or exits) before the checkpoint is on disk
        # on every rank, once rank 0 has written it: they decide together whether a stop needs another save
        self.last = self.log.last_checkpoint = path


# the fields the trainer's get_lr reads: a resumed run whose values differ may find another LR at its step
SCHEDULE_KEYS = ("lr_schedule", "max_steps", "warmup_steps", "max_lr", "min_lr", "cooldown_frac")


def lr_change_notice(saved_run_config: dict, run, step: int, get_lr) -> str | None:
    """One line when the schedule flags of a resumed run put another LR at the resumed step than
    the checkpoint's run had there (e.g. a larger --max-steps stretches the cosine), else None."""
    saved = dataclasses.replace(run, **{k: saved_run_config[k] for k in SCHEDULE_KEYS if k in saved_run_config})
    old_lr, new_lr = get_lr(step, saved), get_lr(step, run)
    if old_lr == new_lr:
        return None
    changed = ", ".join(
        f"--{k.replace('_', '-')} {getattr(saved, k)} -> {getattr(run, k)}"
        for k in SCHEDULE_KEYS
        if getattr(saved, k) != getattr(run, k)
    )
    return f"note: the LR at step {step} moves from {old_lr:.4e} to {new_lr:.4e} ({changed})"


def resume_state(ckpt: dict, run, plan, trainer_state, shards_read: dict, get_lr) -> ResumePoint:
    """The resumed checkpoint's training state put back (restore_training_state), with a line each where this
    run reads other data, or sets another LR (get_lr(step, run): the trainer's schedule) or other optimizer
    hyperparameters than it did."""
    lr_notice = lr_change_notice(ckpt["run_config"], run, plan.start_step, get_lr)
    path, step = plan.resume_from, plan.start_step
    optimizer_notice = restore_training_state(ckpt, *trainer_state, path)  # (this run's weight decay, ...)
    print0(f"{'evaluating' if run.eval_only else 'resumed from'} {path} at step {step}")
    if not run.eval_only:
        change = data_change(ckpt["data_files"], shards_read)
        if change:
            cli.print_warning(
                f"--data-dir {run.data_dir} changed since {path} was written ({change}): from "
                f"step {step} on this run reads other rows than the run it continues would have"
            )
        for notice in (lr_notice, optimizer_notice):
            if notice:
                print0(notice)
    return ResumePoint.of(path, ckpt)
