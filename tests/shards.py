"""Synthetic token shards in build-nanogpt's format, for tests that don't need real text."""
import os

import numpy as np

EOT = 50256


def make_docs(n_docs, seed=0, min_len=3, max_len=40, vocab=1000):
    """Documents as token arrays, each opened by <|endoftext|> like fineweb.py writes them."""
    rng = np.random.default_rng(seed)
    return [np.concatenate([[EOT], rng.integers(0, vocab, rng.integers(min_len, max_len))]) for _ in range(n_docs)]


def write_shards(data_dir, docs, shard_size, prefix="synth"):
    """Concatenate docs and cut into shards; the first shard is val, the rest train."""
    os.makedirs(data_dir, exist_ok=True)
    stream = np.concatenate(docs).astype(np.uint16)
    paths = []
    for i, start in enumerate(range(0, len(stream), shard_size)):
        split = "val" if i == 0 else "train"
        path = os.path.join(data_dir, f"{prefix}_{split}_{i:06d}.npy")
        np.save(path, stream[start:start + shard_size])
        paths.append(path)
    return paths
