"""Move GPT-2 weights between Hugging Face transformers and our train_gpt2.GPT.

    python hf_interop.py export out/ckpt_0019073.pt gpt2_ours_hf   # our checkpoint -> HF directory
    python hf_interop.py eval out/gpt2-124M --tasks hellaswag,arc_easy  # lm-evaluation-harness on it

This module reads and writes tensors and configs; it never imports the trainer. The model builds
itself from what it returns (train_gpt2.GPT.from_hf, which --init-from and sample.py use):

    config, state = gpt2_state_from_hf("gpt2")   # Hub name (needs internet) or a local HF directory

transformers is optional: it is imported only inside the functions that need it.

Layout differences the conversion handles:
- HF's GPT-2 keeps its projections in Conv1D modules whose weight is (in, out); our nn.Linear
  weights are (out, in), so attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj are transposed.
- HF's attention mask buffers (attn.bias, attn.masked_bias; gone in recent versions) are skipped.
- Our vocabulary is padded (50257 -> 50304, a multiple of 64, for faster matmuls). The padded
  ids carry no probability: every softmax of ours runs over GPT-2's 50257 ids only
  (fineweb.real_vocab_size), so an imported GPT-2 has the original's loss exactly, and on export
  the padded rows are dropped. Only a model with fewer ids than GPT-2's (a test's vocabulary of
  100, padded to 128) counts every id as real; for it matters that on import the padded rows of
  the tied wte/lm_head matrix are set to the MEAN of the real rows, not to zero: GPT-2-like logits are
  large and negative (tens below zero), so zero rows would give the padded ids logit 0, above
  every real token, and nearly all the probability. With the mean row a padded logit is the mean
  of the real logits, and by Jensen's inequality all padded ids together get at most
  n_padded / n_real of the probability, so the loss starts within log(1 + n_padded / n_real)
  nats of the original model's. Logits of the real ids are unchanged.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile

import cli  # the error contract shared by every script; standard library only, so it comes first

# -----------------------------------------------------------------------------
# command line (standard library only: --help and usage errors answer before torch is imported)


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.ArgumentParser(description="Convert between train_gpt2.py checkpoints and Hugging Face GPT-2.")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write a checkpoint as a Hugging Face GPT-2 directory")
    e.add_argument("checkpoint", help="a checkpoint written by train_gpt2.py: a ckpt_*.pt file, or a run's "
                                      "--out-dir folder for its newest checkpoint")
    e.add_argument("out_dir", help="directory for config.json and model.safetensors")
    e.add_argument("--vocab-size", type=cli.positive_int, help="rows to keep (default: 50257, dropping the padding)")
    e.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for errors")
    add_eval_parser(sub)
    return p.parse_args(argv)


def add_eval_parser(sub):
    e = sub.add_parser("eval", help="run lm-evaluation-harness tasks on a checkpoint (exported to a temporary "
                                    "Hugging Face directory)")
    e.add_argument("checkpoint", help="a checkpoint written by train_gpt2.py: a ckpt_*.pt file, or a run's "
                                      "--out-dir folder for its newest checkpoint")
    e.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated (hellaswag,arc_easy,...)")
    e.add_argument("--hellaswag-file", help="local hellaswag_val.jsonl: hellaswag runs from it through "
                                            "evals/hellaswag_local.yaml, without the Hub")
    e.add_argument("--limit", type=cli.positive_int, help="examples per task (default: all)")
    e.add_argument("--num-fewshot", type=cli.non_negative_int,
                   help="few-shot examples (default: each task's own, 0 for hellaswag)")
    e.add_argument("--batch-size", type=cli.positive_int, default=8, help="lm-eval's batch size (default 8)")
    e.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    e.add_argument("--samples-dir", help="write each task's per-example results to DIR/TASK.jsonl")
    e.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for errors")


if __name__ == "__main__":
    cli.exit_on_ctrl_c_while_starting()
    parse_args()  # --help, or a usage error: answered now, before the slow imports

import torch

from checkpoints import first_nonfinite, latest_checkpoint, load_checkpoint, unwrap_model
from cli import UserError, exit_code_of
from fineweb import EOT, EOT_TEXT, GPT2_VOCAB, get_encoding, os_error_reason, real_vocab_size

PAD_MULTIPLE = 64
# HF Conv1D modules: weight stored (in, out), ours nn.Linear (out, in)
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
HF_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of older transformers
TIED = ("transformer.wte.weight", "lm_head.weight")
EXPORTED_CONFIG = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")  # what GPT2Config can say of ours
INSTALL_HINT = "Hugging Face transformers is not installed: pip install transformers"


def _import_transformers():
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    return GPT2Config, GPT2LMHeadModel


def _looks_like_path(name: str) -> bool:
    """A Hub id is 'name' or 'owner/name'; anything else is meant as a local directory."""
    return (name.startswith(("/", ".", "~")) or name.endswith("/") or name.count("/") > 1
            or (os.sep != "/" and os.sep in name))


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
def _quiet_transformers():
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
    """GPT2LMHeadModel from a Hub name or a local directory, refused unless it is a GPT-2 whose
    every tensor came from there (transformers fills missing ones at random, so a BERT or LLaMA
    folder would load as a random GPT-2). Errors name the user's flag."""
    GPT2Config, GPT2LMHeadModel = _import_transformers()
    local = os.path.isdir(name_or_dir)
    source = f"{flag} {name_or_dir}"
    hint = (f"pass a local Hugging Face directory to {flag} (on a machine with internet: "
            "GPT2LMHeadModel.from_pretrained('gpt2').save_pretrained('gpt2_hf'))")
    if os.path.isfile(name_or_dir):  # most often one of our checkpoints
        ours = {"--init-from": "--resume PATH continues a train_gpt2.py checkpoint's run; to start a new run from its "
                "weights, export it (hf_interop.py export PATH DIR) and pass --init-from DIR",
                "--hf-model": "for a train_gpt2.py checkpoint pass --checkpoint PATH"}.get(flag, hint)
        raise UserError(f"{source} is a file, and {flag} takes a Hugging Face GPT-2: a Hub name (gpt2, ...) or a "
                        f"folder written by save_pretrained; {ours}")
    if not local and _looks_like_path(name_or_dir):
        raise UserError(f"{source}: no such directory; {hint}")

    def load(what):
        try:
            with _quiet_transformers():
                return what()
        except Exception as e:  # OSError (files, Hub), ValueError, RuntimeError, SafetensorError (damage)
            where = "directory" if local else "Hugging Face Hub model"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{source}: cannot load the {where} ({first}); {hint}") from e

    model_type = load(lambda: GPT2Config.get_config_dict(name_or_dir, local_files_only=local)[0]).get("model_type")
    if model_type not in (None, "gpt2"):
        raise UserError(f"{source}: its config.json describes a {model_type!r} model, not GPT-2")
    hf, info = load(lambda: GPT2LMHeadModel.from_pretrained(
        name_or_dir, local_files_only=local, output_loading_info=True, ignore_mismatched_sizes=True))
    _check_every_tensor_loaded(hf.config, info, source)
    return hf


