"""HellaSwag scoring, completion style as build-nanogpt and llm.c score it (hellaswag.py and
--hellaswag-every): examples packed into rows, each ending's loss, and the accuracy (evaluate)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from trainkit.runfiles.checkpoints import unwrap_model
from trainkit.runtime.kernels import exp_sums_
from trainkit.cli import UserError
from trainkit.evaluation.hellaswag_examples import Example, load_examples, resolve_data_file
from trainkit.runtime.launch import all_reduce_sum
from trainkit.data.tokenizer import EOT, GPT2_VOCAB, real_vocab_size


def collate(examples: list[Example], block_size: int | None = None):
    """4 rows per example (context + ending i) for a model that takes token ids, right-padded: tokens
    (4B, T), mask (4B, T) True on the scored ending tokens, labels (B,)."""
    rows = []
    for ex in examples:
        ctx, endings = ex.fit(block_size)
        rows += [(ctx, end) for end in endings]
    T = max(len(c) + len(e) for c, e in rows)
    tokens = np.full((len(rows), T), EOT, dtype=np.int64)
    mask = np.zeros((len(rows), T), dtype=bool)
    for i, (ctx, end) in enumerate(rows):
        tokens[i, : len(ctx) + len(end)] = ctx + end
        mask[i, len(ctx) : len(ctx) + len(end)] = True
    labels = np.array([ex.label for ex in examples], dtype=np.int64)
    return torch.from_numpy(tokens), torch.from_numpy(mask), torch.from_numpy(labels)


class Packed(NamedTuple):
    """One row per example for our GPT: the context once, then each ending but its last token, attending to
    the context and itself with positions restarted after it (each token sees what it would in its own row).
    The logits at flat indices `sources` predict `targets` of ending rows `rows` (4b + i); `lengths` (4B,)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    attn_mask: torch.Tensor
    sources: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    lengths: torch.Tensor

    def to(self, device) -> Packed:
        return Packed(*(t.to(device) for t in self))


def pack(examples: list[Example], block_size: int | None = None) -> Packed:
    fitted = [ex.fit(block_size) for ex in examples]
    L = max(len(ctx) + sum(len(e) - 1 for e in endings) for ctx, endings in fitted)
    tokens = np.full((len(examples), L), EOT, dtype=np.int64)
    positions = np.zeros((len(examples), L), dtype=np.int64)
    segment = np.full((len(examples), L), 5, dtype=np.int64)  # 0: context, 1-4: ending i, 5: padding
    sources, targets, rows, lengths = [], [], [], []
    for b, (ctx, endings) in enumerate(fitted):
        n = len(ctx)
        tokens[b, :n], positions[b, :n], segment[b, :n] = ctx, np.arange(n), 0
        t = n
        for i, end in enumerate(endings):
            k = len(end) - 1  # tokens of this ending in the row
            tokens[b, t : t + k], positions[b, t : t + k], segment[b, t : t + k] = end[:-1], np.arange(n, n + k), i + 1
            sources += [b * L + n - 1] + list(range(b * L + t, b * L + t + k))  # context's last token first
            targets += end
            rows += [4 * b + i] * len(end)
            lengths.append(len(end))
            t += k
    seg = torch.from_numpy(segment)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    same = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])  # key in the context or my own sequence
    flat = [torch.tensor(x, dtype=torch.long) for x in (sources, targets, rows, lengths)]
    return Packed(torch.from_numpy(tokens), torch.from_numpy(positions), (same & causal).unsqueeze(1), *flat)


# --- scoring


def model_block_size(model: nn.Module) -> int | None:
    """Longest sequence the model takes: our GPTConfig.block_size or HF's n_positions."""
    config = getattr(unwrap_model(model), "config", None)
    return getattr(config, "block_size", None) or getattr(config, "n_positions", None)


def model_problem(vocab_size: int | None, block_size: int | None) -> str | None:
    """Why a model of these sizes cannot be scored on HellaSwag (GPT-2's token ids; an ending's first token
    predicted from at least one of context), or None."""
    if vocab_size is not None and vocab_size < GPT2_VOCAB:
        return (
            f"HellaSwag's examples are GPT-2's tokens (ids up to {EOT}), beyond this model's vocabulary of "
            f"{vocab_size} ids"
        )
    if block_size is not None and block_size < 2:
        return (
            f"HellaSwag predicts each ending from its context, which a model of --block-size {block_size} "
            "cannot see (it needs at least 2 positions)"
        )
    return None


# positions per lm_head call: 26 MB of fp32 logits. From 32 MB up glibc maps every allocation
# afresh, and its page faults made 256 rows 10-20% slower on CPU (bench_hellaswag.py)
LOGIT_ROWS = 128


@torch.no_grad()
def score_packed(model: nn.Module, batch: Packed, dtype: torch.dtype = torch.float32):
    """Summed and mean cross-entropy of each ending (4B,) for our GPT: lm_head runs once per position that
    predicts an ending token, its softmax over the real vocabulary as in training."""
    device = batch.tokens.device
    sources, inverse = torch.unique(batch.sources, return_inverse=True)
    lse = torch.empty(len(sources), device=device)  # log-sum-exp of each source position's logits
    target_logits = torch.empty(len(inverse), device=device)
    n_real = real_vocab_size(model.config.vocab_size)
    with torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
        h = model.hidden_states(batch.tokens, batch.positions, batch.attn_mask)
        h = h.view(-1, h.size(-1))[sources]
        for start in range(0, len(sources), LOGIT_ROWS):  # bounded (rows, vocab) logits
            logits = model.lm_head(h[start : start + LOGIT_ROWS])[:, :n_real].float()
            here = (inverse >= start) & (inverse < start + LOGIT_ROWS)
            target_logits[here] = logits[inverse[here] - start, batch.targets[here]]
            maxes, _, sums = exp_sums_(logits)
            lse[start : start + LOGIT_ROWS] = maxes + sums.log()
    token_loss = lse[inverse] - target_logits
    loss_sum = torch.zeros(len(batch.lengths), device=device).index_add_(0, batch.rows, token_loss)
    return loss_sum, loss_sum / batch.lengths


