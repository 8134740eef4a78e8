"""Which shards a run reads, as a checkpoint records them (shard_files: name, size, a sampled and the
manifest's sha256), and the first file that differs between two such lists (differing_file)."""

from __future__ import annotations

import hashlib
import os

from trainkit.regular_file import open_regular
from trainkit.cli import UserError
from trainkit.shard_checks import find_shards, recorded

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
    """The first file name that differs between two shard_files() lists, with what it is in each (size, else
    content: the manifests' sha256, then the sampled one); None if the same. (name, size) lists by size."""
    a_files, b_files = ({entry[0]: entry[1:] for entry in files} for files in (a, b))
    for name in sorted({*a_files, *b_files}):
        x, y = a_files.get(name), b_files.get(name)
        if x is None or y is None or x[0] != y[0]:
            size = lambda entry: f"{entry[0]} bytes" if entry else "missing"  # noqa: E731
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
