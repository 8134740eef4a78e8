"""Move GPT-2 weights between Hugging Face transformers and our train_gpt2.GPT.

    python hf_interop.py export out/ckpt_0019073.pt gpt2_ours_hf   # our checkpoint -> HF directory
    python hf_interop.py eval out/gpt2-124M --tasks hellaswag,arc_easy  # lm-evaluation-harness on it

This script reads and writes tensors and configs; it never imports the trainer. The other
direction, a Hugging Face GPT-2 as our config and state dict (train_gpt2.GPT.from_hf, which
--init-from and sample.py use), is trainkit/hf_weights.py, with the layout differences (transposed
projections, the padded vocabulary) that both directions handle:

    config, state = gpt2_state_from_hf("gpt2")   # Hub name (needs internet) or a local HF directory

What is where: the command line (answered before torch loads); export_hf, the export itself
(our tensors as GPT2LMHeadModel's, the folder written whole or not at all, the mark that lets
only an export be replaced, GPT-2's tokenizer beside it); then `eval`, lm-evaluation-harness on
a temporary export; main at the end. transformers is optional: it is imported only inside the
functions that need it.
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

from trainkit import cli  # the error contract shared by every script; standard library only, so it comes first

# -----------------------------------------------------------------------------
# command line (standard library only: --help and usage errors answer before torch is imported)


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.ArgumentParser(
        description="Export a train_gpt2.py checkpoint as a Hugging Face GPT-2 folder, or "
        "evaluate one with lm-evaluation-harness."
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write a checkpoint as a Hugging Face GPT-2 directory")
    e.add_argument(
        "checkpoint",
        help="a checkpoint written by train_gpt2.py: a ckpt_*.pt file, or a run's "
        "--out-dir folder for its newest checkpoint",
    )
    e.add_argument("out_dir", help="directory for config.json and model.safetensors")
    e.add_argument("--vocab-size", type=cli.positive_int, help="rows to keep (default: 50257, dropping the padding)")
    e.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for errors")
    add_eval_parser(sub)
    return p.parse_args(argv)


def add_eval_parser(sub):
    e = sub.add_parser(
        "eval", help="run lm-evaluation-harness tasks on a checkpoint (exported to a temporary Hugging Face directory)"
    )
    e.add_argument(
        "checkpoint",
        help="a checkpoint written by train_gpt2.py: a ckpt_*.pt file, or a run's "
        "--out-dir folder for its newest checkpoint",
    )
    e.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated (hellaswag,arc_easy,...)")
    e.add_argument(
        "--hellaswag-file",
        help="local hellaswag_val.jsonl: hellaswag runs from it through evals/hellaswag_local.yaml, without the Hub",
    )
    e.add_argument("--limit", type=cli.positive_int, help="examples per task (default: all)")
    e.add_argument(
        "--num-fewshot", type=cli.non_negative_int, help="few-shot examples (default: each task's own, 0 for hellaswag)"
    )
    e.add_argument("--batch-size", type=cli.positive_int, default=8, help="lm-eval's batch size (default 8)")
    e.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    e.add_argument("--samples-dir", help="write each task's per-example results to DIR/TASK.jsonl")
    e.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for errors")


if __name__ == "__main__":
    cli.exit_on_ctrl_c_while_starting()
    parse_args()  # --help, or a usage error: answered now, before the slow imports

import torch

from trainkit import json_file
from trainkit.checkpoints import latest_checkpoint, load_checkpoint, unwrap_model
from trainkit.cli import UserError, exit_code_of, reason_of
from trainkit.console import print_line, print_result
from trainkit.hf_folder import HF_BUFFERS
from trainkit.hf_weights import TRANSPOSED, import_transformers, quiet_transformers
from trainkit.tokenizer import EOT, EOT_TEXT, GPT2_VOCAB, get_encoding, real_vocab_size


# -----------------------------------------------------------------------------
# export: our checkpoint as a Hugging Face GPT-2 folder

TIED = ("transformer.wte.weight", "lm_head.weight")
EXPORTED_CONFIG = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")  # what GPT2Config can say of ours


def _check_target(out_dir: str):
    """An export goes into a folder it makes (or replaces) in an existing one: a missing parent is named.
    It never replaces a folder that holds where the user is or what they keep: the current folder,
    the home folder, the checkout of this repository, or any folder above one of them (an empty
    out_dir, an unset shell variable, names the current folder once resolved)."""
    if not str(out_dir).strip():
        raise UserError(f"the folder to export to is empty ({out_dir!r}: an unset shell variable?): name a new folder")
    target = os.path.realpath(out_dir)
    for what, folder in (
        ("the current folder", os.getcwd()),
        ("your home folder", os.path.expanduser("~")),
        ("this repository's checkout", os.path.dirname(os.path.abspath(__file__))),
    ):
        folder = os.path.realpath(folder)
        if os.path.commonpath([target, folder]) == target:
            holds = "is" if folder == target else "holds"
            raise UserError(
                f"cannot export into {out_dir}: it {holds} {what} ({folder}), which an export would "
                "replace; export into a new folder"
            )
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise UserError(
            f"cannot write the Hugging Face model to {out_dir}: the folder it goes into, {parent}, "
            f"{'is a file' if os.path.exists(parent) else 'does not exist'}; create it, or choose "
            "another output folder"
        )


def export_hf(source, out_dir: str, vocab_size: int | None = None) -> str:
    """Write a Hugging Face GPT-2 directory (config.json, model.safetensors,
    generation_config.json) that GPT2LMHeadModel.from_pretrained(out_dir) loads.

    source: one of our checkpoints (a ckpt file, or a run's folder for its newest), or a GPT
    (DDP / torch.compile wrappers are fine). vocab_size: rows to keep; default GPT-2's 50257
    when ours is at least that (the padded rows are dropped), else ours as it is. Beside the model
    goes EXPORT_MARK (the source checkpoint, its step and checksum, and each file's sha256): only a
    folder that is still exactly what an export wrote, or an empty one, is replaced by a later
    export. Returns out_dir."""
    _check_target(out_dir)
    _remove_dead_partials(out_dir)
    _check_replaceable(out_dir)  # before any work: a refusal changes nothing
    mark = dict(written_by=MARK_WRITER, mark_version=MARK_VERSION, checkpoint=None, step=None, checksum=None)
    if isinstance(source, (str, os.PathLike)):
        # a run's folder: its newest checkpoint, looked up once (a run saving meanwhile with --keep-last
        # changes the newest), so that the mark names the file loaded
        path = (latest_checkpoint(str(source)) or str(source)) if os.path.isdir(source) else str(source)
        ckpt = load_checkpoint(path, model_fields=EXPORTED_CONFIG)  # a field GPT-2 lacks is refused
        config, sd = argparse.Namespace(**ckpt["model_config"]), ckpt["model"]
        mark.update(checkpoint=os.path.abspath(path), step=ckpt.get("step"), checksum=ckpt["checksum"])
    else:
        model = unwrap_model(source)
        config, sd = model.config, model.state_dict()
    n_keep = real_vocab_size(config.vocab_size) if vocab_size is None else vocab_size
    if not 0 < n_keep <= config.vocab_size:
        raise UserError(f"--vocab-size {n_keep} must be in 1..{config.vocab_size} (the model's vocab size)")
    GPT2Config, GPT2LMHeadModel = import_transformers()
    special = dict(bos_token_id=EOT, eos_token_id=EOT) if n_keep > EOT else dict(bos_token_id=None, eos_token_id=None)
    hf_config = GPT2Config(
        vocab_size=n_keep,
        n_positions=config.block_size,
        n_ctx=config.block_size,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        architectures=["GPT2LMHeadModel"],
        **special,
    )
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
        raise UserError(
            f"checkpoint does not match GPT-2's layout (missing {missing[:3]}, unexpected {result.unexpected_keys[:3]})"
        )
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
            json.dump(value, f, indent=2)  # ASCII: a path that is not UTF-8 is kept as its escapes
    except OSError as e:
        raise UserError(f"cannot write the Hugging Face model to {shown}: {reason_of(e)}") from e


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _read_mark(folder: str) -> dict | None:
    with contextlib.suppress(OSError, json_file.JSONFileError):  # not a mark: the folder is not an export's
        mark = json_file.read(os.path.join(folder, EXPORT_MARK))
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
            same = (
                os.path.isfile(os.path.join(folder, name)) and _file_sha256(os.path.join(folder, name)) == files[name]
            )
        except OSError as e:
            raise UserError(f"cannot read {os.path.join(folder, name)}: {reason_of(e)}") from e
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
        raise UserError(
            f"{out_dir} is not empty and is not an export of hf_interop.py (it has no {EXPORT_MARK}), "
            "so it may hold a model of your own and is left as it is: export into a new or empty folder"
        )
    changes = _changes_since_export(out_dir, names, mark)
    if changes:
        raise UserError(
            f"{out_dir} has changed since hf_interop.py exported it ({changes}), so it may hold a model "
            "of your own and is left as it is: to replace it on purpose, delete what it holds first "
            f"(rm -r {out_dir}), or export into a new or empty folder"
        )


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
                print_line(f"removed {path}, the partial folder of an export that was killed", file=sys.stderr)
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
        raise UserError(f"cannot write the Hugging Face model to {out_dir}: {reason_of(e)}") from e
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
        raise UserError(f"cannot write the Hugging Face model to {out_dir}: {reason_of(e)}{busy}") from e
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
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
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

    merges = sorted(
        (rank, ranks[token[:i]], ranks[token[i:]], text(token[:i]), text(token[i:]))
        for token, rank in ranks.items()
        for i in range(1, len(token))
        if token[:i] in ranks and token[i:] in ranks
    )
    byte_level = dict(type="ByteLevel", add_prefix_space=True, trim_offsets=True, use_regex=True)
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            dict(
                id=EOT, content=EOT_TEXT, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True
            )
        ],
        "normalizer": None,
        "pre_tokenizer": dict(
            type="Sequence",
            pretokenizers=[
                dict(type="Split", pattern=dict(Regex=enc._pat_str), behavior="Isolated", invert=False),
                dict(byte_level, add_prefix_space=False, use_regex=False),
            ],
        ),
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": byte_level,
        "model": dict(
            type="BPE",
            dropout=None,
            unk_token=None,
            continuing_subword_prefix=None,
            end_of_word_suffix=None,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=True,
            vocab={text(token): rank for token, rank in ranks.items()},
            merges=[f"{left} {right}" for *_, left, right in merges],
        ),  # no token holds a space
    }
    specials = dict(bos_token=EOT_TEXT, eos_token=EOT_TEXT, unk_token=EOT_TEXT)
    config = dict(
        tokenizer_class=TOKENIZER_CLASS,
        **specials,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
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
        with quiet_transformers():
            hf.save_pretrained(out_dir)
        umask = os.umask(0)
        os.umask(umask)
        for name, stamp in stamps().items():
            if before.get(name) != stamp:
                os.chmod(os.path.join(out_dir, name), 0o666 & ~umask)
    except Exception as e:  # OSError, or safetensors' own error for a failed write (a full disk)
        raise UserError(f"cannot write the Hugging Face model to {shown or out_dir}: {reason_of(e)}") from e


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
        from trainkit.hellaswag_data import resolve_data_file
        from trainkit.hellaswag_examples import load_examples

        flag = "--hellaswag-file"
        load_examples(resolve_data_file(hellaswag_file, flag=flag), flag=flag, style="lm_eval")
    metadata = {"data_file": os.path.abspath(hellaswag_file)} if hellaswag_file else None
    names = [LOCAL_TASKS.get(name, name) if hellaswag_file else name for name in names]
    # lm-eval's own thousands of task YAMLs take ~15 s to index: only when a task needs them
    manager = TaskManager(
        include_path=EVALS_DIR, metadata=metadata, include_defaults=not set(names) <= set(LOCAL_TASKS.values())
    )
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
            fix = (
                "pass --hellaswag-file PATH (a local hellaswag_val.jsonl; evals/hellaswag_local.yaml reads it)"
                if name in LOCAL_TASKS
                else "with no internet, point HF_HOME at a Hugging Face cache that holds its dataset "
                "and set HF_DATASETS_OFFLINE=1"
            )
            raise UserError(f"--tasks {name}: cannot load its data ({reason_of(e, typed=True)}); {fix}") from e
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


def lm_eval_results(
    source,
    tasks: list[str],
    *,
    hellaswag_file: str | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    num_fewshot: int | None = None,
) -> dict:
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
            with quiet_transformers():
                lm = HFLM(pretrained=hf_dir, device=device, batch_size=batch_size, dtype="float32")
        except (OSError, ValueError, RuntimeError) as e:  # a tokenizer or device it cannot have
            raise UserError(f"lm-eval cannot load the exported model ({reason_of(e, typed=True)})") from e
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=loaded,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=True,
            bootstrap_iters=0,
            task_manager=manager,
        )


def _sample_record(sample: dict) -> dict:
    """One example of lm-eval's log: its id, gold answer, log-likelihoods and metric values."""
    record = {"doc_id": sample["doc_id"], "target": sample["target"]}
    record["loglikelihoods"] = (
        [float(resp[0]) for resp in sample["filtered_resps"]]
        if all(isinstance(r, (list, tuple)) for r in sample["filtered_resps"])
        else sample["filtered_resps"]
    )
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
            raise UserError(f"--samples-dir {args.samples_dir}: {reason_of(e)}") from None
    out = lm_eval_results(
        args.checkpoint,
        tasks,
        hellaswag_file=args.hellaswag_file,
        limit=args.limit,
        batch_size=args.batch_size,
        num_fewshot=args.num_fewshot,
        device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
    )
    for task, samples in out["samples"].items() if args.samples_dir else ():
        path = os.path.join(args.samples_dir, f"{task}.jsonl")
        try:
            with open(path, "w") as f:
                f.writelines(json.dumps(_sample_record(s)) + "\n" for s in samples)
        except OSError as e:
            raise UserError(f"cannot write {path}: {reason_of(e)}") from None
    from lm_eval.utils import make_table

    print_line(make_table(out), file=sys.stderr, keep_newlines=True)
    print_result(json.dumps({task: _metrics(results) for task, results in out["results"].items()}))


def _metrics(results: dict) -> dict:
    """A task's numbers: acc, acc_norm, ... ('acc,none' for lm-eval's default filter) and n."""
    numbers = {
        key.removesuffix(",none"): value for key, value in results.items() if "," in key and "_stderr," not in key
    }
    return {**numbers, **({"n": results["sample_len"]} if "sample_len" in results else {})}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "eval":
        return exit_code_of(lambda: run_lm_eval(args), args.debug)

    def export():
        out = export_hf(args.checkpoint, args.out_dir, vocab_size=args.vocab_size)
        with open(os.path.join(out, EXPORT_MARK), "rb") as f:  # which checkpoint (a folder's newest) and step
            mark = json.loads(f.read())
        source = os.path.relpath(mark["checkpoint"])
        source = mark["checkpoint"] if source.startswith("..") else source
        step = f"step {mark['step']}" if mark["step"] is not None else "it records no step"
        print_line(
            f"wrote Hugging Face GPT-2 of {source} ({step}) to {out} (load with "
            f"GPT2LMHeadModel.from_pretrained({out!r}) and AutoTokenizer.from_pretrained({out!r}))"
        )

    return exit_code_of(export, args.debug)


if __name__ == "__main__":
    sys.exit(main())
