"""Checkpoint files, written whole and read back checked (checkpoint_checks.py), and the training state they hold."""

from __future__ import annotations

import hashlib
import os
import re

import torch
import torch.nn as nn

from trainkit.cli import UserError, print_warning, reason_of
from trainkit.fileio import in_held_folder, write_atomically
from trainkit.runfiles.checkpoint_checks import (
    checkpoint_problem,
    fields_problem,
    first_nonfinite,
    first_nonfinite_optimizer_state,
    load_failure,
    other_file_kind,
    state_shape_problem,
    structure_problem,
)
from trainkit.runtime.device import is_fsdp
from trainkit.runtime.optimizers import use_run_hyperparameters

# --- checkpoint files -----------------------------------------------------------------------------


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare module inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def rekey_optimizer_state(state: dict, keys: list) -> dict:
    """An optimizer state dict whose i-th parameter is renamed keys[i] (numbers to names, or back)."""
    order = [p for group in state["param_groups"] for p in group["params"]]
    new = dict(zip(order, keys, strict=True))
    return dict(
        state={new[p]: s for p, s in state["state"].items()},
        param_groups=[{**g, "params": [new[p] for p in g["params"]]} for g in state["param_groups"]],
    )


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state dicts unsharded and unprefixed (under FSDP every rank calls it; rank 0 gets them)."""
    if not is_fsdp(model):
        return unwrap_model(model).state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    n_params = sum(len(g["params"]) for g in optimizer.param_groups)
    return model_state, rekey_optimizer_state(optim_state, list(range(n_params))) if optim_state else {}


def optimizer_state_problem(optim_state: dict, optimizer: torch.optim.Optimizer) -> str | None:
    """Why a checkpoint's optimizer state cannot be this optimizer's (groups, sizes, shapes), or None."""
    parts = sorted(optimizer.state_dict().keys() - {"state", "param_groups"})
    if parts:
        if not isinstance(optim_state, dict) or sorted(optim_state) != parts:
            keys = sorted(map(str, optim_state)) if isinstance(optim_state, dict) else type(optim_state).__name__
            return f"its optimizer state holds {keys}, this optimizer's {parts}"
        return next(
            filter(None, (optimizer_state_problem(optim_state[part], getattr(optimizer, part)) for part in parts)), None
        )
    groups = optim_state.get("param_groups") if isinstance(optim_state, dict) else None
    if not isinstance(groups, list) or not isinstance(optim_state.get("state"), dict):
        return "its optimizer state is not an optimizer's state dict"
    sizes, ours = [len(g.get("params", ())) for g in groups], [len(g["params"]) for g in optimizer.param_groups]
    if sizes != ours:
        return f"its optimizer has parameter groups of {sizes} tensors, this one of {ours}"
    shapes = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]]
    for i, key in enumerate(p for g in groups for p in g["params"]):
        for name, value in optim_state["state"].get(key, {}).items():
            if torch.is_tensor(value) and value.dim() and tuple(value.shape) != shapes[i]:
                return (
                    f"its optimizer's {name} of parameter {i} is {'x'.join(map(str, value.shape))}, where the "
                    f"parameter is {'x'.join(map(str, shapes[i]))}"
                )
    return None


def load_full_state(model: nn.Module, optimizer, model_state: dict, optim_state: dict, source: str):
    """Load what full_state() returns (under FSDP each rank keeps its shard) once it fits, else a UserError."""
    if problem := optimizer_state_problem(optim_state, optimizer):
        raise UserError(f"{source}: {problem}: written by another program or edited, it cannot be resumed")
    if not is_fsdp(model):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        return
    from torch.distributed.checkpoint import state_dict as dsd

    options = dsd.StateDictOptions(full_state_dict=True)
    dsd.set_model_state_dict(model, model_state, options=options)
    # the parameters' names in the optimizer's order, as the helpers list them
    names = [n for g in dsd.get_optimizer_state_dict(model, optimizer)["param_groups"] for n in g["params"]]
    dsd.set_optimizer_state_dict(model, optimizer, rekey_optimizer_state(optim_state, names), options=options)


def checkpoint_path(out_dir: str, step: int) -> str:
    return os.path.join(out_dir, f"ckpt_{step:07d}.pt")


# checkpoint_path's names; anything else (a user's ckpt_best.pt) is never resumed nor deleted by --keep-last
CKPT_NAME = re.compile(r"ckpt_(\d{7,})\.pt")


def list_checkpoints(out_dir: str) -> list[str]:
    """Our checkpoints in out_dir, oldest step first."""
    return [os.path.join(out_dir, name) for name in checkpoint_names(out_dir)] if os.path.isdir(out_dir) else []


def checkpoint_names(folder: str | int) -> list[str]:
    """The names of our checkpoints in folder (a path, or an open descriptor of it), oldest step first."""
    return [name for _, name in sorted((int(m[1]), m[0]) for m in map(CKPT_NAME.fullmatch, os.listdir(folder)) if m)]


def latest_checkpoint(out_dir: str) -> str | None:
    return (list_checkpoints(out_dir) or [None])[-1]


def checkpoint_step(path: str) -> int:
    """The step in one of our checkpoint names (CKPT_NAME)."""
    return int(CKPT_NAME.fullmatch(os.path.basename(path))[1])


def same_file(a: str, b: str) -> bool:
    """Whether a and b name one file (False when either is gone: --keep-last may delete one meanwhile)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def state_digest(state: dict) -> str:
    """sha256 of a checkpoint's contents but its "checksum": each tensor's dtype, shape and bytes, each value."""
    h = hashlib.sha256()

    def visit(x):
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().contiguous()
            h.update(f"tensor {x.dtype} {tuple(x.shape)}:".encode())
            h.update(x.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(x, dict):
            h.update(b"{")
            for k, v in x.items():
                visit(k)
                visit(v)
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"(" if isinstance(x, tuple) else b"[")
            for v in x:
                visit(v)
            h.update(b")")
        else:
            h.update(f"{type(x).__name__} {x!r};".encode())

    visit({k: v for k, v in state.items() if k != "checksum"})
    return h.hexdigest()


