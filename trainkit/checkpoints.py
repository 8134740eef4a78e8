"""Checkpoint files: atomic save, verified load, the choice of what --resume continues, and the
run identity each checkpoint carries (whose it is, and for a branch, whose branch).

A checkpoint is a plain dict of tensors and plain values (model and optimizer state dicts
without wrapper prefixes, the configs as dicts, the step, the RNG states, the log position,
the run identity):
written to NAME.tmp, fsynced and renamed, with the sha256 of its contents inside, and loaded
with weights_only=True. Under FSDP the state is gathered whole (full_state), so a checkpoint
of any mode resumes in any other.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import uuid
from dataclasses import dataclass

import torch
import torch.nn as nn

from trainkit import json_file
from trainkit.atomic_write import write_atomically
from trainkit.cli import UserError, reason_of
from trainkit.fsdp import is_fsdp
from trainkit.console import print0
from trainkit.regular_file import open_regular
from trainkit.shards import differing_file, shard_files


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare module inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def clean_state_dict(model: nn.Module) -> dict:
    """State dict of the bare GPT, without DDP's `module.` or torch.compile's `_orig_mod.` prefixes."""
    return unwrap_model(model).state_dict()


def rekey_optimizer_state(state: dict, keys: list) -> dict:
    """An optimizer state dict with its parameters renamed in order: the i-th parameter of its
    param_groups becomes keys[i]. optimizer.state_dict() names parameters 0, 1, 2, ... and the
    torch.distributed.checkpoint helpers by their names, in the same order."""
    order = [p for group in state["param_groups"] for p in group["params"]]
    new = dict(zip(order, keys, strict=True))
    return dict(
        state={new[p]: s for p, s in state["state"].items()},
        param_groups=[{**g, "params": [new[p] for p in g["params"]]} for g in state["param_groups"]],
    )


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state dicts as a single process holds them: unsharded, unprefixed,
    the optimizer's parameters numbered. Under FSDP every rank must call this: it gathers the
    shards to rank 0, on the CPU; the other ranks get empty dicts."""
    if not is_fsdp(model):
        return clean_state_dict(model), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    n_params = sum(len(g["params"]) for g in optimizer.param_groups)
    return model_state, rekey_optimizer_state(optim_state, list(range(n_params))) if optim_state else {}


def optimizer_state_problem(optim_state: dict, optimizer: torch.optim.Optimizer) -> str | None:
    """Why a checkpoint's optimizer state cannot be this optimizer's (None: it fits): other groups,
    another number of parameters in one, or a state tensor (AdamW's moments, Muon's momentum) of
    another shape than its parameter. torch's load_state_dict would raise a traceback, or take it.
    An optimizer made of parts (MuonWithAdamW) keeps one state dict per part, named as the part."""
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


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict,
    optim_state: dict,
    source: str = "the checkpoint",
):
    """Load what full_state() returns (every rank passes the whole state; under FSDP each keeps its
    shard), once optimizer_state_problem finds it fits (else a UserError naming source)."""
    problem = optimizer_state_problem(optim_state, optimizer)
    if problem:
        raise UserError(f"{source}: {problem}: written by another program or edited, it cannot be resumed")
    if not is_fsdp(model):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    # the parameters' names in the optimizer's order, as the helpers list them
    names = [n for g in get_optimizer_state_dict(model, optimizer)["param_groups"] for n in g["params"]]
    set_optimizer_state_dict(model, optimizer, rekey_optimizer_state(optim_state, names), options=options)


def checkpoint_path(out_dir: str, step: int) -> str:
    return os.path.join(out_dir, f"ckpt_{step:07d}.pt")


# this trainer's checkpoint names (checkpoint_path's); anything else in --out-dir (a user's
# ckpt_best.pt) is never picked by --resume nor deleted by --keep-last
CKPT_NAME = re.compile(r"ckpt_(\d{7,})\.pt")


