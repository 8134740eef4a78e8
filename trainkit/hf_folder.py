"""A local Hugging Face GPT-2 folder checked before transformers builds a model from it (check_hf_folder):
config.json's sizes, and weight files inside the folder holding exactly that GPT-2's float tensors, read
from the files' headers without loading the tensors."""

from __future__ import annotations

import contextlib
import os

import torch

from trainkit import json_file
from trainkit.checkpoint_checks import gpt_state_shapes, load_failure, structure_problem
from trainkit.cli import UserError, reason_of
from trainkit.regular_file import check_regular, open_regular

HF_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older transformers
CONFIG_BYTES = 1 << 20  # a config.json or an index larger than this is none
# the weight files transformers reads, in its order of preference, and their index when they are split
WEIGHTS = (("model.safetensors", "model.safetensors.index.json"), ("pytorch_model.bin", "pytorch_model.bin.index.json"))
SIZES = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
BARE_NAMES = ("wte.", "wpe.", "h.", "ln_f.")  # the Hub's first GPT-2 files name the transformer's tensors so
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", torch.float16, torch.bfloat16, torch.float32, torch.float64}


def file_holding(folder: str, key: str) -> str | None:
    """The file of a local Hugging Face folder that holds tensor key (through its index)."""
    with contextlib.suppress(UserError, OSError):
        files = weight_files(folder, "")
        return files.get(key) or files.get(key.removeprefix("transformer.")) or files.get("")
    return None


def weight_files(folder: str, source: str) -> dict[str, str]:
    """{tensor name: its file} from the index ({"": file} for a single file); an index naming a file
    outside folder (a path up, absolute, a subfolder) is refused."""
    for single, index in WEIGHTS:
        if os.path.exists(os.path.join(folder, single)):
            return {"": _inside(folder, single, source)}
        if os.path.exists(os.path.join(folder, index)):
            path = _inside(folder, index, source)
            mapping = json_file.read(path, CONFIG_BYTES, source).get("weight_map")
            if (
                not isinstance(mapping, dict)
                or not mapping
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items())
            ):
                raise UserError(f"{source}: {path} has no weight_map of tensor names to file names")
            return {name: _inside(folder, file, source, index) for name, file in mapping.items()}
    return {}


def _inside(folder: str, name: str, source: str, index: str | None = None) -> str:
    """folder/name, a regular file directly inside folder (a UserError otherwise)."""
    if not name or name != os.path.basename(name) or name in (".", "..") or (os.altsep and os.altsep in name):
        raise UserError(
            f"{source}: its {index} names the weight file {name!r}, outside the folder: only files inside it are read"
        )
    path = os.path.join(folder, name)
    try:
        check_regular(path)
    except UserError as e:  # a named pipe, a device
        raise UserError(f"{source}: {e}") from None
    except OSError as e:
        raise UserError(f"{source}: {'its ' + index + ' names ' if index else ''}{path}: {reason_of(e)}") from None
    return path


def check_hf_folder(folder: str, source: str, defaults) -> None:
    """Refuse a local Hugging Face folder unless config.json gives a GPT-2 of positive sizes and its weight
    files hold exactly that GPT-2's tensors, of float dtypes: compared before transformers allocates a model
    of config.json's sizes (an n_positions of 10**9: gigabytes; n_layer 2 over 12 layers: 2 loaded silently).
    defaults: a GPT2Config(), whose sizes a config.json without them takes."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.exists(config_path):
        return  # transformers' own error says so
    config = json_file.read(_inside(folder, "config.json", source), CONFIG_BYTES, source)
    if config.get("model_type", "gpt2") != "gpt2":
        return  # refused by model type, as transformers reads it
    sizes = {k: config.get(k, getattr(defaults, k)) for k in SIZES}
    bad = [f"{k} {v!r}" for k, v in sizes.items() if type(v) is not int or not 0 < v <= 2**31]
    if bad or sizes["n_embd"] % sizes["n_head"]:
        raise UserError(
            f"{source}: its config.json gives {', '.join(bad) or 'n_embd not a multiple of n_head'}: "
            "not the sizes of a GPT-2 (positive integers)"
        )
    files = weight_files(folder, source)
    if not files:
        return  # transformers' own error says there are no weights
    found = {}
    for path in sorted(set(files.values())):
        found.update(
            {
                f"transformer.{name}" if name.startswith(BARE_NAMES) else name: info
                for name, info in _tensor_headers(path, source).items()
                if not name.endswith(HF_BUFFERS)
            }
        )
    expected = gpt_state_shapes(sizes, conv1d=True)
    lm_head = expected.pop("lm_head.weight")  # (tied: a file may hold it or not)
    missing = sorted(expected.keys() - found.keys())
    if missing:
        raise UserError(
            f"{source}: tensors missing from its weights ({some_names(missing)}) would be random; is it a complete GPT-2?"
        )
    if "lm_head.weight" in found:
        expected["lm_head.weight"] = lm_head
    extra = sorted(found.keys() - expected.keys())
    if extra:
        raise UserError(
            f"{source}: its weights hold tensors that a GPT-2 of its config.json's sizes has no place "
            f"for ({some_names(extra)}); config.json gives n_layer {sizes['n_layer']}: is it the config of "
            "these weights?"
        )
    mismatched = sorted(name for name, shape in expected.items() if found[name][0] != shape)
    if mismatched:
        raise UserError(f"{source}: tensors of another shape than its config.json gives ({some_names(mismatched)})")
    not_float = sorted(name for name, (_, dtype) in found.items() if dtype not in FLOAT_DTYPES)
    if not_float:
        raise UserError(f"{source}: tensors that are not floating point ({some_names(not_float)})")


def _tensor_headers(path: str, source: str) -> dict[str, tuple[tuple[int, ...], object]]:
    """{name: (shape, dtype)} of a weight file's tensors: a safetensors file's JSON header, or a .bin
    loaded memory-mapped and checked as a checkpoint is (structure_problem)."""
    if path.endswith(".bin"):
        try:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:  # the format before torch 1.6 cannot be memory-mapped: read it
                if "zipfile" not in str(e):
                    raise
                state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many types for a damaged zip or pickle
            raise UserError(f"{source}: cannot load {path} ({load_failure(e)})") from None
        problem = structure_problem(state) if isinstance(state, dict) else f"it holds a {type(state).__name__}"
        if problem or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
            raise UserError(f"{source}: {path} is not a state dict of plain tensors ({problem or 'other values'})")
        return {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
    with open_regular(path) as f:
        head = f.read(8)
        size = os.fstat(f.fileno()).st_size
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(size - 8, 100 << 20):
            raise UserError(f"{source}: {path} is not a safetensors file (its header length is wrong)")
        try:
            header = json_file.parse(f.read(length), path)
        except json_file.JSONFileError as e:
            raise UserError(f"{source}: {e}: not a safetensors file's header") from None
    if not isinstance(header, dict):
        raise UserError(f"{source}: {path} is not a safetensors file (its header is no JSON object)")
    found = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
            raise UserError(f"{source}: {path} is not a safetensors file (tensor {name!r:.60} has no shape)")
        found[name] = (tuple(shape), info.get("dtype"))
    return found


def some_names(names: list) -> str:
    return f"{', '.join(names[:2])}{', ...' if len(names) > 2 else ''}; {len(names)} in all"
