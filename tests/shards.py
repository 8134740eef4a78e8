"""Synthetic token shards in build-nanogpt's format, synthetic batches, and the tiny models the accumulation
proofs train on them, for tests that don't need real text."""

import contextlib
import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from train_gpt2 import GPT, GPTConfig

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
        paths.append(os.path.join(data_dir, f"{prefix}_{'train' if i else 'val'}_{i:06d}.npy"))
        np.save(paths[-1], stream[start : start + shard_size])
    return paths


def shard_dir(tmp_path_factory, n_docs, seed, vocab=64, min_len=3, max_len=50, shard_size=4000) -> str:
    """A fresh folder of shards of n_docs random documents (a module's data_dir fixture)."""
    path = tmp_path_factory.mktemp("shards")
    write_shards(path, make_docs(n_docs, seed, min_len, max_len, vocab), shard_size=shard_size)
    return str(path)


def make_batch(rows=8, T=16, seed=0, vocab=128):
    """(x, y) of random tokens below vocab (TINY's 128), a different number of ignored targets (-1) in each row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (rows, T), generator=g)
    y = torch.randint(0, vocab, (rows, T), generator=g)
    for r in range(rows):
        y[r, T - 2 * r :] = -1
    return x, y


def rank_batches(x, y, rank, world, B, accum):
    """One rank's micro-batches as numpy (x, y), as the trainer assigns rows: micro-step m of rank r reads rows
    (m*W + r)*B + [0, B)."""
    return [(x[(m * world + rank) * B :][:B].numpy(), y[(m * world + rank) * B :][:B].numpy()) for m in range(accum)]


def write_manifest(data_dir, **recorded) -> dict:
    """A fineweb.py manifest.json listing every shard in data_dir with its size and sha256 (complete),
    as fineweb.py would write for them; recorded: {file: {key: value}} to add to or change an entry."""
    shards = []
    for name in sorted(name for name in os.listdir(data_dir) if name.endswith(".npy")):
        data = Path(data_dir, name).read_bytes()
        shards.append({"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        shards[-1].update(recorded.get(name, {}))
    manifest = {"complete": True, "shards": shards}
    Path(data_dir, "manifest.json").write_text(json.dumps(manifest))
    return manifest


# --- the tiny models of the accumulation proofs ------------------------------------------------
TINY = GPTConfig(block_size=16, vocab_size=128, n_layer=2, n_head=2, n_embd=16)
DOC_TINY = dataclasses.replace(TINY, vocab_size=50304)  # GPT-2's ids, <|endoftext|> among them (--doc-mask)


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def loss_and_grads(model, loss_fn, upstream=1.0):
    """(loss, gradients) of model's parameters for loss_fn()'s loss, backpropagated times upstream."""
    model.zero_grad()
    loss = loss_fn()
    (loss * upstream).backward()
    return loss.item(), grads_of(model)


def fresh_model(doc_mask=False):
    torch.manual_seed(1)
    return GPT(DOC_TINY if doc_mask else TINY)


def reference_grads(x, y, doc_mask=False):
    model = fresh_model(doc_mask)  # the token mean over every non-ignored target of the 8 rows:
    loss, grads = loss_and_grads(model, lambda: model(x, y, doc_mask=doc_mask)[1])
    return grads, loss


@contextlib.contextmanager
def gloo_rank_of_one_batch(rank, world, port):
    """In a gloo group of world processes: (this rank's micro-batches of make_batch()'s 8 rows, 2 rows x 2
    micro-steps; the step's token count)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x, y = make_batch()
        yield rank_batches(x, y, rank, world, B=2, accum=2), int((y != -1).sum())
    finally:
        dist.destroy_process_group()