class _WriteErrorKeeper:
    """A file for torch.save that keeps a failed write's OSError (torch's RuntimeError no longer says why)."""

    def __init__(self, file):
        self.file, self.error, self.flush = file, None, file.flush

    def write(self, data):
        try:
            return self.file.write(data)
        except OSError as e:
            self.error = e
            raise


def save_checkpoint(path: str, state: dict, keep_last: int = 0, folder_fd: int | None = None):
    """Write path atomically with fsyncs, its sha256 inside, into folder_fd (the run's held folder) where given."""
    out_dir = os.path.dirname(path) or "."
    name = in_held_folder(out_dir, os.path.basename(path), folder_fd)

    def write(f):
        writer = _WriteErrorKeeper(f)
        try:
            torch.save(dict(state, checksum=state_digest(state)), writer)
        except RuntimeError as e:
            raise writer.error or e from None

    try:
        write_atomically(name, write, fsync_file=True, fsync_folder=True, dir_fd=folder_fd)
    except (OSError, RuntimeError) as e:  # disk full, quota, permissions
        raise UserError(
            f"could not write checkpoint {path}: {reason_of(e)}; the previous checkpoint "
            f"{latest_checkpoint(out_dir) or '(none)'} is intact"
        ) from None
    if keep_last:
        remove_older_checkpoints(out_dir, path, keep_last, folder_fd)


_UNDELETABLE = set()  # checkpoints --keep-last could not delete, named once each


def remove_older_checkpoints(out_dir: str, path: str, keep_last: int, folder_fd: int | None = None):
    """--keep-last: delete all but the newest keep_last checkpoints; one that cannot be stays, warned of once."""
    for name in checkpoint_names(out_dir if folder_fd is None else folder_fd)[:-keep_last]:
        old = os.path.join(out_dir, name)
        if name == os.path.basename(path) or old in _UNDELETABLE:
            continue
        try:
            os.remove(in_held_folder(out_dir, name, folder_fd), dir_fd=folder_fd)
        except FileNotFoundError:  # (deleted meanwhile)
            pass
        except OSError as e:
            _UNDELETABLE.add(old)
            print_warning(f"--keep-last cannot delete {old} ({reason_of(e)}); it stays, and the run goes on")


