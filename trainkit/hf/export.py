"""An export's Hugging Face GPT-2 folder (hf_interop.py export): replaced whole or not at all, and never
a folder that is not an export's (docs/hf.md: the mark, partial folders, the swap); and GPT-2's tokenizer
files it holds, built without transformers."""

from __future__ import annotations

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

from trainkit import fileio
from trainkit.cli import UserError, print_line, reason_of
from trainkit.data.tokenizer import EOT, EOT_TEXT, get_encoding
from trainkit.fileio import create_fresh

# --- the target folder ----------------------------------------------------------------------------

# an export's mark: a folder holding it, each file it lists unchanged and none added, may be replaced
EXPORT_MARK = "gpt2_trainer_export.json"
MARK_WRITER, MARK_VERSION = "gpt2-trainer hf_interop.py export", 2
CHECKOUT = os.path.normpath(os.path.join(os.path.abspath(__file__), "../../.."))  # this repository's


def check_target(out_dir: str):
    """Refuse an out_dir that is, or holds, the current folder, the home folder or the checkout, or
    whose parent folder is missing."""
    if not str(out_dir).strip():
        raise UserError(f"the folder to export to is empty ({out_dir!r}: an unset shell variable?): name a new folder")
    target = os.path.realpath(out_dir)
    for what, folder in (
        ("the current folder", os.getcwd()),
        ("your home folder", os.path.expanduser("~")),
        ("this repository's checkout", CHECKOUT),
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


def write_json(path: str, value: dict, shown: str):
    """value as a JSON file of the export being written (shown: the folder its one line names)."""
    try:  # created, not opened: a link at its name is replaced
        with os.fdopen(create_fresh(path), "w", encoding="utf-8") as f:
            json.dump(value, f, indent=2)  # ASCII: a path that is not UTF-8 is kept as its escapes
    except OSError as e:
        raise UserError(f"cannot write the Hugging Face model to {shown}: {reason_of(e)}") from e


def write_mark(folder: str, fields: dict, shown: str):
    """EXPORT_MARK into folder, written last: fields and the sha256 of each file beside it."""
    files = {
        name: _file_sha256(os.path.join(folder, name)) for name in sorted(set(os.listdir(folder)) - {PARTIAL_MARK})
    }
    mark = dict(written_by=MARK_WRITER, mark_version=MARK_VERSION, **fields, files=files)
    write_json(os.path.join(folder, EXPORT_MARK), mark, shown)


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _changes_since_export(folder: str, names: set, mark: dict) -> str | None:
    """What differs in folder from the files its mark lists ('model.safetensors changed, notes.txt
    added'), or None when it is as the export wrote it."""
    files = mark.get("files")
    if not isinstance(files, dict):
        return "its mark lists no files: an older hf_interop.py wrote it"
    names = names - {EXPORT_MARK, PARTIAL_MARK}  # (the latter: an export killed just after its swap)
    changes = [f"{name} added" for name in sorted(names - files.keys())]
    changes += [f"{name} missing" for name in sorted(files.keys() - names)]
    for name in sorted(names & files.keys()):
        path = os.path.join(folder, name)
        try:
            if not (os.path.isfile(path) and _file_sha256(path) == files[name]):
                changes.append(f"{name} changed")
        except OSError as e:
            raise UserError(f"cannot read {path}: {reason_of(e)}") from e
    return ", ".join(changes[:3]) + (f", ... ({len(changes)} in all)" if len(changes) > 3 else "") or None


def check_replaceable(out_dir: str):
    """Refuse an out_dir that an export may not replace: a file, or a folder that is neither empty
    nor, file for file, an export this command wrote."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"{out_dir} exists and is not a directory")
    if not os.path.isdir(out_dir):
        return
    target = os.path.realpath(out_dir)  # a mount point's holds the partial folders of exports to it
    names = {name for name in os.listdir(out_dir) if not _is_partial(target, out_dir, name)}
    if not names:
        return
    mark = None
    with contextlib.suppress(OSError, fileio.JSONFileError):  # not a mark: the folder is not an export's
        mark = fileio.read_json(os.path.join(out_dir, EXPORT_MARK))
    if not (isinstance(mark, dict) and mark.get("written_by") == MARK_WRITER):
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


# a partial folder, .NAME.export-XXXXXXXX, is flock-ed by its writer and holds PARTIAL_MARK naming its own
# device and inode: only an unlocked one whose mark names it is removed (not a look-alike, not a copy)
PARTIAL_MARK = ".gpt2_trainer_partial_export"


def _partial_prefix(target: str) -> str:
    return f".{os.path.basename(target)}.export-"


def _partial_mark(st: os.stat_result) -> bytes:
    return f"{MARK_WRITER}: partial folder {st.st_dev}:{st.st_ino}\n".encode()


def mark_partial(fd: int):
    """Write PARTIAL_MARK, naming the folder open at fd, into it."""
    with os.fdopen(create_fresh(PARTIAL_MARK, dir_fd=fd), "wb") as f:
        f.write(_partial_mark(os.fstat(fd)))


def _unmark(fd: int):
    with contextlib.suppress(FileNotFoundError):
        os.remove(PARTIAL_MARK, dir_fd=fd)


def _carries_partial_mark(path: str, st: os.stat_result | None = None) -> bool:
    """Whether the folder path (st: its status, default os.lstat's) holds the PARTIAL_MARK that names it."""
    try:
        st = st or os.lstat(path)
        fd = os.open(os.path.join(path, PARTIAL_MARK), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            return f.read(4096) == _partial_mark(st)
    except OSError:
        return False


def _is_partial(target: str, folder: str, name: str) -> bool:
    """Whether folder/name is a partial folder of an export to target (or an earlier export set aside)."""
    pattern = re.escape(_partial_prefix(target)) + r"[a-z0-9_]{8}(\.old)?"
    return re.fullmatch(pattern, name) is not None and _carries_partial_mark(os.path.join(folder, name))


def _partial_folders(target: str) -> list[str]:
    found = []
    for folder in (os.path.dirname(target), target):
        with contextlib.suppress(OSError):
            found += [os.path.join(folder, name) for name in os.listdir(folder) if _is_partial(target, folder, name)]
    return [path for path in found if os.path.isdir(path) and not os.path.islink(path)]


def _lock(folder: str) -> int | None:
    """An open descriptor of folder holding its exclusive flock, or None."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError:
            os.close(fd)
    return None


def remove_dead_partials(out_dir: str):
    for path in _partial_folders(os.path.realpath(out_dir)):
        fd = _lock(path)
        if fd is not None:
            try:  # (still the folder locked, and its mark names it)
                if not (os.path.samestat(os.fstat(fd), os.lstat(path)) and _carries_partial_mark(path, os.fstat(fd))):
                    continue
                shutil.rmtree(path)
                print_line(f"removed {path}, the partial folder of an export that was killed", file=sys.stderr)
            except OSError:
                pass  # another export removing it too, or a folder we may not delete: left as it is
            finally:
                os.close(fd)


def _new_partial(folder: str, target: str) -> tuple[str, int | None]:
    """A new partial folder in folder for an export to target, and the descriptor holding its lock: made
    anew where another export's remove_dead_partials takes it between its mkdtemp and its lock."""
    for _ in range(10):
        path = tempfile.mkdtemp(prefix=_partial_prefix(target), dir=folder)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                mark_partial(fd)
                return path, fd
        except (BlockingIOError, FileNotFoundError):  # taken by another export's cleaning
            pass
        except OSError:  # no flock here: nothing can take it either
            mark_partial(fd)
            return path, fd
        os.close(fd)
    raise OSError(errno.EBUSY, "other exports to the same folder keep removing this one's partial folder")


def _is_mount_point(path: str) -> bool:
    """Whether path is a mount point (rename refuses it: EBUSY), bind mounts too (/proc/self/mountinfo's
    fifth field, octal escapes such as \\040 for a space), which os.path.ismount misses."""
    if os.path.ismount(path):
        return True
    with contextlib.suppress(OSError):
        with open("/proc/self/mountinfo", "rb") as f:
            points = {re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), line.split()[4]) for line in f}
        return os.fsencode(path) in points
    return False


AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _exchange(a: str, b: str) -> bool:
    """Swap the entries a and b in one step (renameat2 RENAME_EXCHANGE): True, or False where the C
    library or the file system lacks it (macOS, some network file systems)."""
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
def replacing_folder(out_dir: str):
    """A new partial folder to write the export into, swapped in for out_dir (missing, empty or an
    earlier export) once every file is written: a failed write leaves the earlier export as it was
    (a new config.json beside old weights would load silently). One rename, or one renameat2 exchange
    over an earlier export, else two renames; into a mount point file by file (_move_files_in)."""
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
        os.chmod(new_dir, 0o777 & ~umask)  # mkdtemp's folder is private; an export is a normal folder,
        for name in os.listdir(new_dir):  # its files as the umask makes them (safetensors writes 0600)
            os.chmod(os.path.join(new_dir, name), 0o666 & ~umask)
        if in_place:
            _move_files_in(new_dir, target)
            new_dir = None
        elif os.path.isdir(target) and os.listdir(target):
            # the earlier export, once aside, is a partial folder: the next export removes it if this one is killed
            earlier = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
            locks.append(earlier)
            with contextlib.suppress(OSError):  # (no one else's to remove while aside)
                fcntl.flock(earlier, fcntl.LOCK_EX | fcntl.LOCK_NB)
            mark_partial(earlier)
            try:
                if _exchange(new_dir, target):
                    new_dir, old_dir = None, new_dir  # which now holds the earlier export
                else:
                    old_dir = new_dir + ".old"
                    os.rename(target, old_dir)
            except OSError:
                _unmark(earlier)
                raise
        if new_dir:
            try:
                os.replace(new_dir, target)  # over an empty folder too
            except OSError:
                if old_dir:
                    os.rename(old_dir, target)
                    _unmark(earlier)
                    old_dir = None
                raise
            new_dir = None
        if lock is not None and not in_place:
            _unmark(lock)  # the export in place: no longer a partial folder
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
    """Move the export in new_dir into target (a mount point) file by file, each whole: the earlier
    mark first and the new one last, so that a kill in between leaves a folder no export takes."""
    earlier = {name for name in os.listdir(target) if not _is_partial(target, target, name)}
    if EXPORT_MARK in earlier:
        os.remove(os.path.join(target, EXPORT_MARK))
    names = sorted(set(os.listdir(new_dir)) - {EXPORT_MARK, PARTIAL_MARK})
    for name in names:
        os.replace(os.path.join(new_dir, name), os.path.join(target, name))
    for name in earlier - set(names) - {EXPORT_MARK}:  # an earlier export's file this one lacks (its tokenizer)
        os.remove(os.path.join(target, name))
    os.replace(os.path.join(new_dir, EXPORT_MARK), os.path.join(target, EXPORT_MARK))
    os.remove(os.path.join(new_dir, PARTIAL_MARK))
    os.rmdir(new_dir)


# --- the tokenizer files --------------------------------------------------------------------------

# written as files, not through transformers: the same bytes whatever versions export, in the form the
# oldest reads (docs/hf.md): PreTrainedTokenizerFast exists in 4.x and 5.x
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def _byte_chars() -> list[str]:
    """Byte-level BPE's printable stand-in for each byte value (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1)]
    printable += range(ord("\u00ae"), ord("\u00ff") + 1)
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [chars[b] for b in range(256)]


def gpt2_tokenizer_files(model_max_length: int) -> dict[str, dict]:
    """GPT-2's tokenizer as a fast tokenizer's files (name -> JSON value): r50k_base's ids, split pattern and
    merges (TikTokenConverter's rule), <|endoftext|> as bos/eos/unk; model_max_length: the block size."""
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
    split = dict(type="Split", pattern=dict(Regex=enc._pat_str), behavior="Isolated", invert=False)
    eot = dict(id=EOT, content=EOT_TEXT, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
    unset = dict.fromkeys(("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"))
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [eot],
        "normalizer": None,
        "pre_tokenizer": dict(
            type="Sequence", pretokenizers=[split, dict(byte_level, add_prefix_space=False, use_regex=False)]
        ),
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": byte_level,
        "model": dict(type="BPE", **unset, fuse_unk=False, byte_fallback=False, ignore_merges=True),
    }
    tokenizer["model"]["vocab"] = {text(token): rank for token, rank in ranks.items()}
    tokenizer["model"]["merges"] = [f"{left} {right}" for *_, left, right in merges]  # no token holds a space
    specials = dict(bos_token=EOT_TEXT, eos_token=EOT_TEXT, unk_token=EOT_TEXT)
    config = dict(tokenizer_class=TOKENIZER_CLASS, **specials, model_max_length=model_max_length)
    config.update(clean_up_tokenization_spaces=False)
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config, "special_tokens_map.json": specials}