def list_checkpoints(out_dir: str) -> list[str]:
    """Our checkpoints in out_dir, oldest step first."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    ours = sorted((int(m[1]), m[0]) for m in map(CKPT_NAME.fullmatch, names) if m)
    return [os.path.join(out_dir, name) for _, name in ours]


def latest_checkpoint(out_dir: str) -> str | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def checkpoint_step(path: str) -> int:
    """The step in one of our checkpoint names (CKPT_NAME)."""
    return int(CKPT_NAME.fullmatch(os.path.basename(path))[1])


def same_file(a: str, b: str) -> bool:
    """Whether a and b name one file (False when either is gone: --keep-last may delete one meanwhile)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def earlier_checkpoint(path: str) -> str | None:
    """What to use instead of a bad checkpoint: the newest of ours before it in its folder."""
    found = list_checkpoints(os.path.dirname(path) or ".")
    same = [i for i, p in enumerate(found) if same_file(p, path)]
    earlier = found[: same[0]] if same else found
    return earlier[-1] if earlier else None


def state_digest(state: dict) -> str:
    """sha256 of a checkpoint's contents (all but its "checksum"): every tensor's dtype, shape and
    bytes and every plain value, in order. Detects bytes flipped anywhere in the payload."""
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
    """A file for torch.save that keeps the OSError of a failed write: torch re-raises it as a
    RuntimeError that no longer says why (e.g. that the disk is full)."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data):
        try:
            return self.file.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self.file.flush()


def save_checkpoint(path: str, state: dict, keep_last: int = 0):
    """Write path.tmp, fsync it, rename it to path, fsync the folder (atomic_write): a crash, a full
    disk or a power loss leaves the new checkpoint whole or absent, and the previous one intact. The
    sha256 of the contents goes inside (load_checkpoint checks it)."""
    out_dir = os.path.dirname(path) or "."

    def write(f):
        writer = _WriteErrorKeeper(f)
        try:
            torch.save(dict(state, checksum=state_digest(state)), writer)
        except RuntimeError as e:
            raise writer.error or e from None

    try:
        write_atomically(path, write, fsync_file=True, fsync_folder=True)
    except (OSError, RuntimeError) as e:  # disk full, quota, permissions
        raise UserError(
            f"could not write checkpoint {path}: {reason_of(e)}; the previous checkpoint "
            f"{latest_checkpoint(out_dir) or '(none)'} is intact"
        ) from None
    if keep_last:
        for old in list_checkpoints(out_dir)[:-keep_last]:
            if old != path:
                os.remove(old)


def load_checkpoint(path: str, model_fields=None, map_location="cpu", resume: bool = False) -> dict:
    """Load one of our checkpoints (a file, or a run's --out-dir for its newest) with
    weights_only=True (tensors and plain types, no pickled code), and check that it is ours
    and whole, that its weights are the shapes its model_config makes (gpt_state_shapes) and,
    to resume, that it holds the state a resume reads (RESUME_STATE); otherwise a UserError that
    names the earlier checkpoint to use. model_fields: the model_config keys the reader
    understands (GPTConfig's fields; an exporter's subset); a checkpoint with any other is
    refused rather than read wrongly."""
    if os.path.isdir(path):
        newest = latest_checkpoint(path)
        if newest is None:
            raise UserError(f"no checkpoint (ckpt_NNNNNNN.pt) in {path}")
        path = newest
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist")

    def instead() -> str:
        earlier = earlier_checkpoint(path)
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
        kind = None if CKPT_NAME.fullmatch(os.path.basename(path)) else other_file_kind(f.read(512))
        f.seek(0)
        if kind:
            raise UserError(
                f"{path} is not a checkpoint but {kind}: pass a ckpt_NNNNNNN.pt or a run's --out-dir ({instead()})"
            )
        try:
            ckpt = torch.load(f, map_location=map_location, weights_only=True)
        except Exception as e:  # torch raises many types for a damaged zip or pickle
            what = "empty file (0 bytes)" if os.fstat(f.fileno()).st_size == 0 else reason_of(e, typed=True)
            if "Weights only load failed" in what:  # (torch goes on to advise weights_only=False: unsafe)
                what = "it holds pickled objects other than tensors and plain values, which are never loaded"
            raise UserError(f"{path}: cannot load checkpoint ({what}); truncated or corrupt: {instead()}") from None
    problem = checkpoint_problem(ckpt, model_fields)
    if problem:
        raise UserError(f"{path}: {problem}")
    # before anything reads a tensor's contents (the checksum, a copy into the model): an expanded tensor of
    # a few bytes on disk would ask for gigabytes there, a structure nested thousands deep overflow the stack
    problem = structure_problem(ckpt) or state_shape_problem(ckpt["model"], ckpt["model_config"])
    if problem:
        raise UserError(f"{path}: {problem}: not as train_gpt2.py writes them; {instead()}")
    if ckpt["checksum"] != state_digest(ckpt):
        raise UserError(
            f"{path}: damaged checkpoint (its contents do not match the sha256 written with it): {instead()}"
        )
    problem = fields_problem(ckpt, resume)
    if problem:  # its checksum is right: another program wrote it so, or it was edited and re-summed
        raise UserError(f"{path}: {problem}: not as train_gpt2.py writes them; {instead()}")
    bad = first_nonfinite(ckpt["model"])
    if bad:  # the trainer never writes one (check_state_finite): another program did
        raise UserError(f"{path}: the model weights hold NaN or inf ({bad}): {instead()}")
    bad = resume and first_nonfinite_optimizer_state(ckpt["optimizer"])
    if bad:  # as the weights: resumed, it would only fail at the next checkpoint, naming this one as good
        raise UserError(f"{path}: the optimizer state holds NaN or inf ({bad}): {instead()}")
    return ckpt


# what a resume reads besides the model: a checkpoint without one of them only evaluates, samples, exports
RESUME_STATE = (
    "optimizer",
    "step",
    "run_config",
    "launch",
    "data_files",
    "rng_cpu",
    "log_offset",
    "log_sha256",
    "skip_state",
)
# deeper than any checkpoint the trainer writes (an optimizer state 5 levels, a run identity one more per
# branch), far below the interpreter's recursion limit that state_digest's walk would reach
MAX_NESTING = 100
MAX_NODES = 10_000_000  # values in all, counted as state_digest visits them (a shared list once per place)


def structure_problem(ckpt: dict) -> str | None:
    """What makes a loaded checkpoint costlier to read than its file, in words (None: nothing): nesting
    deeper than MAX_NESTING, more than MAX_NODES values, or a tensor that is not the plain one torch.save
    writes of a parameter or a state: strided, contiguous (an expanded tensor, strides 0, views a few bytes
    as gigabytes), inside its storage, and each storage no larger than what its tensors view; the tensors
    together at most twice their storages' bytes (the tied token embedding and lm_head share one). Walked
    without recursion, so that it is safe on any structure the unpickler builds."""
    stack, nodes, storages, tensor_bytes = [("", ckpt, 0)], 0, {}, 0
    while stack:
        where, value, depth = stack.pop()
        nodes += 1
        if depth > MAX_NESTING or nodes > MAX_NODES:
            return (
                f"its structure nests deeper than {MAX_NESTING} levels (at {where[:80]}...)"
                if depth > MAX_NESTING
                else f"its structure holds more than {MAX_NODES} values"
            )
        if isinstance(value, dict):
            stack.extend((f"{where}[{k!r:.40}]", v, depth + 1) for k, v in value.items())
            stack.extend((where, k, depth + 1) for k in value if isinstance(k, (tuple, torch.Tensor)))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{where}[{i}]", v, depth + 1) for i, v in enumerate(value))
        elif isinstance(value, torch.Tensor):
            problem = _tensor_problem(value)
            if problem:
                return f"its tensor {where or '(top)'} {problem}"
            storage = value.untyped_storage()
            storages[storage.data_ptr(), storage.nbytes()] = max(
                storages.get((storage.data_ptr(), storage.nbytes()), 0),
                (value.storage_offset() + value.numel()) * value.element_size(),
            )
            tensor_bytes += value.numel() * value.element_size()
    for (_, nbytes), viewed in storages.items():
        if nbytes > viewed:
            return f"a tensor's storage holds {nbytes} bytes, of which its tensors view {viewed}"
    if tensor_bytes > 2 * sum(nbytes for _, nbytes in storages):
        return (
            f"its tensors view {tensor_bytes} bytes of {sum(n for _, n in storages)} stored (one storage "
            "viewed by many tensors)"
        )
    return None


def _tensor_problem(t: torch.Tensor) -> str | None:
    if t.layout != torch.strided or t.device.type != "cpu" or t.is_quantized:
        return f"is a {t.layout} {t.device.type} tensor, not a plain one"
    shape = "x".join(map(str, t.shape)) or "a scalar"
    expected = [1] * t.dim()
    for i in range(t.dim() - 2, -1, -1):
        expected[i] = expected[i + 1] * max(t.shape[i + 1], 1)
    if any(stride != want for stride, want, size in zip(t.stride(), expected, t.shape) if size > 1):
        return f"of {shape} has strides {tuple(t.stride())}, not those of a stored tensor (expanded or a view)"
    if (t.storage_offset() + t.numel()) * t.element_size() > t.untyped_storage().nbytes():
        return f"of {shape} views more than its storage's {t.untyped_storage().nbytes()} bytes"
    return None


def fields_problem(ckpt: dict, resume: bool) -> str | None:
    """The one check of a checkpoint's fields besides the model (whose names and shapes state_shape_problem
    checks): their types and ranges as the trainer writes them, and to resume (resume), that every field a
    resume reads is there. None: they are as the trainer writes them."""
    if resume:
        missing = [k for k in RESUME_STATE if k not in ckpt]
        if missing:
            return f"it holds no {', '.join(missing)} to resume from (weights only)"
    checks = dict(
        step=_count,
        run=_run_problem,
        log_offset=_count,
        log_sha256=_sha256_text,
        rng_cpu=_rng_problem,
        rng_cuda=_rng_problem,
        skip_state=_skip_state_problem,
        run_config=_run_config_problem,
        data_files=_data_files_problem,
        scaler=_scaler_problem,
        optimizer=_optimizer_dict,
    )
    for key, check in checks.items():
        if key in ckpt:
            problem = check(ckpt[key])
            if problem:
                return f"its {key} {problem}"
    return None


def _count(value) -> str | None:
    return None if type(value) is int and value >= 0 else f"is {_shown(value)}, not a count (an integer >= 0)"


def _shown(value) -> str:
    return f"a {type(value).__name__}" if isinstance(value, (dict, list, tuple, torch.Tensor)) else f"{value!r:.40}"


def _sha256_text(value) -> str | None:
    ok = isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value)
    return None if ok else f"is {_shown(value)}, not a sha256 in hex"


def _rng_problem(value) -> str | None:
    ok = torch.is_tensor(value) and value.dtype == torch.uint8 and value.dim() == 1 and value.numel() > 0
    return None if ok else f"is {_shown(value)}, not a random generator's state (a 1-D uint8 tensor)"


def _run_problem(run) -> str | None:
    """A run identity (new_run's): {"id": hex text or None, "parent": None or {**identity, "step": count}}."""
    while run is not None:
        if not isinstance(run, dict) or not {"id", "parent"} <= run.keys():
            return f"is {_shown(run)}, not a run identity (a mapping of id and parent)"
        if run["id"] is not None and not (isinstance(run["id"], str) and re.fullmatch(r"[0-9a-f]{1,64}", run["id"])):
            return f"id is {_shown(run['id'])}, not a run id"
        run = run["parent"]
        if run is not None and _count(run.get("step") if isinstance(run, dict) else None):
            return "parent has no step it branched at"
    return None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _skip_state_problem(state) -> str | None:
    """The spike and non-finite guard's state (update_guard.UpdateGuard.state_dict)."""
    ok = (
        isinstance(state, dict)
        and all(isinstance(state.get(k), list) and all(map(_number, state[k])) for k in ("loss_window", "norm_window"))
        and not _count(state.get("spikes_in_a_row"))
        and not _count(state.get("nonfinite_skipped"))
    )
    return (
        None
        if ok
        else (
            "is not the guards' state (loss_window, norm_window: lists of numbers; spikes_in_a_row, "
            "nonfinite_skipped: counts)"
        )
    )


# the run_config fields a resume reads: RESUME_KEYS (which rows each step reads) and the LR schedule's
_RUN_CONFIG_TYPES = dict(
    seq_len=int,
    total_batch_size=int,
    align_docs=bool,
    shuffle=(bool, type(None)),
    seed=int,
    optimizer=str,
    lr_schedule=str,
    max_steps=int,
    warmup_steps=int,
    max_lr=(int, float),
    min_lr=(int, float, type(None)),
    cooldown_frac=(int, float),
)


def _run_config_problem(config) -> str | None:
    if not isinstance(config, dict):
        return f"is {_shown(config)}, not a mapping"
    for key, kind in _RUN_CONFIG_TYPES.items():
        if key not in config:
            if key in RESUME_KEYS:
                return f"has no {key}"
            continue
        value, kinds = config[key], kind if isinstance(kind, tuple) else (kind,)
        wrong = not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)  # (a bool is an int)
        if wrong or (isinstance(value, float) and not math.isfinite(value)) or (type(value) is int and value < 0):
            return f"{key} is {_shown(value)}"
    return None