def _weights_file(folder: str, key: str) -> str | None:
    """The file of a local Hugging Face folder that holds tensor key (a shard's, through its index)."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        with contextlib.suppress(OSError, ValueError, LookupError, TypeError):
            with open(os.path.join(folder, index)) as f:
                return os.path.join(folder, json.load(f)["weight_map"][key])
    return None


def _check_every_tensor_loaded(cfg, info: dict, source: str):
    """Refuse a model that transformers completed at random: a tensor missing from the files,
    or of another shape than config.json gives (loaded with ignore_mismatched_sizes to list them)."""
    tied = getattr(cfg, "tie_word_embeddings", True)
    missing = sorted(k for k in info["missing_keys"]
                     if not k.endswith(HF_BUFFERS) and not (tied and k == "lm_head.weight"))
    if missing:
        raise UserError(f"{source}: tensors missing from its weights ({_some(missing)}) would be random; "
                        "is it a complete GPT-2?")
    mismatched = sorted(item[0] if isinstance(item, tuple) else item for item in info["mismatched_keys"])
    if mismatched:
        raise UserError(f"{source}: tensors of another shape than its config.json gives ({_some(mismatched)})")


def _some(names: list) -> str:
    return f"{', '.join(names[:2])}{', ...' if len(names) > 2 else ''}; {len(names)} in all"


def gpt2_state_from_hf(name_or_dir: str, vocab_size: int | None = None, block_size: int | None = None,
                       pad_init: str = "mean", flag: str = "--init-from",
                       pad_multiple: int = PAD_MULTIPLE) -> tuple[dict, dict]:
    """(model config, state dict) of our GPT (fp32, CPU) holding the weights of a Hugging Face
    GPT2LMHeadModel: the config's keys are GPTConfig's, the state dict's our parameter names.

    name_or_dir: gpt2, gpt2-medium, gpt2-large, gpt2-xl (Hub, needs internet) or a local
    directory written by save_pretrained. vocab_size: ours, >= the HF vocabulary (default:
    the HF vocabulary rounded up to a multiple of pad_multiple, 64: 50304 for GPT-2; sampling
    passes 1, the HF vocabulary itself, so that no padded id is drawn). block_size: at most
    the HF n_positions (default: n_positions); a smaller one keeps the first positions.
    pad_init: "mean" (default, see the module docstring) or "zero" for the padded rows.
    flag: the command-line flag that named the model, for error messages."""
    if pad_init not in ("mean", "zero"):
        raise ValueError(f"pad_init must be 'mean' or 'zero', got {pad_init!r}")
    source = f"{flag} {name_or_dir}"  # the flag of the command being run
    hf = load_hf_model(name_or_dir, flag)
    cfg = hf.config
    _check_hf_config(cfg, source)
    hf_sd = {k: v.detach().float() for k, v in hf.state_dict().items() if not k.endswith(HF_BUFFERS)}
    bad = first_nonfinite(hf_sd)
    if bad:
        raise UserError(f"{_weights_file(name_or_dir, bad) or source}: the weights hold NaN or inf ({bad})")
    if "lm_head.weight" in hf_sd and not torch.equal(hf_sd["lm_head.weight"], hf_sd["transformer.wte.weight"]):
        raise UserError(f"{source}: lm_head is not tied to the token embedding; our GPT ties them")
    n_real = cfg.vocab_size
    vocab_size = _padded(n_real, pad_multiple) if vocab_size is None else vocab_size
    if vocab_size < n_real:
        raise UserError(f"--vocab-size {vocab_size} is smaller than {source}'s vocabulary of {n_real}")
    block_size = cfg.n_positions if block_size is None else block_size
    if not 0 < block_size <= cfg.n_positions:
        raise UserError(f"--block-size {block_size} must be in 1..{cfg.n_positions} ({source}'s n_positions)")

    config = dict(block_size=block_size, vocab_size=vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                  n_embd=cfg.n_embd)
    sd = {}
    for key, value in hf_sd.items():
        if key.endswith(TRANSPOSED):
            value = value.t()
        sd[key] = value.contiguous()
    wte = sd["transformer.wte.weight"]
    pad_rows = (wte.mean(0, keepdim=True) if pad_init == "mean" else wte.new_zeros(1, wte.size(1)))
    wte = torch.cat([wte, pad_rows.expand(vocab_size - n_real, -1)])
    sd["transformer.wte.weight"] = sd["lm_head.weight"] = wte
    sd["transformer.wpe.weight"] = sd["transformer.wpe.weight"][:block_size]
    return config, sd


def _check_parent(out_dir: str):
    """An export goes into a folder it makes (or replaces) in an existing one: a missing parent is named."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise UserError(f"cannot write the Hugging Face model to {out_dir}: the folder it goes into, {parent}, "
                        f"{'is a file' if os.path.exists(parent) else 'does not exist'}; create it, or choose "
                        "another output folder")


