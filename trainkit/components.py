"""What the Trainer is handed and saves through: the LaunchPlan a launch resolves once, before the Trainer
exists (bad input failing first, before any model work), and the Checkpointer that saves a step; resume_state()
puts a resumed checkpoint back. The trainer passes in its model's shape and row class: no script imported."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist

from trainkit import cli, train_flags
from trainkit.cli import UserError, print0
from trainkit.data.shards import ShardDigestCheck
from trainkit.data.tokenizer import get_tokenizer_or_fail, token_byte_lengths
from trainkit.evaluation import hellaswag_eval, hellaswag_examples
from trainkit.evaluation.hellaswag_examples import resolve_data_file
from trainkit.runfiles.checkpoints import (
    checkpoint_path,
    load_checkpoint,
    restore_training_state,
    save_checkpoint,
    training_state,
)
from trainkit.runfiles.resume import ResumePoint, check_resume_compatible, data_change, eval_checkpoint
from trainkit.runfiles.run_folder import OutDirLock, claim_out_dir
from trainkit.runtime.device import check_model_fits, choose_precision_and_compile
from trainkit.runtime.launch import checked_on_every_rank, decided_on_rank0
from trainkit.runtime.recovery import nonfinite_state

# --- the launch plan ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchPlan:
    """What this launch decided from its RunConfig, the machine and the checkpoint it resumes, once (but
    --batch-size auto's B, the Trainer's search). Checkpoints keep it beside the RunConfig."""

    model: object  # the GPTConfig: the preset and --n-* flags, or --init-from's shape
    seq_len: int  # T
    batch_size: int | str  # B, rows per rank per micro-step; "auto" until Trainer()'s search chooses it
    rows_per_rank: int  # rows each rank reads per optimizer step: B x accumulation steps
    world_size: int
    dtype: str  # autocast: float32, bfloat16, or float16 (with a GradScaler)
    compile: bool
    loss_chunk: int  # rows per lm_head + loss chunk (0: full logits)
    hellaswag_file: str | None  # given, or downloaded
    resume_from: str | None  # the checkpoint this run continues (None: from scratch)
    start_step: int
    shuffle: bool  # the order of the rows (a resume without --[no-]shuffle keeps its checkpoint's)


@dataclass
class LaunchInputs:
    """What resolving a launch opened on the way, for the Trainer."""

    train_rows: object  # the trainer's TokenRows
    val_rows: object | None
    shard_check: ShardDigestCheck  # every shard's sha256 against its manifest's, beside the steps
    enc: object | None  # the tokenizer, for samples
    token_bytes: object | None  # UTF-8 bytes of each token id, for val bpb
    pretrained: object | None  # --init-from's GPT
    checkpoint: dict | None
    run_folder: OutDirLock  # rank 0's hold on --out-dir: whether the name still names the folder taken


def resolve_launch(
    run, dist_state, run_folder: OutDirLock, model_cfg, pretrained, n_params: int, token_rows, evaluated=None
) -> tuple[LaunchPlan, LaunchInputs]:
    """The launch's decisions for a model of shape model_cfg, bad input first: T, dtype, compile, the data
    (token_rows: TokenRows), HellaSwag, then --out-dir and the checkpoint to resume (evaluated: main()'s)."""
    seq_len = run.seq_len or min(model_cfg.block_size, 1024)
    batch_size = run.batch_size or ("auto" if dist_state.device_type == "cuda" else 64)
    train_flags.check_run(run, model_cfg, seq_len, batch_size, dist_state.world_size)
    rows_per_rank = run.total_batch_size // (seq_len * dist_state.world_size)  # which --batch-size divides
    check_model_fits(n_params, dist_state, run.fsdp, training=not run.eval_only)
    problem = run.hellaswag_every and hellaswag_eval.model_problem(model_cfg.vocab_size, model_cfg.block_size)
    if problem:  # refused now, not after --hellaswag-every steps of training
        raise UserError(f"--hellaswag-every {run.hellaswag_every}: {problem}; pass --hellaswag-every 0")
    dtype, compiled = choose_precision_and_compile(run, dist_state)
    cpu_chunk = train_flags.CPU_LOSS_CHUNK if dist_state.device_type == "cpu" else 0
    loss_chunk = run.loss_chunk if run.loss_chunk is not None else cpu_chunk

    vocab_size = model_cfg.vocab_size
    train_rows = token_rows(
        run.data_dir, "train", seq_len, run.align_docs, run.shuffle, run.seed, vocab_size, dist_state.is_main
    )
    if train_rows.rows_per_epoch < rows_per_rank * dist_state.world_size:
        raise UserError(
            f"the train shards hold {train_rows.rows_per_epoch} rows of {seq_len} tokens, fewer "
            f"than one optimizer step ({rows_per_rank * dist_state.world_size} rows): lower --total-batch-size"
        )
    val_rows = None
    if run.val_every:
        try:
            val_rows = token_rows(run.data_dir, "val", seq_len, run.align_docs, vocab_size=vocab_size)
        except UserError as e:
            raise UserError(f"{e} (or pass --val-every 0)") from None
        val_rows_needed = run.val_steps * (1 if batch_size == "auto" else batch_size) * dist_state.world_size
        if val_rows.rows_per_epoch < val_rows_needed:
            raise UserError(
                f"the val shards hold {val_rows.rows_per_epoch} rows, fewer than --val-steps x "
                f"--batch-size x world size = {val_rows_needed}: lower --val-steps"
            )
    # a step or a save that finds this check failed stops
    shard_check = ShardDigestCheck(train_rows.paths + (val_rows.paths if val_rows else []))
    enc = get_tokenizer_or_fail("pass --sample-every 0") if run.sample_every else None
    token_bytes = token_byte_lengths(vocab_size, "pass --val-every 0") if val_rows else None
    hellaswag_file = None
    if run.hellaswag_every:
        get_tokenizer_or_fail("pass --hellaswag-every 0")
        # rendered now: a bad file fails here, not at the first evaluation (which reuses the examples)
        try:  # offline without the file: both ways on
            hellaswag_file = resolve_data_file(run.hellaswag_file, flag="--hellaswag-file")
        except UserError as e:
            raise UserError(f"{e}, or pass --hellaswag-every 0 to train without HellaSwag") from None
        hellaswag_examples.load_examples(hellaswag_file, run.hellaswag_limit, flag="--hellaswag-file")

    if run.eval_only:  # an evaluation writes nothing, so any --out-dir will do, in use or not
        resume_from, checkpoint = evaluated or (eval_checkpoint(run), None)
    else:
        resume_from, checkpoint = decided_on_rank0(dist_state, lambda: claim_out_dir(run, run_folder)), None
    start_step, shuffle = 0, run.shuffle is not False
    if resume_from:
        model_fields = [field.name for field in dataclasses.fields(model_cfg)]
        checkpoint = checkpoint or load_checkpoint(resume_from, model_fields=model_fields, resume=True)
        saved = checkpoint["launch"]
        shuffle = saved["shuffle"] if run.shuffle is None else run.shuffle  # unsaid: the checkpoint's order
        as_resumed = dataclasses.replace(run, seq_len=seq_len, shuffle=shuffle)  # compared with what it resolved
        as_saved = {**checkpoint["run_config"], "seq_len": saved["seq_len"], "shuffle": saved["shuffle"]}
        check_resume_compatible(dict(checkpoint, run_config=as_saved), as_resumed, model_cfg, resume_from)
        start_step = checkpoint["step"]
        if start_step > run.max_steps and not run.eval_only:
            raise UserError(
                f"{resume_from} is at step {start_step}, past --max-steps {run.max_steps}: "
                "pass a larger --max-steps to train on"
            )
    train_rows.shuffle = shuffle  # (no row was read yet)
    dtype, world_size = str(dtype).removeprefix("torch."), dist_state.world_size
    sizes = model_cfg, seq_len, batch_size, rows_per_rank, world_size
    plan = LaunchPlan(*sizes, dtype, compiled, loss_chunk, hellaswag_file, resume_from, start_step, shuffle)
    return plan, LaunchInputs(train_rows, val_rows, shard_check, enc, token_bytes, pretrained, checkpoint, run_folder)


# --- the checkpointer -----------------------------------------------------------------------------


class Checkpointer:
    """Saves the training state with the RunConfig and the LaunchPlan; last: the newest checkpoint on disk or None."""

    def __init__(self, run, plan, dist_state, trainer_state, shard_check, log, shards_read, rows_per_epoch, run_folder):
        """trainer_state: (raw model, optimizer, update guard, GradScaler or None, device), as training_state takes."""
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
        """Checkpoint at step, unless any rank's weights or optimizer state hold NaN or inf, or its shards are
        not what their manifest records (waited for, but by a stop's save: its grace time is short)."""
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


def resume_state(ckpt: dict, run, plan, trainer_state, shards_read: dict, get_lr) -> ResumePoint:
    """The checkpoint's training state put back, with a line each where this run reads other data, or sets
    another LR (get_lr: the trainer's schedule; a larger --max-steps, say) or other optimizer hyperparameters."""
    path, step = plan.resume_from, plan.start_step
    saved = {k: ckpt["run_config"][k] for k in SCHEDULE_KEYS if k in ckpt["run_config"]}
    saved_run = dataclasses.replace(run, **saved)
    old_lr, new_lr = get_lr(step, saved_run), get_lr(step, run)
    changed = [
        f"{train_flags.flag_name(k)} {saved[k]} -> {getattr(run, k)}" for k in saved if saved[k] != getattr(run, k)
    ]
    lr_notice = f"note: the LR at step {step} moves from {old_lr:.4e} to {new_lr:.4e} ({', '.join(changed)})"
    optimizer_notice = restore_training_state(ckpt, *trainer_state, path)  # (this run's weight decay, ...)
    print0(f"{'evaluating' if run.eval_only else 'resumed from'} {path} at step {step}")
    if not run.eval_only:
        change = data_change(ckpt["data_files"], shards_read)
        if change:
            cli.print_warning(
                f"--data-dir {run.data_dir} changed since {path} was written ({change}): from "
                f"step {step} on this run reads other rows than the run it continues would have"
            )
        for notice in (lr_notice if old_lr != new_lr else None, optimizer_notice):
            if notice:
                print0(notice)
    return ResumePoint.of(path, ckpt)