def _data_files_problem(files) -> str | None:
    """None, or {"train": [...], "val": [...] or None} of (name, size, ...) entries (data_files)."""
    if files is None:
        return None
    entries = [*(files.get("train") or ()), *(files.get("val") or ())] if isinstance(files, dict) else None
    ok = (
        entries is not None
        and isinstance(files.get("train"), (list, tuple))
        and isinstance(files.get("val"), (list, tuple, type(None)))
        and all(
            isinstance(e, (list, tuple))
            and len(e) >= 2
            and isinstance(e[0], str)
            and not _count(e[1])
            and all(isinstance(x, (str, type(None))) for x in e[2:])
            for e in entries
        )
    )
    return None if ok else "is not a list of shards (name, size, sha256)"


def _scaler_problem(state) -> str | None:
    ok = isinstance(state, dict) and all(_number(v) for v in state.values())
    return None if ok else "is not a gradient scaler's state"


def _optimizer_dict(state) -> str | None:
    return None if isinstance(state, dict) else f"is {_shown(state)}, not an optimizer's state dict"


def gpt_state_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The names and shapes of our GPT's state dict (GPT-2's layout) under a checkpoint's
    model_config, which a checkpoint's weights must match (tests check it against GPT's own)."""
    V, T, C, L = (config[k] for k in ("vocab_size", "block_size", "n_embd", "n_layer"))
    block = {
        "ln_1.weight": (C,),
        "ln_1.bias": (C,),
        "attn.c_attn.weight": (3 * C, C),
        "attn.c_attn.bias": (3 * C,),
        "attn.c_proj.weight": (C, C),
        "attn.c_proj.bias": (C,),
        "ln_2.weight": (C,),
        "ln_2.bias": (C,),
        "mlp.c_fc.weight": (4 * C, C),
        "mlp.c_fc.bias": (4 * C,),
        "mlp.c_proj.weight": (C, 4 * C),
        "mlp.c_proj.bias": (C,),
    }
    return {
        "transformer.wte.weight": (V, C),
        "transformer.wpe.weight": (T, C),
        **{f"transformer.h.{i}.{name}": shape for i in range(L) for name, shape in block.items()},
        "transformer.ln_f.weight": (C,),
        "transformer.ln_f.bias": (C,),
        "lm_head.weight": (V, C),
    }


def state_shape_problem(state, config: dict) -> str | None:
    """How a checkpoint's model weights differ from the names and shapes its config makes (None: they match)."""
    sizes = [config.get(k) for k in ("vocab_size", "block_size", "n_embd", "n_layer", "n_head")]
    if not all(type(n) is int and n > 0 for n in sizes) or sizes[2] % sizes[4]:
        return f"its model_config is not a model's ({', '.join(f'{k} {v!r}' for k, v in config.items())})"
    if not isinstance(state, dict):
        return f"its model weights are a {type(state).__name__}, not a state dict"
    expected = gpt_state_shapes(config)
    for name, shape in expected.items():
        if name not in state:
            return f"its model weights lack {name}"
        got = tuple(state[name].shape) if torch.is_tensor(state[name]) else None
        if got != shape:
            return (
                f"its {name} is {'x'.join(map(str, got)) if got else type(state[name]).__name__}, where its "
                f"model_config makes it {'x'.join(map(str, shape))}"
            )
    extra = [name for name in state if name not in expected]
    return f"its model weights hold {extra[0]}, which its model_config has no place for" if extra else None