def load_checkpoint(path: str, model_fields=None, resume: bool = False) -> dict:
    """The one loader of a checkpoint (a file, or a folder's newest): weights_only and checked before anything
    reads its tensors, else a UserError naming the earlier one. model_fields: the model_config keys known."""
    if os.path.isdir(path):
        if (newest := latest_checkpoint(path)) is None:
            raise UserError(f"no checkpoint (ckpt_NNNNNNN.pt) in {path}")
        path = newest
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist")

    def instead() -> str:
        found = list_checkpoints(os.path.dirname(path) or ".")
        same = [i for i, p in enumerate(found) if same_file(p, path)]
        earlier = next(reversed(found[: same[0]] if same else found), None)  # the newest of ours before it
        if CKPT_NAME.fullmatch(os.path.basename(path)) is None:  # not one of ours: the newest beside it, if any
            return f"the newest checkpoint beside it is {earlier}" if earlier else "there is no checkpoint beside it"
        return f"use the earlier checkpoint {earlier}" if earlier else "there is no earlier checkpoint next to it"

    try:  # one open file from here on: a run's --keep-last may delete the name meanwhile
        f = open(path, "rb")
    except FileNotFoundError:
        newest = latest_checkpoint(os.path.dirname(path) or ".")
        raise UserError(
            f"checkpoint {path} was removed while loading (by its run's --keep-last?); "
            + (f"the newest beside it now: {newest}" if newest else "no checkpoint is left beside it")
        ) from None
    with f:
        if not CKPT_NAME.fullmatch(os.path.basename(path)) and (kind := other_file_kind(f.read(512))):
            raise UserError(
                f"{path} is not a checkpoint but {kind}: pass a ckpt_NNNNNNN.pt or a run's --out-dir ({instead()})"
            )
        f.seek(0)
        try:
            ckpt = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many types for a damaged zip or pickle
            what = "empty file (0 bytes)" if os.fstat(f.fileno()).st_size == 0 else load_failure(e)
            raise UserError(f"{path}: cannot load checkpoint ({what}); truncated or corrupt: {instead()}") from None
    if problem := checkpoint_problem(ckpt, model_fields):
        raise UserError(f"{path}: {problem}")
    not_ours, nonfinite = "{}: not as train_gpt2.py writes them; {instead}", "NaN or inf ({}): {instead}"
    damaged = "damaged checkpoint (its contents do not match the sha256 written with it): {instead}"
    refusals = (  # in this order; the first before anything reads a tensor's contents (docs/resume-and-failures.md)
        (lambda: structure_problem(ckpt) or state_shape_problem(ckpt["model"], ckpt["model_config"]), not_ours),
        (lambda: ckpt["checksum"] != state_digest(ckpt), damaged),
        (lambda: fields_problem(ckpt, resume), not_ours),  # (a right checksum: another program, or re-summed)
        (lambda: first_nonfinite(ckpt["model"]), "the model weights hold " + nonfinite),  # (never the trainer's)
        (
            lambda: resume and first_nonfinite_optimizer_state(ckpt["optimizer"]),
            "the optimizer state holds " + nonfinite,
        ),
    )
    for problem_of, words in refusals:
        if problem := problem_of():
            raise UserError(f"{path}: {words.format(problem, instead=instead())}")
    return ckpt


# --- the training state ---------------------------------------------------------------------------


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
    """What training_state() took, put back; the note where this run's hyperparameters replace the saved ones."""
    notice = use_run_hyperparameters(optimizer, ckpt["optimizer"])
    load_full_state(model, optimizer, ckpt["model"], ckpt["optimizer"], path)
    guard.load_state_dict(ckpt["skip_state"])
    torch.set_rng_state(ckpt["rng_cpu"])
    if scaler and "scaler" in ckpt:
        scaler.load_state_dict(ckpt["scaler"])
    if "rng_cuda" in ckpt and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(ckpt["rng_cuda"], device)
    return notice
