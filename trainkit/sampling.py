"""Sampling text from our GPT (its KV-cache generate), shared by sample.py and the trainer's
--sample-every: the prompt's tokens, each sample's own generator, the rows drawn at once."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from trainkit.cli import UserError
from trainkit.tokenizer import EOT
from trainkit.train_flags import SAMPLE_PROMPT


def encode_prompt(enc, prompt: str, vocab_size: int) -> list[int]:
    """Token ids of prompt (a literal <|endoftext|> is that token; an empty prompt is <|endoftext|>
    alone, the start of a document), or a UserError if one lies beyond the model's vocabulary."""
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
    """Rows of tokens positions (at most a block) whose sampling fits in SAMPLE_BATCH_BYTES, in
    1..SAMPLE_BATCH_ROWS: per row, the KV cache of every layer, one layer's activations (x, qkv,
    MLP) and attention scores of a forward over the whole window, and the logits and probabilities."""
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
    prompt=SAMPLE_PROMPT,
    n=4,
    length=32,
    temperature=1.0,
    top_k=50,
    seed=42,
    end_at_eot=True,
    batch_rows=None,
    stop_early=True,
):
    """Yields n continuations of prompt, each the prompt followed by up to length sampled tokens,
    as text; with end_at_eot a continuation ends with its first <|endoftext|> (as Hugging Face's
    generate stops at the eos token), otherwise it runs on past it.

    Sample i draws from its own generator (seed, i), so the texts do not depend on batch_rows, the
    rows drawn at once (default: sample_batch_rows; a huge n never holds more). stop_early: stop a
    batch once all its samples have ended (a sharded model passes False: every rank must run the
    same forwards). Padded vocabulary ids (beyond the tokenizer's) have no text and are left out."""
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
            out = model.generate(
                idx, length, temperature=temperature, top_k=top_k, generator=generators, stop_token=stop_token
            )
            for row in out[:, len(ids) :].tolist():
                if end_at_eot and EOT in row:
                    row = row[: row.index(EOT) + 1]
                yield prompt + enc.decode([t for t in row if t < enc.n_vocab])
    finally:
        model.train(was_training)