@torch.no_grad()
def score_rows(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Summed and mean cross-entropy of each row's masked tokens (rows,), for a model mapping ids to logits."""
    scored = mask[:, 1:]
    with torch.autocast(tokens.device.type, dtype, enabled=dtype != torch.float32):
        out = model(tokens)
        logits = out[0] if isinstance(out, (tuple, list)) else out  # (logits, loss) or bare logits
        token_loss = F.cross_entropy(logits[:, :-1][scored].float(), tokens[:, 1:][scored], reduction="none")
    row = scored.nonzero()[:, 0]
    loss_sum = torch.zeros(len(tokens), device=tokens.device).index_add_(0, row, token_loss)
    return loss_sum, loss_sum / scored.sum(1)


def score_examples(
    model, examples: list[Example], device: str, *, batch_size=None, dtype=torch.float32, block_size=None, bar=None
):
    """Per-ending (summed, mean) losses, each (n, 4) on the CPU, in example order: our GPT on packed rows,
    another model on collate's, batched by length (default 16 on CUDA; 4 on CPU, where more is more padding)."""
    if batch_size is None:
        batch_size = 16 if torch.device(device).type == "cuda" else 4
    longest = model_block_size(model)
    if block_size and longest and block_size > longest:
        raise ValueError(f"block_size {block_size} is longer than the model's {longest}")
    block_size = block_size or longest
    gpt = unwrap_model(model) if hasattr(unwrap_model(model), "hidden_states") else None  # our GPT

    def length(ex: Example) -> int:
        ctx, endings = ex.fit(block_size)
        return len(ctx) + sum(len(e) for e in endings)

    order = sorted(range(len(examples)), key=lambda i: length(examples[i]))
    loss_sum, loss_mean = torch.zeros(len(examples), 4), torch.zeros(len(examples), 4)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            batch = [examples[i] for i in idx]
            if gpt is not None:
                s, m = score_packed(gpt, pack(batch, block_size).to(device), dtype)
            else:
                tokens, mask, _ = collate(batch, block_size)
                s, m = score_rows(model, tokens.to(device), mask.to(device), dtype)
            loss_sum[idx] = s.view(-1, 4).cpu()
            loss_mean[idx] = m.view(-1, 4).cpu()
            if bar is not None:
                bar.update(len(idx))
    finally:
        model.train(was_training)
    return loss_sum, loss_mean


def evaluate(
    model: nn.Module,
    device: str,
    *,
    limit: int | None = None,
    batch_size: int | None = None,
    data_file: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    block_size: int | None = None,
    flag: str = "--data-file",
    lm_eval: bool = False,
) -> dict:
    """{"acc", "acc_norm", "n"} (lm_eval: also "lm_eval_acc", "lm_eval_acc_norm"; docs/hellaswag.md) of model
    on the first limit (None or 0: all) examples; under world_size > 1 every rank calls it, rank r scoring
    examples r, r + W, ..., and all get the totals. flag: the option that gave data_file."""
    if world_size > 1 and not torch.distributed.is_initialized():
        raise ValueError("world_size > 1 needs an initialized process group")
    config = getattr(unwrap_model(model), "config", None)
    problem = model_problem(getattr(config, "vocab_size", None), block_size or model_block_size(model))
    if problem:
        raise UserError(f"cannot score this model on HellaSwag: {problem}")
    path = resolve_data_file(data_file, flag=flag)
    # lm-eval's text differs from the record's in every example: the second rendering is scored after the first
    styles = ("nanogpt", "lm_eval") if lm_eval else ("nanogpt",)
    from tqdm import tqdm

    total = len(styles) * len(load_examples(path, limit, flag)[rank::world_size])
    desc = "hellaswag, both texts" if lm_eval else "hellaswag"
    picks = []  # (n, 4) losses whose argmin is a prediction, one per reported accuracy
    with tqdm(total=total, unit="example", desc=desc, disable=not (progress and rank == 0)) as bar:
        for style in styles:
            mine = load_examples(path, limit, flag, style)[rank::world_size]
            loss_sum, loss_mean = score_examples(
                model, mine, device, batch_size=batch_size, dtype=dtype, block_size=block_size, bar=bar
            )
            if style == "lm_eval":  # per character; (n, 4) also where a rank gets no example
                loss_mean = loss_sum / torch.tensor([ex.ending_chars for ex in mine], dtype=torch.float32).view(-1, 4)
            picks += [loss_sum, loss_mean]
    labels = torch.tensor([ex.label for ex in mine], dtype=torch.long)
    counts = torch.tensor([int((losses.argmin(1) == labels).sum()) for losses in picks] + [len(mine)], device=device)
    if world_size > 1:
        all_reduce_sum(counts)
    *correct, n = counts.tolist()
    names = ("acc", "acc_norm", "lm_eval_acc", "lm_eval_acc_norm")
    return {**{name: c / n for name, c in zip(names, correct)}, "n": n}