def export_hf(source, out_dir: str, vocab_size: int | None = None) -> str:
    """Write a Hugging Face GPT-2 directory (config.json, model.safetensors,
    generation_config.json) that GPT2LMHeadModel.from_pretrained(out_dir) loads.

    source: one of our checkpoints (a ckpt file, or a run's folder for its newest), or a GPT
    (DDP / torch.compile wrappers are fine). vocab_size: rows to keep; default GPT-2's 50257
    when ours is at least that (the padded rows are dropped), else ours as it is. Beside the model
    goes EXPORT_MARK (the source checkpoint, its step and checksum, and each file's sha256): only a
    folder that is still exactly what an export wrote, or an empty one, is replaced by a later
    export. Returns out_dir."""
    _check_parent(out_dir)
    _remove_dead_partials(out_dir)
    _check_replaceable(out_dir)  # before any work: a refusal changes nothing
    mark = dict(written_by=MARK_WRITER, mark_version=MARK_VERSION, checkpoint=None, step=None, checksum=None)
    if isinstance(source, (str, os.PathLike)):
        ckpt = load_checkpoint(str(source), model_fields=EXPORTED_CONFIG)  # a field GPT-2 lacks is refused
        config, sd = argparse.Namespace(**ckpt["model_config"]), ckpt["model"]
        path = latest_checkpoint(str(source)) if os.path.isdir(source) else str(source)
        mark.update(checkpoint=os.path.abspath(path), step=ckpt.get("step"), checksum=ckpt["checksum"])
    else:
        model = unwrap_model(source)
        config, sd = model.config, model.state_dict()
    n_keep = real_vocab_size(config.vocab_size) if vocab_size is None else vocab_size
    if not 0 < n_keep <= config.vocab_size:
        raise UserError(f"--vocab-size {n_keep} must be in 1..{config.vocab_size} (the model's vocab size)")
    GPT2Config, GPT2LMHeadModel = _import_transformers()
    special = dict(bos_token_id=EOT, eos_token_id=EOT) if n_keep > EOT \
        else dict(bos_token_id=None, eos_token_id=None)
    hf_config = GPT2Config(
        vocab_size=n_keep, n_positions=config.block_size, n_ctx=config.block_size, n_embd=config.n_embd,
        n_layer=config.n_layer, n_head=config.n_head, activation_function="gelu_new",
        layer_norm_epsilon=1e-5, tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, architectures=["GPT2LMHeadModel"], **special)
    hf_sd = {}
    for key, value in sd.items():
        value = value.detach().to("cpu", torch.float32)
        if key in TIED:
            value = value[:n_keep]
        elif key.endswith(TRANSPOSED):
            value = value.t()
        hf_sd[key] = value.contiguous()
    hf = GPT2LMHeadModel(hf_config)
    result = hf.load_state_dict(hf_sd, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith(HF_BUFFERS) and k not in TIED]
    if missing or result.unexpected_keys:
        raise UserError(f"checkpoint does not match GPT-2's layout (missing {missing[:3]}, "
                        f"unexpected {result.unexpected_keys[:3]})")
    hf.tie_weights()  # one shared matrix, as config.tie_word_embeddings says
    with _replacing_folder(out_dir) as new_dir:
        _save_pretrained(hf, new_dir, shown=out_dir)
        if n_keep >= GPT2_VOCAB:  # the GPT-2 ids: the folder then tokenizes text on its own
            _save_tokenizer(new_dir, config.block_size, shown=out_dir)
        files = {name: _file_sha256(os.path.join(new_dir, name)) for name in sorted(os.listdir(new_dir))}
        _write_json(os.path.join(new_dir, EXPORT_MARK), dict(mark, vocab_size=n_keep, files=files), shown=out_dir)
        _check_replaceable(out_dir)  # again, for what changed there while this export was written
    return out_dir