def other_file_kind(head: bytes) -> str | None:
    """What a file that begins with head is, where it is plainly not a checkpoint (torch.save's zip
    archive): a token shard, a log, another text file. None: it may be one (loading says)."""
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy array (a token shard?)"
    if not head or head.startswith(b"PK\x03\x04") or b"\x00" in head:  # (zeros: a damaged file, loading says)
        return None
    if head.lstrip().startswith(b"{"):
        return "a JSON text file (a log.jsonl?)"
    with contextlib.suppress(UnicodeDecodeError):
        head.decode()
        return "a text file"
    return None


def first_nonfinite(state: dict) -> str | None:
    """The name of the first floating-point tensor in state that holds a NaN or inf (None: none does)."""
    return next(
        (
            name
            for name, t in state.items()
            if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all()
        ),
        None,
    )


def first_nonfinite_optimizer_state(optim_state) -> str | None:
    """The first optimizer state tensor holding NaN or inf, as "exp_avg of parameter 3" (None: none
    does), in each part of an optimizer made of parts (MuonWithAdamW: {"adamw": ..., "muon": ...})."""
    if isinstance(optim_state, dict) and "state" not in optim_state:
        return next(filter(None, map(first_nonfinite_optimizer_state, optim_state.values())), None)
    states = optim_state.get("state") if isinstance(optim_state, dict) else None
    for i, state in (states if isinstance(states, dict) else {}).items():
        name = first_nonfinite(state) if isinstance(state, dict) else None
        if name:
            return f"{name} of parameter {i}"
    return None


