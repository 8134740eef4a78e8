"""A run's training state in a checkpoint, and back: what a resume needs besides the configs to go on
exactly where the run was (the weights and optimizer state, the RNGs, the update guard's windows, fp16's
loss scale), taken from the live objects by training_state() and put back by restore_training_state().
"""

from __future__ import annotations

import torch

from trainkit.checkpoints import full_state, load_full_state
from trainkit.optimizers import use_run_hyperparameters


def training_state(model, optimizer, guard, scaler, device: str, **records) -> dict:
    """The weights and optimizer state (full_state: under FSDP every rank calls it, rank 0 gets them), the
    RNGs, the guard's windows and fp16's loss scale, with records (the step, the configs, the log's position...)."""
    model_state, optimizer_state = full_state(model, optimizer)
    state = dict(model=model_state, optimizer=optimizer_state, **records)
    state.update(rng_cpu=torch.get_rng_state(), skip_state=guard.state_dict())
    if torch.device(device).type == "cuda":
        state["rng_cuda"] = torch.cuda.get_rng_state(device)
    if scaler:
        state["scaler"] = scaler.state_dict()
    return state


def restore_training_state(ckpt: dict, model, optimizer, guard, scaler, device: str, path: str) -> str | None:
    """What training_state() took, put back into the live objects (every rank: under FSDP each keeps its
    shard). Returns the note when this run's optimizer hyperparameters (weight decay, ...) replace the
    checkpoint's (optimizers.use_run_hyperparameters), else None."""
    notice = use_run_hyperparameters(optimizer, ckpt["optimizer"])
    load_full_state(model, optimizer, ckpt["model"], ckpt["optimizer"], path)
    guard.load_state_dict(ckpt["skip_state"])
    torch.set_rng_state(ckpt["rng_cpu"])
    if scaler and "scaler" in ckpt:
        scaler.load_state_dict(ckpt["scaler"])
    if "rng_cuda" in ckpt and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(ckpt["rng_cuda"], device)
    return notice