# The mark of an export: a folder that holds it, with each file it lists unchanged and nothing
# added, was written by this command and may be replaced by the next export; any other non-empty
# folder is left as it is: a save_pretrained of the user's own model looks like an export (the same
# file names), also one saved over an earlier export, where the mark survives, but its files are no
# longer the ones the mark lists. transformers, AutoTokenizer, pipeline and lm-eval read only the
# files they know, so one more JSON file goes unnoticed.
EXPORT_MARK = "gpt2_trainer_export.json"
MARK_WRITER, MARK_VERSION = "gpt2-trainer hf_interop.py export", 2


def _write_json(path: str, value: dict, shown: str):
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=2, ensure_ascii=False)
    except OSError as e:
        raise UserError(f"cannot write the Hugging Face model to {shown}: {os_error_reason(e)}") from e


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _read_mark(folder: str) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(folder, EXPORT_MARK)) as f:
            mark = json.load(f)
        if isinstance(mark, dict) and mark.get("written_by") == MARK_WRITER:
            return mark
    return None


def _changes_since_export(folder: str, names: set, mark: dict) -> str | None:
    """What differs in folder from the files its mark lists ('model.safetensors changed, notes.txt
    added'), or None when it is as the export wrote it."""
    files = mark.get("files")
    if not isinstance(files, dict):
        return "its mark lists no files: an older hf_interop.py wrote it"
    names = names - {EXPORT_MARK}
    changes = [f"{name} added" for name in sorted(names - files.keys())]
    changes += [f"{name} missing" for name in sorted(files.keys() - names)]
    for name in sorted(names & files.keys()):
        try:
            same = os.path.isfile(os.path.join(folder, name)) and _file_sha256(os.path.join(folder, name)) == files[name]
        except OSError as e:
            raise UserError(f"cannot read {os.path.join(folder, name)}: {os_error_reason(e)}") from e
        if not same:
            changes.append(f"{name} changed")
    return ", ".join(changes[:3]) + (f", ... ({len(changes)} in all)" if len(changes) > 3 else "") or None


