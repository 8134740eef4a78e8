"""What a loaded checkpoint must be before anything trusts it (structure, fields, shapes, finite numbers),
checked before any tensor's contents are read; each check returns the problem in words, or None."""

from __future__ import annotations

import contextlib
import math
import re

import torch

from trainkit.cli import reason_of

# the run_config fields a resume must keep: which rows each step reads, and which optimizer's state it holds
RESUME_KEYS = ("seq_len", "total_batch_size", "align_docs", "shuffle", "seed", "optimizer")

# what a resume reads besides the model: a checkpoint without one of them only evaluates, samples, exports
RESUME_STATE = tuple("optimizer step run_config launch data_files rng_cpu log_offset log_sha256 skip_state run".split())
# deeper than any checkpoint written (an optimizer state 5 levels, a run identity +1 per branch), far below
# the recursion limit state_digest's walk would reach
MAX_NESTING = 100
MAX_NODES = 10_000_000  # values in all, counted as state_digest visits them (a shared list once per place)


def structure_problem(ckpt: dict) -> str | None:
    """What makes a loaded checkpoint costlier to read than its file (an expanded tensor, deep nesting), or None."""
    stack, nodes, storages, tensor_bytes = [("", ckpt, 0)], 0, {}, 0
    while stack:
        where, value, depth = stack.pop()
        nodes += 1
        if depth > MAX_NESTING:
            return f"its structure nests deeper than {MAX_NESTING} levels (at {where[:80]}...)"
        if nodes > MAX_NODES:
            return f"its structure holds more than {MAX_NODES} values"
        if isinstance(value, dict):
            stack.extend((f"{where}[{k!r:.40}]", v, depth + 1) for k, v in value.items())
            stack.extend((where, k, depth + 1) for k in value if isinstance(k, (tuple, torch.Tensor)))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{where}[{i}]", v, depth + 1) for i, v in enumerate(value))
        elif isinstance(value, torch.Tensor):
            if problem := _tensor_problem(value):
                return f"its tensor {where or '(top)'} {problem}"
            key = (value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
            storages[key] = max(storages.get(key, 0), (value.storage_offset() + value.numel()) * value.element_size())
            tensor_bytes += value.numel() * value.element_size()
    for (_, nbytes), viewed in storages.items():
        if nbytes > viewed:
            return f"a tensor's storage holds {nbytes} bytes, of which its tensors view {viewed}"
    if tensor_bytes > 2 * (stored := sum(nbytes for _, nbytes in storages)):
        return f"its tensors view {tensor_bytes} bytes of {stored} stored (one storage viewed by many tensors)"
    return None


def _tensor_problem(t: torch.Tensor) -> str | None:
    if t.layout != torch.strided or t.device.type != "cpu" or t.is_quantized:
        return f"is a {t.layout} {t.device.type} tensor, not a plain one"
    shape = "x".join(map(str, t.shape)) or "a scalar"
    expected = torch.empty(t.shape, device="meta").stride()  # a stored (contiguous) tensor's
    if any(stride != want for stride, want, size in zip(t.stride(), expected, t.shape) if size > 1):
        return f"of {shape} has strides {tuple(t.stride())}, not those of a stored tensor (expanded or a view)"
    if (t.storage_offset() + t.numel()) * t.element_size() > t.untyped_storage().nbytes():
        return f"of {shape} views more than its storage's {t.untyped_storage().nbytes()} bytes"
    return None


def load_failure(e: Exception) -> str:
    """Why torch.load(weights_only=True) failed, in words (never torch's unsafe weights_only=False advice)."""
    what = reason_of(e, typed=True)
    if "Weights only load failed" in what:
        return "it holds pickled objects other than tensors and plain values, which are never loaded"
    return what


def _shown(value) -> str:
    return f"a {type(value).__name__}" if isinstance(value, (dict, list, tuple, torch.Tensor)) else f"{value!r:.40}"


def _must_be(ok, what: str, show: bool = True):
    """A field's check: None where ok(value), else "is <value>, not <what>" (show=False: "is not <what>")."""
    return lambda value: None if ok(value) else f"is {_shown(value)}, not {what}" if show else f"is not {what}"


_count = _must_be(lambda v: type(v) is int and v >= 0, "a count (an integer >= 0)")
_rng = _must_be(
    lambda v: torch.is_tensor(v) and v.dtype == torch.uint8 and v.dim() == 1 and v.numel() > 0,
    "a random generator's state (a 1-D uint8 tensor)",
)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run_problem(run) -> str | None:
    """A run identity (new_run's): {"id": hex text, "parent": None or {**identity, "step": count}}."""
    while run is not None:
        if not isinstance(run, dict) or not {"id", "parent"} <= run.keys():
            return f"is {_shown(run)}, not a run identity (a mapping of id and parent)"
        if not (isinstance(run["id"], str) and re.fullmatch(r"[0-9a-f]{1,64}", run["id"])):
            return f"id is {_shown(run['id'])}, not a run id"
        run = run["parent"]
        if run is not None and _count(run.get("step") if isinstance(run, dict) else None):
            return "parent has no step it branched at"
    return None


def _is_skip_state(state) -> bool:  # recovery.UpdateGuard.state_dict
    return (
        isinstance(state, dict)
        and all(isinstance(state.get(k), list) and all(map(_number, state[k])) for k in ("loss_window", "norm_window"))
        and not _count(state.get("spikes_in_a_row"))
        and not _count(state.get("nonfinite_skipped"))
    )


def _is_shard_list(files) -> bool:  # {"train": [...], "val": [...] or None} of (name, size, sha256...) entries
    return (
        isinstance(files, dict)
        and isinstance(files.get("train"), (list, tuple))
        and isinstance(files.get("val"), (list, tuple, type(None)))
        and all(
            isinstance(e, (list, tuple))
            and len(e) >= 2
            and isinstance(e[0], str)
            and not _count(e[1])
            and all(isinstance(x, (str, type(None))) for x in e[2:])
            for e in [*files["train"], *(files["val"] or ())]
        )
    )


_NUMBER, _NONE = (int, float), type(None)
# the run_config fields a resume reads (RESUME_KEYS and the LR schedule's), and the types each may hold
_RUN_CONFIG_TYPES = dict(
    zip(
        (*RESUME_KEYS, "lr_schedule", "max_steps", "warmup_steps", "max_lr", "min_lr", "cooldown_frac"),
        (int, int, bool, (bool, _NONE), int, str, str, int, int, _NUMBER, (*_NUMBER, _NONE), _NUMBER),
    )
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


_GUARDS_STATE = (
    "the guards' state (loss_window, norm_window: lists of numbers; spikes_in_a_row, nonfinite_skipped: counts)"
)
# each field a checkpoint may hold but the model, checked in this order where present
_FIELD_CHECKS = dict(
    step=_count,
    run=run_problem,
    log_offset=_count,
    log_sha256=_must_be(lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v), "a sha256 in hex"),
    rng_cpu=_rng,
    rng_cuda=_rng,
    skip_state=_must_be(_is_skip_state, _GUARDS_STATE, show=False),
    run_config=_run_config_problem,
    data_files=_must_be(_is_shard_list, "a list of shards (name, size, sha256)", show=False),
    scaler=_must_be(
        lambda v: isinstance(v, dict) and all(map(_number, v.values())), "a gradient scaler's state", False
    ),
    optimizer=_must_be(lambda v: isinstance(v, dict), "an optimizer's state dict"),
)


def fields_problem(ckpt: dict, resume: bool) -> str | None:
    """What is wrong with a checkpoint's fields but the model (types, ranges; to resume, presence), or None."""
    if resume and (missing := [k for k in RESUME_STATE if k not in ckpt]):
        return f"it holds no {', '.join(missing)} to resume from (weights only)"
    for key, check in _FIELD_CHECKS.items():
        if key in ckpt and (problem := check(ckpt[key])):
            return f"its {key} {problem}"
    return None


def gpt_state_shapes(config: dict, conv1d: bool = False) -> dict[str, tuple[int, ...]]:
    """A GPT-2 state dict's names and shapes under a model_config; conv1d: Hugging Face's layout."""
    V, C, L = (config[k] for k in ("vocab_size", "n_embd", "n_layer"))
    T = config["n_positions" if conv1d else "block_size"]

    block = {}  # each layer's weight and bias: (n_out, n_in), or 0 for n_in where a layer norm's weight is (C,)
    attn = {"ln_1": (C, 0), "attn.c_attn": (3 * C, C), "attn.c_proj": (C, C)}
    mlp = {"ln_2": (C, 0), "mlp.c_fc": (4 * C, C), "mlp.c_proj": (C, 4 * C)}
    for name, (n_out, n_in) in {**attn, **mlp}.items():
        weight = (C,) if not n_in else (n_in, n_out) if conv1d else (n_out, n_in)
        block |= {f"{name}.weight": weight, f"{name}.bias": (n_out,)}
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
    """What a file beginning with head is where it is plainly no checkpoint (a shard, a log, text); None: it may be."""
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
    for name, t in state.items():
        if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all():
            return name
    return None


def first_nonfinite_optimizer_state(optim_state) -> str | None:
    """The first optimizer state tensor holding NaN or inf, as "exp_avg of parameter 3" (None: none does)."""
    if isinstance(optim_state, dict) and "state" not in optim_state:
        return next(filter(None, map(first_nonfinite_optimizer_state, optim_state.values())), None)
    states = optim_state.get("state") if isinstance(optim_state, dict) else None
    for i, state in (states if isinstance(states, dict) else {}).items():
        if isinstance(state, dict) and (name := first_nonfinite(state)):
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
