"""The token shards: their format (.npy or llm.c's .bin, 1-D uint16), their checks against fineweb.py's
manifest.json and the vocabulary (docs/data.md), and their identity as a checkpoint records it (shard_files)."""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import threading

import numpy as np

from trainkit import fileio
from trainkit.cli import UserError, clipped, reason_of
from trainkit.data.tokenizer import EOT, GPT2_VOCAB, real_vocab_size
from trainkit.fileio import check_regular, open_regular

# --- the shard format -----------------------------------------------------------------------------

MANIFEST = "manifest.json"  # beside the shards: their sizes, checksums and where each ends in the documents
BIN_MAGIC, BIN_VERSION, BIN_HEADER_INTS = 20240520, 1, 256  # llm.c's header for uint16 token shards


def shard_header(tokens: np.ndarray, fmt: str) -> bytes:
    if fmt == "bin":
        header = np.zeros(BIN_HEADER_INTS, dtype="<i4")
        header[:3] = BIN_MAGIC, BIN_VERSION, tokens.size
        return header.tobytes()
    buffer = io.BytesIO()  # exactly the header np.save writes
    np.lib.format.write_array_header_1_0(buffer, np.lib.format.header_data_from_array_1_0(tokens))
    return buffer.getvalue()


def open_shard(path: str) -> np.ndarray:
    """Memory-map a token shard (.npy or .bin); a UserError unless it is a regular file holding one."""
    try:
        check_regular(path)
        if path.endswith(".bin"):
            header = np.fromfile(path, dtype=np.int32, count=BIN_HEADER_INTS)
            if header.size < 3 or header[0] != BIN_MAGIC:
                raise UserError(f"{path}: not an llm.c token shard (bad magic). HINT: are you passing the right file?")
            if header[1] != BIN_VERSION:
                raise UserError(f"{path}: unsupported llm.c shard version {header[1]} (expected {BIN_VERSION})")
            n_tokens = int(header[2])
            expected = 4 * BIN_HEADER_INTS + 2 * n_tokens
            actual = os.path.getsize(path)
            if actual != expected:
                raise UserError(
                    f"{path}: header says {n_tokens} tokens ({expected} bytes) but the file has {actual} bytes: truncated or corrupt, re-create it"
                )
            return np.memmap(path, dtype=np.uint16, mode="r", offset=4 * BIN_HEADER_INTS, shape=(n_tokens,))
        with open(path, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise UserError(f"{path}: not a .npy token shard (bad magic). HINT: are you passing the right file?")
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise UserError(
            f"{path}: cannot read token shard ({reason_of(e)}); truncated or corrupt? re-create it"
        ) from None
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
        raise UserError(
            f"{path}: expected a 1-D uint16 token array, got {tokens.dtype} with shape {tokens.shape}. HINT: are you passing the right file?"
        )
    return tokens


# --- manifest.json's schema: one check for its writer (fineweb.py resuming) and its reader (the trainer) ----------


_count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0
_file_name = lambda v: isinstance(v, str) and v not in ("", ".", "..") and "/" not in v and "\0" not in v
_token_id_or_null = lambda v: v is None or (_count(v) and v <= np.iinfo(np.uint16).max)
_sha256_or_null = lambda v: v is None or (isinstance(v, str) and len(v) == 64 and set(v) <= set("0123456789abcdef"))
_listed_input = lambda v: isinstance(v, list) and len(v) == 3 and isinstance(v[0], str) and all(map(_count, v[1:]))
_input_listing = lambda v: v is None or (isinstance(v, list) and all(map(_listed_input, v)))


# field: (test, what it must be, required: always / for fineweb.py to resume / never); fields not named are ignored
MANIFEST_FIELDS = {
    "complete": (lambda v: isinstance(v, bool), "true or false", "always"),
    "shards": (lambda v: isinstance(v, list), "a list of shards", "always"),
    "config": (lambda v: isinstance(v, dict), "an object", "resume"),
    "inputs": (_input_listing, "a list of [path, size, mtime_ns] or null", "never"),
    "source": (lambda v: isinstance(v, str), "text", "never"),
    "hub_revision": (lambda v: isinstance(v, str), "text", "never"),
}
SHARD_FIELDS = {
    "file": (_file_name, "a file name in the folder", "always"),
    "bytes": (_count, "a whole number of bytes", "always"),
    "split": (lambda v: v in ("train", "val"), '"train" or "val"', "never"),
    "tokens": (_count, "a whole number of tokens", "resume"),
    "documents": (_count, "a whole number of documents", "never"),
    "sha256": (_sha256_or_null, "64 hexadecimal digits or null", "never"),
    "max_id": (_token_id_or_null, "a token id (0..65535) or null", "never"),
    "documents_done": (_count, "a whole number of documents", "resume"),
    "next_document_tokens_done": (_count, "a whole number of tokens", "resume"),
}


def json_kind(value) -> str:
    """value's JSON type in words, with a short value where that helps: text ('false'), a list, ..."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return f"the number {clipped(value)}"
    if isinstance(value, str):
        return f"the text {value[:40]!r}"
    return "a list" if isinstance(value, list) else "an object"


def _field_problem(record: dict, fields: dict, where: str, resume: bool) -> str | None:
    for name, (fits, expected, required) in fields.items():
        if name not in record:
            if required == "always" or (required == "resume" and resume):
                return f"no field {where}{name}"
        elif not fits(record[name]):
            return f"field {where}{name} is {json_kind(record[name])}, not {expected}"
    return None


def manifest_problem(manifest, resume: bool = False) -> str | None:
    """What makes manifest not one fineweb.py writes, naming the field, or None; resume: its fields required too."""
    if not isinstance(manifest, dict):
        return f"it holds {json_kind(manifest)}, not an object"
    if problem := _field_problem(manifest, MANIFEST_FIELDS, "", resume):
        return problem
    seen = set()
    for i, shard in enumerate(manifest["shards"]):
        if not isinstance(shard, dict):
            return f"field shards[{i}] is {json_kind(shard)}, not an object"
        if problem := _field_problem(shard, SHARD_FIELDS, f"shards[{i}].", resume):
            return problem
        if shard["file"] in seen:
            return f"field shards[{i}].file names {shard['file']!r} a second time"
        seen.add(shard["file"])
    return None


# --- a data folder's shards checked ---------------------------------------------------------------


def folder_manifest(folder: str) -> dict | None:
    """fineweb.py's manifest.json in folder or None; one unreadable or not of the schema is a UserError."""
    path = os.path.join(folder, MANIFEST)
    try:
        manifest = fileio.read_json(path)
        problem = manifest_problem(manifest)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UserError(
            f"cannot read {path}: {reason_of(e)}; the shards it lists cannot be checked: make it readable, or move it out of the folder"
        ) from None
    except fileio.JSONFileError as e:
        problem = e.reason
    if problem:
        raise UserError(
            f"{path} is not a manifest fineweb.py wrote ({problem}); restore it, re-create the data set with fineweb.py, or move it out of the folder"
        )
    return manifest


def listed_shards(manifest: dict | None) -> dict[str, dict]:
    """{file: its entry} of the shards a manifest lists (none without one)."""
    return {shard["file"]: shard for shard in manifest["shards"]} if manifest else {}


def recorded(paths: list[str], key: str) -> list:
    """What each path's folder's manifest records for it under key, or None (no manifest, another size)."""
    listed = {folder: listed_shards(folder_manifest(folder)) for folder in {os.path.dirname(p) for p in paths}}
    values = []
    for path in paths:
        entry = listed[os.path.dirname(path)].get(os.path.basename(path))
        same_size = entry is not None and entry["bytes"] == os.path.getsize(path)
        values.append(entry.get(key) if same_size else None)
    return values


def check_against_manifest(folder: str, split: str, paths: list[str]):
    """Where a manifest is, refuse an unfinished run's shards, files of the split it does not list, listed ones
    missing or of another size."""
    manifest, where = folder_manifest(folder), os.path.join(folder, MANIFEST)
    if manifest is None:  # shards from another tool
        return
    if not manifest["complete"]:
        raise UserError(
            f"{folder} holds an unfinished fineweb.py run ({len(manifest['shards'])} shards written, {MANIFEST} says "
            "complete: false); finish it by running fineweb.py again as it was run"
        )
    listed = listed_shards(manifest)
    for path in paths:
        if os.path.basename(path) not in listed:
            raise UserError(
                f"{path} is not one of the shards that {where} lists: move it out of the folder (where "
                "a manifest is, the trainer reads the shards it lists and no others)"
            )
    for name, entry in sorted(listed.items()):
        path = os.path.join(folder, name)
        if f"_{split}_" not in name or (os.path.isfile(path) and os.path.getsize(path) == entry["bytes"]):
            continue
        what = f"is missing, yet {where} lists it"
        if os.path.isfile(path):
            what = f"is {os.path.getsize(path)} bytes, not the {clipped(entry['bytes'])} that {where} lists"
        raise UserError(f"{path} {what}; restore it, or re-create the data set with fineweb.py")


def no_output_for(path: str, token_id: int, vocab_size: int) -> str:
    """Why a model of vocab_size rows cannot train on a shard holding token_id (no output of its softmax)."""
    if vocab_size >= GPT2_VOCAB:
        return (
            f"{path} holds token id {token_id}, which the model has no output for: its softmax covers GPT-2's "
            f"{GPT2_VOCAB} tokens (ids 0..{EOT}), whatever --vocab-size pads; the shards come from another "
            "tokenizer (one with added tokens?): re-create them with fineweb.py"
        )
    return (
        f"{path} holds token id {token_id}, which the model has no output for (--vocab-size {vocab_size}: ids "
        f"0..{vocab_size - 1}); wrong tokenizer or --vocab-size too small"
    )


def check_token_ids(paths: list[str], largest_ids: list[int], vocab_size: int):
    """Refuse, before any step, shards whose largest id the model has no output for."""
    for path, largest in zip(paths, largest_ids):
        if largest >= real_vocab_size(vocab_size):
            raise UserError(no_output_for(path, largest, vocab_size))


class ShardDigestCheck:
    """Each shard's full sha256 against its manifest's, on a thread beside the steps (hashlib lets go of the GIL:
    0.4 to 0.8 s per 100M-token shard); close() ends it at the next MiB."""

    CHUNK = 1 << 20

    def __init__(self, paths: list[str]):
        self.error, self.thread, self.stopping = None, None, threading.Event()
        self.paths, self.digests = paths, recorded(paths, "sha256")

    def start(self):
        if any(self.digests) and self.thread is None:  # no thread (its stack and malloc arena) with nothing to check
            self.thread = threading.Thread(target=self._check, name="shard sha256")
            self.thread.start()

    def _check(self):
        buffer = bytearray(self.CHUNK)
        for path, expected in zip(self.paths, self.digests):
            if expected is None:
                continue
            digest = hashlib.sha256()
            try:
                with open_regular(path) as f:  # reads of CHUNK bytes, unbuffered: a stop waits for one at most
                    while n := f.raw.readinto(buffer):
                        if self.stopping.is_set():
                            return
                        digest.update(memoryview(buffer)[:n])
                if digest.hexdigest() != expected:
                    raise UserError(
                        f"{path} has sha256 {digest.hexdigest()[:16]}..., not the {expected[:16]}... that "
                        f"{os.path.join(os.path.dirname(path), MANIFEST)} records: the file changed since fineweb.py "
                        "wrote it (a damaged copy?); restore it, or re-create the data set with fineweb.py"
                    )
            except (UserError, OSError) as e:  # (UserError: swapped for a named pipe since start-up)
                self.error = e if isinstance(e, UserError) else UserError(f"cannot read {path}: {reason_of(e)}")
                return

    def failed(self) -> bool:
        return self.error is not None

    def result(self, wait: bool = True):
        """A UserError naming the first shard that differs: once all are checked, or (not wait) so far."""
        if wait and self.thread:
            self.thread.join()
        if self.error:
            raise self.error

    def close(self):
        """Stop checking (within one MiB) and wait for the thread to end."""
        self.stopping.set()
        if self.thread:
            self.thread.join()


def find_shards(data_dir: str, split: str) -> list[str]:
    """The split's shards in data_dir (*_{split}_*.npy or .bin, in name order), checked against its manifest."""
    if not os.path.isdir(data_dir):
        raise UserError(f"--data-dir {data_dir} does not exist; create shards with fineweb.py")
    folder = glob.escape(data_dir)  # a folder named like a pattern (data[1]) is still that folder
    paths = sorted(p for ext in ("npy", "bin") for p in glob.glob(os.path.join(folder, f"*_{split}_*.{ext}")))
    check_against_manifest(data_dir, split, paths)
    if not paths:
        raise UserError(
            f"no '{split}' shards (*_{split}_*.npy or .bin) in --data-dir {data_dir}; create them with fineweb.py"
        )
    return paths


# --- the shards a run reads, as a checkpoint records them -----------------------------------------

SAMPLES, SAMPLE_BYTES = 16, 64 << 10  # a shard's sampled content: 1 MiB


def sampled_sha256(path: str, size: int) -> str:
    """sha256 of a file's size and SAMPLES slices spread evenly from its first byte to its last (a small file
    whole). Every rank fingerprints every shard at start-up: 16 ms for a 200 MB shard, where a full sha256
    takes 0.8 s (benchmarks/bench_shard_identity.py), 80 s for FineWeb-Edu 10B's 100 shards."""
    digest = hashlib.sha256(str(size).encode())
    with open_regular(path) as f:
        if size <= SAMPLES * SAMPLE_BYTES:
            digest.update(f.read())
        else:
            for i in range(SAMPLES):
                f.seek(i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def shard_files(paths: list[str]) -> list[tuple[str, int, str, str | None]]:
    """Per shard: (file name, size, sampled_sha256, the sha256 its manifest records or None)."""
    files = []
    for path, sha256 in zip(paths, recorded(paths, "sha256")):
        size = os.path.getsize(path)
        files.append((os.path.basename(path), size, sampled_sha256(path, size), sha256))
    return files


def differing_file(a: list[tuple], b: list[tuple]) -> tuple[str, str, str] | None:
    """The first file that differs between two shard_files() lists, with what it is in each; None if none."""
    a_files, b_files = ({entry[0]: entry[1:] for entry in files} for files in (a, b))
    for name in sorted({*a_files, *b_files}):
        x, y = a_files.get(name), b_files.get(name)
        if x is None or y is None or x[0] != y[0]:
            size = lambda entry: f"{entry[0]} bytes" if entry else "missing"
            return name, size(x), size(y)
        for kind, i in (("sha256", 2), ("sampled content", 1)):
            if len(x) > i and len(y) > i and x[i] and y[i] and x[i] != y[i]:
                return name, f"{x[0]} bytes of {kind} {x[i][:12]}", f"{y[0]} bytes of {kind} {y[i][:12]}"
    return None


def data_fingerprint(data_dir: str) -> list[tuple[str, object]]:
    """The shards of data_dir every rank of a launch must share (a missing split left to TokenRows)."""
    items = []
    for split in ("train", "val"):
        try:
            files = shard_files(find_shards(data_dir, split))
        except (UserError, OSError):
            files = []
        items.append((f"{split} shards in --data-dir", files))
    return items