def _check_replaceable(out_dir: str):
    """Refuse an out_dir that an export may not replace: a file, or a folder that is neither empty
    nor, file for file, an export this command wrote."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"{out_dir} exists and is not a directory")
    target = os.path.realpath(out_dir)  # a mount point's holds the partial folders of exports to it
    names = {name for name in os.listdir(out_dir) if not _is_partial(target, name)} if os.path.isdir(out_dir) else set()
    if not names:
        return
    mark = _read_mark(out_dir)
    if mark is None:
        raise UserError(f"{out_dir} is not empty and is not an export of hf_interop.py (it has no {EXPORT_MARK}), "
                        "so it may hold a model of your own and is left as it is: export into a new or empty folder")
    changes = _changes_since_export(out_dir, names, mark)
    if changes:
        raise UserError(f"{out_dir} has changed since hf_interop.py exported it ({changes}), so it may hold a model "
                        "of your own and is left as it is: to replace it on purpose, delete what it holds first "
                        f"(rm -r {out_dir}), or export into a new or empty folder")


# A partial export: the folder an export writes before it is swapped in, beside the target (inside
# it for a mount point), named .NAME.export-XXXXXXXX (mkdtemp's 8 characters), and locked (flock)
# by the writing process while it lives. kill -9 or a power cut leaves it, with up to gigabytes of
# weights; the next export to NAME removes each one whose lock it can take: its writer is dead.
# Where the file system has no flock, no lock can be taken, and partial folders are left as they are.
def _partial_prefix(target: str) -> str:
    return f".{os.path.basename(target)}.export-"


def _is_partial(target: str, name: str) -> bool:
    """Whether name is that of a partial folder of an export to target (or of an earlier export
    set aside there by the swap without renameat2)."""
    return re.fullmatch(re.escape(_partial_prefix(target)) + r"[a-z0-9_]{8}(\.old)?", name) is not None


def _partial_folders(target: str) -> list[str]:
    """The partial folders of exports to target, beside it and inside it."""
    found = []
    for folder in (os.path.dirname(target), target):
        with contextlib.suppress(OSError):
            found += [os.path.join(folder, name) for name in os.listdir(folder) if _is_partial(target, name)]
    return [path for path in found if os.path.isdir(path) and not os.path.islink(path)]


def _lock(folder: str) -> int | None:
    """An open descriptor of folder holding its exclusive flock (released when this process dies);
    None where another process holds it, or the folder or the file system does not allow it."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return None


def _remove_dead_partials(out_dir: str):
    for path in _partial_folders(os.path.realpath(out_dir)):
        fd = _lock(path)
        if fd is not None:
            try:
                shutil.rmtree(path)
                print(f"removed {path}, the partial folder of an export that was killed", file=sys.stderr)
            except OSError:
                pass  # another export removing it too, or a folder we may not delete: left as it is
            finally:
                os.close(fd)


def _new_partial(folder: str, target: str) -> tuple[str, int | None]:
    """A new partial folder in folder for an export to target, and the descriptor holding its lock
    (None where the file system has no flock). Another export's _remove_dead_partials may take a
    folder in the instant between its mkdtemp and its lock: then it is made anew."""
    for _ in range(10):
        path = tempfile.mkdtemp(prefix=_partial_prefix(target), dir=folder)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return path, fd
        except (BlockingIOError, FileNotFoundError):  # taken by another export's cleaning
            pass
        except OSError:  # no flock here: nothing can take it either
            return path, fd
        os.close(fd)
    raise OSError(errno.EBUSY, "other exports to the same folder keep removing this one's partial folder")


def _is_mount_point(path: str) -> bool:
    """Whether path is a mount point, which rename and renameat2 refuse (EBUSY): also a bind mount
    within one file system (a docker or Kubernetes volume), which os.path.ismount misses, from
    /proc/self/mountinfo (Linux; its fifth field, with octal escapes such as \\040 for a space)."""
    if os.path.ismount(path):
        return True
    with contextlib.suppress(OSError):
        with open("/proc/self/mountinfo", "rb") as f:
            points = {re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), line.split()[4]) for line in f}
        return os.fsencode(path) in points
    return False


AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _exchange(a: str, b: str) -> bool:
    """Swap the directory entries a and b in one step (Linux's renameat2 with RENAME_EXCHANGE): True,
    or False where the C library or the file system lacks it (macOS, older glibc, some network file
    systems); another failure is an OSError."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


@contextlib.contextmanager
def _replacing_folder(out_dir: str):
    """A new partial folder to write the export into, swapped in for out_dir only once every file
    is written: a failed write leaves an earlier export as it was (a new config.json beside old
    weights loads silently with random layers), and no partial folder behind. out_dir has passed
    _check_replaceable: it is missing, empty, or an earlier export.

    The swap: over a missing or empty folder one rename; over an earlier export one exchange of the
    two folders (renameat2), so that out_dir always names a whole export, old or new, for a reader
    loading it meanwhile; the old one is then deleted under the partial folder's name. Without the
    exchange, two renames (the old export aside, the new one in) leave out_dir missing for that
    moment. A symbolic link is followed: the folder it points to is replaced, the link stays.
    A mount point cannot be renamed (EBUSY): the export is written in a partial folder inside it
    and its files are moved in one by one (_move_files_in)."""
    target = os.path.realpath(out_dir)
    in_place = os.path.isdir(target) and _is_mount_point(target)
    locks = []
    try:
        new_dir, lock = _new_partial(target if in_place else os.path.dirname(target), target)
    except OSError as e:
        raise UserError(f"cannot write the Hugging Face model to {out_dir}: {os_error_reason(e)}") from e
    locks.append(lock)
    old_dir = None
    try:
        yield new_dir
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(new_dir, 0o777 & ~umask)  # mkdtemp's folder is private; an export is a normal folder
        if in_place:
            _move_files_in(new_dir, target)
            new_dir = None
        elif os.path.isdir(target) and os.listdir(target):
            if _exchange(new_dir, target):
                new_dir, old_dir = None, new_dir  # which now holds the earlier export
            else:
                locks.append(_lock(target))  # the earlier export, aside for a moment: no one else's to remove
                old_dir = new_dir + ".old"
                os.rename(target, old_dir)
        if new_dir:
            try:
                os.replace(new_dir, target)  # over an empty folder too
            except OSError:
                if old_dir:
                    os.rename(old_dir, target)
                    old_dir = None
                raise
            new_dir = None
    except OSError as e:
        busy = " (a mount point cannot be renamed: export into a folder inside it)" if e.errno == errno.EBUSY else ""
        raise UserError(f"cannot write the Hugging Face model to {out_dir}: {os_error_reason(e)}{busy}") from e
    finally:
        for leftover in (new_dir, old_dir):
            if leftover:
                shutil.rmtree(leftover, ignore_errors=True)
        for fd in locks:
            if fd is not None:
                os.close(fd)


def _move_files_in(new_dir: str, target: str):
    """Move the export in new_dir into target (a mount point, holding nothing or an earlier export)
    file by file, each one whole (a rename within target's file system). The earlier mark goes
    first and the new one last: a process killed in between leaves a folder that no later export
    takes for its own (one line asks to empty it), never a mark over files it did not write."""
    earlier = {name for name in os.listdir(target) if not _is_partial(target, name)}
    if EXPORT_MARK in earlier:
        os.remove(os.path.join(target, EXPORT_MARK))
    names = sorted(set(os.listdir(new_dir)) - {EXPORT_MARK})
    for name in names:
        os.replace(os.path.join(new_dir, name), os.path.join(target, name))
    for name in earlier - set(names) - {EXPORT_MARK}:  # an earlier export's file this one lacks (its tokenizer)
        os.remove(os.path.join(target, name))
    os.replace(os.path.join(new_dir, EXPORT_MARK), os.path.join(target, EXPORT_MARK))
    os.rmdir(new_dir)


# The tokenizer an export carries, written as files rather than through transformers: the same
# bytes whatever transformers and tokenizers do the export, and loaded by every transformers that
# requirements-dev.txt allows. Each file in the form the oldest reads: tokenizers 0.20+ writes BPE
# merges as pairs, which tokenizers 0.19 (transformers 4.40) cannot read, and transformers 5 names
# the class TokenizersBackend, which 4.x does not have. PreTrainedTokenizerFast exists in both and
# takes tokenizer.json as it is (5.x's GPT2Tokenizer would rebuild its pre-tokenizer).
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def _byte_chars() -> list[str]:
    """Byte-level BPE's printable stand-in for each byte value (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [chars[b] for b in range(256)]


def gpt2_tokenizer_files(model_max_length: int) -> dict[str, dict]:
    """GPT-2's tokenizer as a transformers fast tokenizer's files (name -> JSON value), built offline
    from the r50k_base BPE the trainer encodes with: its 50257 ids, tiktoken's split pattern, the
    merges that give each token from two others (transformers' TikTokenConverter's rule), and
    <|endoftext|> as bos/eos/unk, matched in text as the special id 50256 (tiktoken's
    encode_prompt's allowed_special; HF tokenizers always match added tokens in text).
    model_max_length: the model's block size, which pipeline('text-generation') truncates to."""
    try:
        enc = get_encoding()
    except RuntimeError as e:  # offline without TIKTOKEN_CACHE_DIR: its one-line hint
        raise UserError(str(e)) from None
    ranks, chars = enc._mergeable_ranks, _byte_chars()

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)
    merges = sorted((rank, ranks[token[:i]], ranks[token[i:]], text(token[:i]), text(token[i:]))
                    for token, rank in ranks.items() for i in range(1, len(token))
                    if token[:i] in ranks and token[i:] in ranks)
    byte_level = dict(type="ByteLevel", add_prefix_space=True, trim_offsets=True, use_regex=True)
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [dict(id=EOT, content=EOT_TEXT, single_word=False, lstrip=False, rstrip=False,
                              normalized=False, special=True)],
        "normalizer": None,
        "pre_tokenizer": dict(type="Sequence", pretokenizers=[
            dict(type="Split", pattern=dict(Regex=enc._pat_str), behavior="Isolated", invert=False),
            dict(byte_level, add_prefix_space=False, use_regex=False)]),
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": byte_level,
        "model": dict(type="BPE", dropout=None, unk_token=None, continuing_subword_prefix=None,
                      end_of_word_suffix=None, fuse_unk=False, byte_fallback=False, ignore_merges=True,
                      vocab={text(token): rank for token, rank in ranks.items()},
                      merges=[f"{left} {right}" for *_, left, right in merges]),  # no token holds a space
    }
    specials = dict(bos_token=EOT_TEXT, eos_token=EOT_TEXT, unk_token=EOT_TEXT)
    config = dict(tokenizer_class=TOKENIZER_CLASS, **specials, model_max_length=model_max_length,
                  clean_up_tokenization_spaces=False)
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config, "special_tokens_map.json": specials}