def checkpoint_problem(ckpt, model_fields=None) -> str | None:
    """Why a loaded object is not a checkpoint written by this trainer (None: it looks like one)."""
    if not isinstance(ckpt, dict):
        return f"not a train_gpt2.py checkpoint (it holds a {type(ckpt).__name__}, not a dict)"
    missing = [k for k in ("model", "model_config", "checksum") if k not in ckpt]
    if missing == ["checksum"]:
        return "no checksum: not written by this train_gpt2.py (an older version, or another program)"
    if missing:
        keys = ", ".join(map(str, list(ckpt)[:8])) or "none"
        return f"not a train_gpt2.py checkpoint (no {', '.join(missing)}; its keys: {keys})"
    config = ckpt["model_config"]
    known = set(model_fields) if model_fields is not None else set(config) if isinstance(config, dict) else set()
    if not isinstance(config, dict) or set(config) - known:
        unknown = sorted(map(str, set(config) - known)) if isinstance(config, dict) else [type(config).__name__]
        return f"not a train_gpt2.py checkpoint (unknown model_config {', '.join(unknown)})"
    return None


# ---- run identity: whose a checkpoint (and a log record) is, decided by an id, never by names or sizes


def new_run(branched_from: dict | None = None, step: int | None = None) -> dict:
    """A run's identity: a random 128-bit id, and for a branch its parent run's identity and the
    step it branched at (parent: {**parent's identity, "step": step}), back to the first run."""
    parent = dict(branched_from, step=step) if branched_from else None
    return dict(id=uuid.uuid4().hex, parent=parent)


