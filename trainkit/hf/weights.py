"""A Hugging Face GPT-2's weights: a local folder checked from its files' headers before transformers
reads it (check_hf_folder), the checked load (load_hf_model), and the model as our GPT's config and state
dict (gpt2_state_from_hf; docs/hf.md: the layout and the padded rows). transformers imported where used."""

from __future__ import annotations

import contextlib
import os

import torch

from trainkit import fileio
from trainkit.cli import UserError, optional_import, reason_of
from trainkit.fileio import check_regular, open_regular
from trainkit.runfiles.checkpoint_checks import first_nonfinite, gpt_state_shapes, load_failure, structure_problem

# --- a local folder checked -----------------------------------------------------------------------

HF_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older transformers
CONFIG_BYTES = 1 << 20  # a config.json or an index larger than this is none
# the weight files transformers reads, in its order of preference, and their index when they are split
WEIGHTS = (("model.safetensors", "model.safetensors.index.json"), ("pytorch_model.bin", "pytorch_model.bin.index.json"))
SIZES = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
BARE_NAMES = ("wte.", "wpe.", "h.", "ln_f.")  # the Hub's first GPT-2 files name the transformer's tensors so
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", torch.float16, torch.bfloat16, torch.float32, torch.float64}


def file_holding(folder: str, key: str) -> str | None:
    """The file of a local Hugging Face folder that holds tensor key."""
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
            mapping = fileio.read_json(path, CONFIG_BYTES, source).get("weight_map")
            if not (
                isinstance(mapping, dict) and mapping and all(isinstance(s, str) for s in [*mapping, *mapping.values()])
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
    """Refuse a local Hugging Face folder unless config.json gives a GPT-2 of positive sizes and its weight files
    hold exactly that GPT-2's float tensors, before transformers allocates a model of config.json's sizes (an
    n_positions of 10**9; n_layer 2 over 12 layers: 2 loaded silently). defaults: a GPT2Config()."""
    config_path = os.path.join(folder, "config.json")
    if not os.path.exists(config_path):
        return  # transformers' own error says so
    config = fileio.read_json(_inside(folder, "config.json", source), CONFIG_BYTES, source)
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
    _refuse(source, MISSING, sorted(expected.keys() - found.keys()))
    if "lm_head.weight" in found:
        expected["lm_head.weight"] = lm_head
    extra = "its weights hold tensors that a GPT-2 of its config.json's sizes has no place for ({}); config.json"
    extra += f" gives n_layer {sizes['n_layer']}: is it the config of these weights?"
    _refuse(source, extra, sorted(found.keys() - expected.keys()))
    _refuse(source, MISMATCHED, sorted(name for name, shape in expected.items() if found[name][0] != shape))
    not_float = sorted(name for name, (_, dtype) in found.items() if dtype not in FLOAT_DTYPES)
    _refuse(source, "tensors that are not floating point ({})", not_float)


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
            header = fileio.parse_json(f.read(length), path)
        except fileio.JSONFileError as e:
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


MISSING = "tensors missing from its weights ({}) would be random; is it a complete GPT-2?"
MISMATCHED = "tensors of another shape than its config.json gives ({})"


def _refuse(source: str, problem: str, names: list):
    """A UserError where names is not empty: problem with its first names filled in."""
    if names:
        some = f"{', '.join(names[:2])}{', ...' if len(names) > 2 else ''}; {len(names)} in all"
        raise UserError(f"{source}: {problem.format(some)}")


# --- the weights as ours --------------------------------------------------------------------------

PAD_MULTIPLE = 64
# HF Conv1D modules: weight stored (in, out), ours nn.Linear (out, in)
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
INSTALL_HINT = "Hugging Face transformers is not installed: pip install transformers"


def _looks_like_path(name: str) -> bool:
    """Not a Hub id ('name' or 'owner/name'): meant as a local directory."""
    windows = os.sep != "/" and os.sep in name
    return name.startswith(("/", ".", "~")) or name.endswith("/") or name.count("/") > 1 or windows


def _check_hf_config(cfg, source: str):
    """Refuse GPT-2 variants our GPT cannot reproduce exactly."""
    problems = []
    if cfg.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function={cfg.activation_function!r} (ours is tanh-approximated GELU)")
    if abs(cfg.layer_norm_epsilon - 1e-5) > 1e-12:
        problems.append(f"layer_norm_epsilon={cfg.layer_norm_epsilon} (ours is 1e-5)")
    if cfg.n_inner not in (None, 4 * cfg.n_embd):
        problems.append(f"n_inner={cfg.n_inner} (ours is 4 * n_embd)")
    if not cfg.scale_attn_weights or cfg.scale_attn_by_inverse_layer_idx:
        problems.append("non-standard attention scaling")
    if getattr(cfg, "add_cross_attention", False):
        problems.append("cross-attention")
    if problems:
        raise UserError(f"{source}: not a GPT-2 our model can reproduce: {'; '.join(problems)}")


@contextlib.contextmanager
def quiet_transformers():
    """Without transformers' loading report and progress bars: a refusal is our one line."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_hf_model(name_or_dir: str, flag: str = "--init-from"):
    """GPT2LMHeadModel from a Hub name or a local directory, refused unless it is a GPT-2 whose every
    tensor came from there (transformers fills missing ones at random). Errors name flag."""
    transformers = optional_import("transformers", INSTALL_HINT)
    GPT2Config, GPT2LMHeadModel = transformers.GPT2Config, transformers.GPT2LMHeadModel
    local = os.path.isdir(name_or_dir)
    source = f"{flag} {name_or_dir}"
    hint = (
        f"pass a local Hugging Face directory to {flag} (on a machine with internet: "
        "GPT2LMHeadModel.from_pretrained('gpt2').save_pretrained('gpt2_hf'))"
    )
    if os.path.isfile(name_or_dir):  # most often one of our checkpoints
        ours = {
            "--init-from": "--resume PATH continues a train_gpt2.py checkpoint's run; to start a new run from its "
            "weights, export it (hf_interop.py export PATH DIR) and pass --init-from DIR",
            "--hf-model": "for a train_gpt2.py checkpoint pass --checkpoint PATH",
        }.get(flag, hint)
        raise UserError(
            f"{source} is a file, and {flag} takes a Hugging Face GPT-2: a Hub name (gpt2, ...) or a "
            f"folder written by save_pretrained; {ours}"
        )
    if not local and _looks_like_path(name_or_dir):
        raise UserError(f"{source}: no such directory; {hint}")

    def load(what):
        try:
            with quiet_transformers():
                return what()
        except Exception as e:  # OSError (files, Hub), ValueError, RuntimeError, SafetensorError (damage)
            where = "directory" if local else "Hugging Face Hub model"
            raise UserError(f"{source}: cannot load the {where} ({reason_of(e)}); {hint}") from e

    if local:  # its files are checked before transformers reads them: a refusal allocates nothing
        check_hf_folder(name_or_dir, source, GPT2Config())
    model_type = load(lambda: GPT2Config.get_config_dict(name_or_dir, local_files_only=local)[0]).get("model_type")
    if model_type not in (None, "gpt2"):
        raise UserError(f"{source}: its config.json describes a {model_type!r} model, not GPT-2")
    hf, info = load(
        lambda: GPT2LMHeadModel.from_pretrained(
            name_or_dir, local_files_only=local, output_loading_info=True, ignore_mismatched_sizes=True
        )
    )
    _check_every_tensor_loaded(hf.config, info, source)
    return hf


def _check_every_tensor_loaded(cfg, info: dict, source: str):
    """Refuse a model that transformers completed at random: a tensor missing, or of another shape."""
    tied = getattr(cfg, "tie_word_embeddings", True)
    missing = [k for k in info["missing_keys"] if not k.endswith(HF_BUFFERS) and not (tied and k == "lm_head.weight")]
    mismatched = [item[0] if isinstance(item, tuple) else item for item in info["mismatched_keys"]]
    _refuse(source, MISSING, sorted(missing))
    _refuse(source, MISMATCHED, sorted(mismatched))


def gpt2_state_from_hf(
    name_or_dir: str, vocab_size=None, block_size=None, flag="--init-from", pad_multiple=PAD_MULTIPLE
) -> tuple[dict, dict]:
    """(GPTConfig fields, state dict) of our GPT (fp32, CPU) holding a Hugging Face GPT2LMHeadModel's
    weights. vocab_size: default the HF vocabulary padded to a multiple of pad_multiple (1: unpadded);
    block_size: at most n_positions (the first positions kept). Padded rows: the mean row (docs/hf.md)."""
    source = f"{flag} {name_or_dir}"  # the flag of the command being run
    hf = load_hf_model(name_or_dir, flag)
    cfg = hf.config
    _check_hf_config(cfg, source)
    hf_sd = {k: v.detach().float() for k, v in hf.state_dict().items() if not k.endswith(HF_BUFFERS)}
    bad = first_nonfinite(hf_sd)
    if bad:
        raise UserError(f"{file_holding(name_or_dir, bad) or source}: the weights hold NaN or inf ({bad})")
    if "lm_head.weight" in hf_sd and not torch.equal(hf_sd["lm_head.weight"], hf_sd["transformer.wte.weight"]):
        raise UserError(f"{source}: lm_head is not tied to the token embedding; our GPT ties them")
    n_real = cfg.vocab_size
    vocab_size = -(-n_real // pad_multiple) * pad_multiple if vocab_size is None else vocab_size
    if vocab_size < n_real:
        raise UserError(f"--vocab-size {vocab_size} is smaller than {source}'s vocabulary of {n_real}")
    block_size = cfg.n_positions if block_size is None else block_size
    if not 0 < block_size <= cfg.n_positions:
        raise UserError(f"--block-size {block_size} must be in 1..{cfg.n_positions} ({source}'s n_positions)")

    config = dict(
        block_size=block_size, vocab_size=vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd
    )
    sd = {key: (value.t() if key.endswith(TRANSPOSED) else value).contiguous() for key, value in hf_sd.items()}
    wte = sd["transformer.wte.weight"]
    wte = torch.cat([wte, wte.mean(0, keepdim=True).expand(vocab_size - n_real, -1)])
    sd["transformer.wte.weight"] = sd["lm_head.weight"] = wte
    sd["transformer.wpe.weight"] = sd["transformer.wpe.weight"][:block_size]
    return config, sd