def _save_tokenizer(out_dir: str, model_max_length: int, shown: str):
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir."""
    for name, value in gpt2_tokenizer_files(model_max_length).items():
        _write_json(os.path.join(out_dir, name), value, shown)


def _save_pretrained(hf, out_dir: str, shown: str | None = None):
    """hf.save_pretrained(out_dir), with the files readable like any other the user writes:
    safetensors writes through a private temporary file (mode 0600), so the mode the umask
    gives a new file (0644 under the usual 022) is set afterwards on every file written."""
    def stamps():
        with os.scandir(out_dir) as entries:
            return {e.name: (e.inode(), e.stat().st_mtime_ns) for e in entries if e.is_file()}
    try:
        os.makedirs(out_dir, exist_ok=True)
        before = stamps()
        with _quiet_transformers():
            hf.save_pretrained(out_dir)
        umask = os.umask(0)
        os.umask(umask)
        for name, stamp in stamps().items():
            if before.get(name) != stamp:
                os.chmod(os.path.join(out_dir, name), 0o666 & ~umask)
    except Exception as e:  # OSError, or safetensors' own error for a failed write (a full disk)
        raise UserError(f"cannot write the Hugging Face model to {shown or out_dir}: {os_error_reason(e)}") from e


# -----------------------------------------------------------------------------
# lm-evaluation-harness on an exported checkpoint

EVALS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "evals")  # our lm-eval task YAMLs
LM_EVAL_HINT = "lm-evaluation-harness is not installed: pip install lm_eval accelerate"
LOCAL_TASKS = {"hellaswag": "hellaswag_local"}  # lm-eval task -> ours in evals/ that reads a local file


def _import_lm_eval():
    try:
        import accelerate  # noqa: F401  (lm-eval's hf model needs it and does not install it)
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError(LM_EVAL_HINT) from None
    return lm_eval, HFLM, TaskManager


def _load_tasks(TaskManager, names: list[str], hellaswag_file: str | None):
    """(task manager, lm-eval's tasks and groups by name, their data loaded): hellaswag from
    hellaswag_file through evals/hellaswag_local.yaml when it is given. A task that cannot be had
    is one line saying what to set."""
    if hellaswag_file:  # a missing file, or a bad line, named as hellaswag.py names them (not as a failed download)
        from hellaswag import load_examples, resolve_data_file
        flag = "--hellaswag-file"
        load_examples(resolve_data_file(hellaswag_file, flag=flag), flag=flag, style="lm_eval")
    metadata = {"data_file": os.path.abspath(hellaswag_file)} if hellaswag_file else None
    names = [LOCAL_TASKS.get(name, name) if hellaswag_file else name for name in names]
    # lm-eval's own thousands of task YAMLs take ~15 s to index: only when a task needs them
    manager = TaskManager(include_path=EVALS_DIR, metadata=metadata,
                          include_defaults=not set(names) <= set(LOCAL_TASKS.values()))
    known = set(manager.all_tasks)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise UserError(f"--tasks: lm-eval has no task {unknown[0]!r} (`lm_eval ls tasks` lists them)")
    loaded = {}
    for name in names:
        try:
            with _quiet_datasets():
                loaded[name] = manager.load(name)
        except Exception as e:  # the Hub unreachable, a damaged file, a dataset lm-eval cannot build
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            fix = ("pass --hellaswag-file PATH (a local hellaswag_val.jsonl; evals/hellaswag_local.yaml reads it)"
                   if name in LOCAL_TASKS else
                   "with no internet, point HF_HOME at a Hugging Face cache that holds its dataset "
                   "and set HF_DATASETS_OFFLINE=1")
            raise UserError(f"--tasks {name}: cannot load its data ({type(e).__name__}: {first:.200}); {fix}") from e
    return manager, [obj for result in loaded.values() for obj in _top_level(result)]


def _top_level(loaded: dict) -> list:
    """The groups and tasks of a TaskManager.load result that are no group's member."""
    members = {child for children in loaded.get("group_map", {}).values() for child in children}
    return [obj for kind in ("groups", "tasks") for name, obj in loaded[kind].items() if name not in members]


@contextlib.contextmanager
def _quiet_datasets():
    import datasets
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if bars:
            datasets.enable_progress_bars()


def lm_eval_results(source, tasks: list[str], *, hellaswag_file: str | None = None, limit: int | None = None,
                    batch_size: int = 8, device: str = "cpu", num_fewshot: int | None = None) -> dict:
    """lm-evaluation-harness's simple_evaluate on our checkpoint (a ckpt file or a run's folder),
    exported to a temporary Hugging Face directory: its results dict, with the per-example
    records under "samples"."""
    lm_eval, HFLM, TaskManager = _import_lm_eval()
    manager, loaded = _load_tasks(TaskManager, tasks, hellaswag_file)
    with tempfile.TemporaryDirectory(prefix="hf_export_") as hf_dir:
        export_hf(source, hf_dir)
        if not os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):  # transformers would make an empty one
            raise UserError(f"the export of {source} has no tokenizer.json for lm-eval to encode text with")
        try:
            with _quiet_transformers():
                lm = HFLM(pretrained=hf_dir, device=device, batch_size=batch_size, dtype="float32")
        except (OSError, ValueError, RuntimeError) as e:  # a tokenizer or device it cannot have
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"lm-eval cannot load the exported model ({type(e).__name__}: {first:.200})") from e
        return lm_eval.simple_evaluate(model=lm, tasks=loaded, limit=limit, num_fewshot=num_fewshot,
                                       log_samples=True, bootstrap_iters=0, task_manager=manager)