LEGACY_RUN = dict(id=None, parent=None)  # a checkpoint written before run ids: its folder's one legacy run


def run_of(ckpt: dict) -> dict:
    return ckpt.get("run") or LEGACY_RUN


def run_name(run_id: str | None) -> str:
    return f"run {run_id}" if run_id else "a run from before run ids"


def read_run(path: str) -> dict | None:
    """The run identity in checkpoint path, read without loading its tensors (they stay memory-mapped);
    None where it cannot be read (damaged, removed meanwhile, not ours: loading it says why)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    return run_of(ckpt) if isinstance(ckpt, dict) and not _run_problem(ckpt.get("run")) else None


def log_summary(path: str) -> tuple[str | None, str, bool, bool]:
    """What the log.jsonl at path holds: the "run" of its last record, whose it is in words (a run, a
    run from before run ids, or not a log: no JSON record), whether it holds any record, and whether
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
        return cls(path, ckpt["step"], ckpt["log_offset"], ckpt["log_sha256"], run_of(ckpt))


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
RESUME_KEYS = ("seq_len", "total_batch_size", "align_docs", "shuffle", "seed")


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


def data_change(saved: dict | None, now: dict) -> str | None:
    """How the shards of a checkpoint's run (Trainer.data_files; None in older checkpoints) and
    this run's differ, in words; None when they match."""
    if not saved:
        return None
    for split in ("train", "val"):
        difference = saved[split] is not None and now[split] is not None and differing_file(saved[split], now[split])
        if difference:
            name, then, today = difference
            return f"{split} shard {name}: {then} then, {today} now"
    return None


