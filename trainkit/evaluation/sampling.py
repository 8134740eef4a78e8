"""Sampling text from our GPT, shared by sample.py and the trainer's --sample-every: the KV cache and
generate() (top-k decoding), the prompt's tokens, each sample's own generator, the rows drawn at once."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from trainkit.cli import UserError
from trainkit.data.tokenizer import EOT, real_vocab_size


class LayerKVCache:
    """One attention layer's keys and values (B, n_head, length, head_size) of the tokens seen so far."""

    def __init__(self):
        self.k = self.v = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.size(2)

    def append(self, k, v):  # returns all of them
        if self.k is not None:
            k, v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)
        self.k, self.v = k, v
        return k, v


def new_kv_cache(model) -> list[LayerKVCache]:
    """An empty cache for each of model's layers (GPT.hidden_states's kv_cache)."""
    return [LayerKVCache() for _ in model.transformer.h]


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=50, generator=None, kv_cache=True, stop_token=None):
    """idx (B, T) extended by model (our GPT) by up to max_new_tokens tokens, each drawn from the top_k most
    likely of softmax(logits / temperature), seeing the newest block_size. generator: one for the batch, or one
    per row. stop_token: stop once every row has drawn it (cut the rows there). kv_cache: the same tokens."""
    block_size = model.config.block_size
    cache = None
    # the smallest positive float32: exp() of every nonzero gap below the max is then 0, as for any smaller T
    temperature = max(temperature, torch.finfo(torch.float32).tiny)
    stopped = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        new_tokens = idx[:, -block_size:]
        if kv_cache and cache is not None and idx.size(1) <= block_size:
            new_tokens = idx[:, cache[0].length :]
        elif kv_cache:
            cache = new_kv_cache(model)  # the first step, or the window slid
        x = model.hidden_states(new_tokens, kv_cache=cache)
        logits = model.lm_head(x[:, -1, :])[:, : real_vocab_size(model.config.vocab_size)].float()  # no padded id
        # the max first: (logits - max) / T is in [-inf, 0], so a tiny T cannot overflow to NaN
        logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
        probs = F.softmax(logits, dim=-1)
        topk_probs, topk_idx = torch.topk(probs, min(top_k, probs.size(-1)), dim=-1)
        if isinstance(generator, (list, tuple)):  # a row's tokens then do not depend on the batch
            choice = torch.cat([torch.multinomial(p[None], 1, generator=g) for p, g in zip(topk_probs, generator)])
        else:
            choice = torch.multinomial(topk_probs, 1, generator=generator)
        idx = torch.cat((idx, torch.gather(topk_idx, -1, choice)), dim=1)
        if stop_token is not None:
            stopped |= idx[:, -1] == stop_token
            if stopped.all():
                break
    return idx


def encode_prompt(enc, prompt: str, vocab_size: int) -> list[int]:
    """Token ids of prompt (<|endoftext|> as that token; '' as it alone: a new document), or a UserError for
    an id beyond the model's vocabulary."""
    ids = enc.encode(prompt, allowed_special={"<|endoftext|>"}) or [EOT]
    beyond = [t for t in ids if t >= vocab_size]
    if beyond:
        raise UserError(
            f"the prompt has token {beyond[0]} ({enc.decode([beyond[0]])!r}), beyond the model's "
            f"vocabulary of {vocab_size} ids"
        )
    return ids


SAMPLE_BATCH_BYTES = 2 << 30  # default rows drawn at once: as many as fit in this much memory,
SAMPLE_BATCH_ROWS = 64  # and at most this many, so that the first texts come soon


def sample_batch_rows(config, tokens: int, element_size: int = 4) -> int:
    """Rows of tokens positions (at most a block) whose sampling fits in SAMPLE_BATCH_BYTES, in 1..SAMPLE_BATCH_ROWS:
    per row every layer's KV cache, one layer's activations and attention scores over the window, the logits."""
    T, C = min(tokens, config.block_size), config.n_embd
    per_row = 2 * config.n_layer * T * C + 8 * T * C + config.n_head * T * T + 4 * config.vocab_size
    return max(1, min(SAMPLE_BATCH_ROWS, SAMPLE_BATCH_BYTES // (per_row * element_size)))


def sample_generator(seed: int, i: int, device: str) -> torch.Generator:
    """The generator of sample i (0, 1, ...) for seed: its own stream, whatever batch it is drawn in."""
    state = np.random.SeedSequence([seed, i]).generate_state(2, np.uint32)
    return torch.Generator(device=device).manual_seed(int(state[0]) << 32 | int(state[1]))


def sample_text(
    model: nn.Module,
    enc,
    device: str,
    prompt: str,
    n=4,
    length=32,
    temperature=1.0,
    top_k=50,
    seed=42,
    end_at_eot=True,
    batch_rows=None,
    stop_early=True,
):
    """Yields n texts, prompt and up to length sampled tokens, each ending at its first <|endoftext|> with
    end_at_eot. Sample i draws from its own generator (seed, i): the texts do not depend on batch_rows (default:
    sample_batch_rows). stop_early False (a sharded model): every rank runs the same forwards. Padded ids: left out."""
    was_training = model.training
    model.eval()
    ids = encode_prompt(enc, prompt, model.config.vocab_size)
    batch_rows = batch_rows or sample_batch_rows(
        model.config, len(ids) + length, next(model.parameters()).element_size()
    )
    stop_token = EOT if end_at_eot and stop_early else None
    try:
        for first in range(0, n, batch_rows):
            rows = range(first, min(n, first + batch_rows))
            idx = torch.tensor([ids] * len(rows), dtype=torch.long, device=device)
            generators = [sample_generator(seed, i, device) for i in rows]
            out = generate(
                model, idx, length, temperature=temperature, top_k=top_k, generator=generators, stop_token=stop_token
            )
            for row in out[:, len(ids) :].tolist():
                if end_at_eot and EOT in row:
                    row = row[: row.index(EOT) + 1]
                yield prompt + enc.decode([t for t in row if t < enc.n_vocab])
    finally:
        model.train(was_training)