def _sample_record(sample: dict) -> dict:
    """One example of lm-eval's log: its id, gold answer, log-likelihoods and metric values."""
    record = {"doc_id": sample["doc_id"], "target": sample["target"]}
    record["loglikelihoods"] = [float(resp[0]) for resp in sample["filtered_resps"]] \
        if all(isinstance(r, (list, tuple)) for r in sample["filtered_resps"]) else sample["filtered_resps"]
    for metric in sample.get("metrics", []):
        record[metric] = sample[metric]
    return record


def run_lm_eval(args):
    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not tasks:
        raise UserError("--tasks names no task")
    if args.samples_dir:  # a folder we cannot write fails now, not after the evaluation
        try:
            os.makedirs(args.samples_dir, exist_ok=True)
        except OSError as e:
            raise UserError(f"--samples-dir {args.samples_dir}: {os_error_reason(e)}") from None
    out = lm_eval_results(args.checkpoint, tasks, hellaswag_file=args.hellaswag_file, limit=args.limit,
                          batch_size=args.batch_size, num_fewshot=args.num_fewshot,
                          device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for task, samples in out["samples"].items() if args.samples_dir else ():
        path = os.path.join(args.samples_dir, f"{task}.jsonl")
        try:
            with open(path, "w") as f:
                f.writelines(json.dumps(_sample_record(s)) + "\n" for s in samples)
        except OSError as e:
            raise UserError(f"cannot write {path}: {os_error_reason(e)}") from None
    from lm_eval.utils import make_table
    print(make_table(out), file=sys.stderr)
    print(json.dumps({task: _metrics(results) for task, results in out["results"].items()}))


def _metrics(results: dict) -> dict:
    """A task's numbers: acc, acc_norm, ... ('acc,none' for lm-eval's default filter) and n."""
    numbers = {key.removesuffix(",none"): value for key, value in results.items()
               if "," in key and "_stderr," not in key}
    return {**numbers, **({"n": results["sample_len"]} if "sample_len" in results else {})}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "eval":
        return exit_code_of(lambda: run_lm_eval(args), args.debug)

    def export():
        out = export_hf(args.checkpoint, args.out_dir, vocab_size=args.vocab_size)
        print(f"wrote Hugging Face GPT-2 to {out} (load with GPT2LMHeadModel.from_pretrained({out!r}) "
              f"and AutoTokenizer.from_pretrained({out!r}))")
    return exit_code_of(export, args.debug)


if __name__ == "__main__":
    sys.exit(main())