def data_files(train_paths: list[str], val_paths: list[str] | None) -> dict:
    """The shards a run reads (shards.shard_files: names, sizes, contents, in order): a checkpoint keeps
    them, and a resume compares them (data_change). What the rows are made of, not how a manifest describes
    its inputs: shards made again, byte for byte, from a copy of the input read the same rows. (Checkpoints
    written before kept the manifest's sha256 too; it is not compared.)"""
    return dict(train=shard_files(train_paths), val=shard_files(val_paths) if val_paths else None)


def check_resume_compatible(ckpt: dict, run, model_cfg, path: str):
    """Refuse a resume whose model, rows or optimizer differ from the checkpoint's. A run that does
    not say --shuffle or --no-shuffle (run.shuffle None) takes the checkpoint's order: a run begun
    when reading in order was the default goes on as it began."""
    saved = dict(ckpt["run_config"])
    saved.setdefault("optimizer", "adamw")  # checkpoints from before --optimizer
    if run.shuffle is None:
        run.shuffle = saved["shuffle"]
    diffs = [
        f"{k}: checkpoint {v} vs now {getattr(model_cfg, k)}"
        for k, v in ckpt["model_config"].items()
        if getattr(model_cfg, k) != v
    ]
    diffs += [
        f"{k}: checkpoint {saved[k]} vs now {getattr(run, k)}"
        for k in (*RESUME_KEYS, "optimizer")
        if saved[k] != getattr(run, k)
    ]
    if diffs:
        raise UserError(
            f"cannot resume from {path}: {'; '.join(diffs)}. Use the same model, batch and "
            "optimizer flags (the number of GPUs may change)"
        )
