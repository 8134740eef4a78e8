"""A Hugging Face GPT-2 as our GPT's config and state dict (gpt2_state_from_hf: --init-from, sample.py
--hf-model), from the checked GPT2LMHeadModel load (load_hf_model: hellaswag.py --hf-model). Conv1D
weights are transposed, mask buffers skipped, and the vocabulary padded with rows set to the mean of
the real ones (docs/hf.md says why). transformers is imported only inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import os

import torch

from trainkit.checkpoint_checks import first_nonfinite
from trainkit.cli import UserError, optional_import, reason_of
from trainkit.hf_folder import HF_BUFFERS, check_hf_folder, file_holding, some_names

PAD_MULTIPLE = 64
# HF Conv1D modules: weight stored (in, out), ours nn.Linear (out, in)
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
INSTALL_HINT = "Hugging Face transformers is not installed: pip install transformers"


def import_transformers():
    transformers = optional_import("transformers", INSTALL_HINT)
    return transformers.GPT2Config, transformers.GPT2LMHeadModel


def _looks_like_path(name: str) -> bool:
    """A Hub id is 'name' or 'owner/name'; anything else is meant as a local directory."""
    return (
        name.startswith(("/", ".", "~"))
        or name.endswith("/")
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def _padded(n: int, multiple: int = PAD_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


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
    GPT2Config, GPT2LMHeadModel = import_transformers()
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
    missing = sorted(
        k for k in info["missing_keys"] if not k.endswith(HF_BUFFERS) and not (tied and k == "lm_head.weight")
    )
    if missing:
        raise UserError(
            f"{source}: tensors missing from its weights ({some_names(missing)}) would be random; is it a complete GPT-2?"
        )
    mismatched = sorted(item[0] if isinstance(item, tuple) else item for item in info["mismatched_keys"])
    if mismatched:
        raise UserError(f"{source}: tensors of another shape than its config.json gives ({some_names(mismatched)})")


def gpt2_state_from_hf(
    name_or_dir: str,
    vocab_size: int | None = None,
    block_size: int | None = None,
    pad_init: str = "mean",
    flag: str = "--init-from",
    pad_multiple: int = PAD_MULTIPLE,
) -> tuple[dict, dict]:
    """(GPTConfig fields, state dict) of our GPT (fp32, CPU) holding a Hugging Face GPT2LMHeadModel's
    weights. vocab_size: default the HF vocabulary padded to a multiple of pad_multiple (1: unpadded);
    block_size: at most n_positions (the first positions kept); pad_init: "mean" or "zero" padded rows."""
    if pad_init not in ("mean", "zero"):
        raise ValueError(f"pad_init must be 'mean' or 'zero', got {pad_init!r}")
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
    vocab_size = _padded(n_real, pad_multiple) if vocab_size is None else vocab_size
    if vocab_size < n_real:
        raise UserError(f"--vocab-size {vocab_size} is smaller than {source}'s vocabulary of {n_real}")
    block_size = cfg.n_positions if block_size is None else block_size
    if not 0 < block_size <= cfg.n_positions:
        raise UserError(f"--block-size {block_size} must be in 1..{cfg.n_positions} ({source}'s n_positions)")

    config = dict(
        block_size=block_size, vocab_size=vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd
    )
    sd = {}
    for key, value in hf_sd.items():
        if key.endswith(TRANSPOSED):
            value = value.t()
        sd[key] = value.contiguous()
    wte = sd["transformer.wte.weight"]
    pad_rows = wte.mean(0, keepdim=True) if pad_init == "mean" else wte.new_zeros(1, wte.size(1))
    wte = torch.cat([wte, pad_rows.expand(vocab_size - n_real, -1)])
    sd["transformer.wte.weight"] = sd["lm_head.weight"] = wte
    sd["transformer.wpe.weight"] = sd["transformer.wpe.weight"][:block_size]
    return config, sd
