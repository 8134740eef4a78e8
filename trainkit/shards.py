"""The token shard format, one format with two users: a 1-D uint16 array, build-nanogpt's .npy or llm.c's .bin
with its header, written whole by fineweb.py (shard_header, through trainkit/shard_writer.py) and memory-mapped by
the trainer (open_shard); the manifest.json beside the shards is named MANIFEST. Runs nothing at import."""

from __future__ import annotations

import io
import os

import numpy as np

from trainkit.cli import UserError, reason_of
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
