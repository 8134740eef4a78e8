"""What a resume needs besides the configs to go on exactly where a run was (weights, optimizer state,
RNGs, the update guard's windows, fp16's loss scale): taken (training_state) and put back."""

from __future__ import annotations

import torch

from trainkit.checkpoints import full_state, load_full_state
from trainkit.optimizers import use_run_hyperparameters


def training_state(model, optimizer, guard, scaler, device: str, **records) -> dict:
    """The live training state with records (the step, the configs, ...); under FSDP every rank calls it."""
    model_state, optimizer_state = full_state(model, optimizer)
    state = dict(model=model_state, optimizer=optimizer_state, **records)
    state.update(rng_cpu=torch.get_rng_state(), skip_state=guard.state_dict())
    if torch.device(device).type == "cuda":
        state["rng_cuda"] = torch.cuda.get_rng_state(device)
    if scaler:
        state["scaler"] = scaler.state_dict()
    return state


def restore_training_state(ckpt: dict, model, optimizer, guard, scaler, device: str, path: str) -> str | None:
    """What training_state() took, put back (every rank); the note where this run's optimizer
    hyperparameters replace the checkpoint's (use_run_hyperparameters), else None."""
    notice = use_run_hyperparameters(optimizer, ckpt["optimizer"])
    load_full_state(model, optimizer, ckpt["model"], ckpt["optimizer"], path)
    guard.load_state_dict(ckpt["skip_state"])
    torch.set_rng_state(ckpt["rng_cpu"])
    if scaler and "scaler" in ckpt:
        scaler.load_state_dict(ckpt["scaler"])
    if "rng_cuda" in ckpt and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(ckpt["rng_cuda"], device)
    return notice
