"""The token shard format, one format with two users: a 1-D uint16 array, build-nanogpt's .npy or llm.c's .bin
with its header, written whole by fineweb.py (shard_header, through trainkit/shard_writer.py) and memory-mapped by
the trainer (open_shard); the manifest.json beside the shards is named MANIFEST. Runs nothing at import."""

from __future__ import annotations

import io
import json
import os

import numpy as np

from trainkit.cli import UserError, clipped, reason_of
from trainkit.regular_file import check_regular

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
    """Memory-map a token shard: build-nanogpt's .npy (uint16) or llm.c's .bin; a UserError unless it is a
    regular file (a named pipe would block the read forever, a link to /dev/zero be read until memory runs out)."""
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
                    f"{path}: header says {n_tokens} tokens ({expected} bytes) but the file "
                    f"has {actual} bytes: truncated or corrupt, re-create it"
                )
            return np.memmap(path, dtype=np.uint16, mode="r", offset=4 * BIN_HEADER_INTS, shape=(n_tokens,))
        with open(path, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise UserError(f"{path}: not a .npy token shard (bad magic). HINT: are you passing the right file?")
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except UserError:
        raise
    except (ValueError, OSError, EOFError) as e:
        raise UserError(
            f"{path}: cannot read token shard ({reason_of(e)}); truncated or corrupt? re-create it"
        ) from None
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
        raise UserError(
            f"{path}: expected a 1-D uint16 token array, got {tokens.dtype} with shape "
            f"{tokens.shape}. HINT: are you passing the right file?"
        )
    return tokens


# --- manifest.json's schema: one check for its writer (fineweb.py resuming) and its reader (the trainer) ----------


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _file_name(value) -> bool:
    return isinstance(value, str) and value not in ("", ".", "..") and "/" not in value and "\0" not in value


def _token_id_or_null(value) -> bool:
    return value is None or (_count(value) and value <= np.iinfo(np.uint16).max)


def _sha256_or_null(value) -> bool:
    return value is None or (isinstance(value, str) and len(value) == 64 and set(value) <= set("0123456789abcdef"))


def _input_listing(value) -> bool:
    return value is None or (
        isinstance(value, list)
        and all(
            isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and all(map(_count, item[1:]))
            for item in value
        )
    )


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
    """What makes manifest (a decoded manifest.json) not one fineweb.py writes, naming the field (e.g. "field
    shards[3].file is a list, not a file name in the folder"); None where it is one. resume: the fields that a
    resumed fineweb.py reads are required too (the trainer reads only the list of shards)."""
    if not isinstance(manifest, dict):
        return f"it holds {json_kind(manifest)}, not an object"
    problem = _field_problem(manifest, MANIFEST_FIELDS, "", resume)
    if problem:
        return problem
    seen = set()
    for i, shard in enumerate(manifest["shards"]):
        if not isinstance(shard, dict):
            return f"field shards[{i}] is {json_kind(shard)}, not an object"
        problem = _field_problem(shard, SHARD_FIELDS, f"shards[{i}].", resume)
        if problem:
            return problem
        if shard["file"] in seen:
            return f"field shards[{i}].file names {shard['file']!r} a second time"
        seen.add(shard["file"])
    return None
