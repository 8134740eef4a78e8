"""HellaSwag accuracy of a GPT-2 style model (validation split, 10042 examples).

    python hellaswag.py --checkpoint out/ckpt_0019073.pt
    python hellaswag.py --hf-model path/to/gpt2            # a local Hugging Face GPT-2 directory
    torchrun --nproc_per_node=8 hellaswag.py --checkpoint out/ckpt_0019073.pt
    python hellaswag.py --checkpoint out --data-file fixtures/hellaswag_val_subset.jsonl  # offline: the shipped subset

Completion scoring: each example is a context and four endings. Every ending is scored by the
model's cross-entropy on the ending's tokens given the context; the prediction is the ending
with the lowest mean token loss (acc_norm, as build-nanogpt and llm.c compute it: about 0.2955
for GPT-2 124M) or the lowest summed loss (acc). The trainer calls evaluate() during training.

lm-evaluation-harness scores the same examples differently: its hellaswag task rewrites the
text ("<activity_label>: <ctx_a> <Ctx_b>", WikiHow's bracketed tags removed) and normalizes the
summed log-likelihood by the ending's length in characters, not tokens. The command line also
reports those two numbers, lm_eval_acc and lm_eval_acc_norm; they equal lm-eval's acc and
acc_norm on its hellaswag task whenever context + ending fits the model's positions (all of
HellaSwag fits GPT-2's 1024; a shorter model cuts long contexts differently from lm-eval).
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import sys
import urllib.request
from typing import NamedTuple

import cli  # the error contract shared by every script; standard library only, so it comes first

DATA_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
DATA_NAME = "hellaswag_val.jsonl"
DATA_SHA256 = "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588"
DATA_EXAMPLES = 10042
DOWNLOAD_TIMEOUT_S = 10
# 446 examples of the validation set shipped with the repository, for scoring offline (fixtures/README.md)
SUBSET_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hellaswag_val_subset.jsonl")


# -----------------------------------------------------------------------------
# command line (standard library only: --help and usage errors answer before torch is imported)


def parse_args(argv=None):
    p = cli.ArgumentParser(description="HellaSwag (validation) accuracy of a GPT-2 model.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a checkpoint written by train_gpt2.py")
    src.add_argument("--hf-model", help="a local Hugging Face GPT-2 directory (needs transformers)")
    p.add_argument("--data-file", help=f"local copy of {DATA_NAME} (default: download it)")
    p.add_argument("--data-dir", help=f"where {DATA_NAME} is cached or downloaded to "
                                      "(default: $HELLASWAG_DIR or ~/.cache/gpt2-trainer/hellaswag)")
    p.add_argument("--limit", type=cli.non_negative_int, default=0, help="score only the first N examples (0: all 10042)")
    p.add_argument("--batch-size", type=cli.positive_int, default=None,
                   help="examples per forward pass (default: 16 on CUDA, 4 on CPU)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (auto: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="autocast dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    return p.parse_args(argv)


if __name__ == "__main__":
    cli.exit_on_ctrl_c_while_starting()
    parse_args()  # --help, or a usage error: answered now, before the slow imports

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from checkpoints import unwrap_model
from chunked_loss import exp_sums_
from cli import UserError
from fineweb import EOT, get_tokenizer_or_fail, real_vocab_size
from launch import (all_reduce_sum, autocast_context, checked_on_every_rank, exit_code_on_every_rank, print0,
                    process_group, resolve_dtype)


# -----------------------------------------------------------------------------
# data


def default_data_dir() -> str:
    return os.environ.get("HELLASWAG_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "gpt2-trainer", "hellaswag")


def resolve_data_file(data_file: str | None = None, data_dir: str | None = None, flag: str = "--data-file") -> str:
    """Path of the validation jsonl: data_file as given, else data_dir (or the default cache
    dir) / hellaswag_val.jsonl, downloaded there first if it is not there yet. flag names the
    option that passes data_file in the command being run (for its error messages)."""
    if data_file:
        if os.path.isdir(data_file):
            raise UserError(f"{flag} {data_file} is a folder: pass the file, e.g. "
                            f"{os.path.join(data_file, 'hellaswag_val.jsonl')}")
        if not os.path.isfile(data_file):
            raise UserError(f"{flag} {data_file} does not exist")
        return data_file
    path = os.path.join(data_dir or default_data_dir(), DATA_NAME)
    if not os.path.isfile(path):
        _download(path, flag)
    return path


def _download(path: str, flag: str):
    tmp = f"{path}.{os.getpid()}.tmp"  # one per process: torchrun ranks may download at once
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        digest = hashlib.sha256()
        with urllib.request.urlopen(DATA_URL, timeout=DOWNLOAD_TIMEOUT_S) as r, open(tmp, "wb") as f:
            while chunk := r.read(1 << 20):
                digest.update(chunk)
                f.write(chunk)
        if digest.hexdigest() != DATA_SHA256:
            raise OSError("the downloaded file is not the expected one (sha256 mismatch)")
        os.replace(tmp, path)
    except (OSError, http.client.HTTPException) as e:  # URLError, timeouts, disk errors, cut-off reads
        reason = getattr(e, "reason", None) or e
        raise UserError(f"cannot download HellaSwag from {DATA_URL} ({reason}); "
                        f"pass a local copy of {DATA_NAME} with {flag} PATH (the repository ships a subset: "
                        f"{os.path.relpath(SUBSET_FILE)})") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class Example(NamedTuple):
    """One rendered example: context token ids, the four endings' token ids, the label, and
    (lm-eval's rendering only) the endings' lengths in characters, its normalizer."""
    ctx: list[int]
    endings: list[list[int]]
    label: int
    ending_chars: tuple[int, ...] = ()

    def fit(self, block_size: int | None = None) -> tuple[list[int], list[list[int]]]:
        """Context and endings cut so that context + any ending fits in block_size: every
        ending is scored given the same context, the newest n_ctx tokens of it, where n_ctx is
        what the longest ending leaves (at least 1; an ending longer than that is cut)."""
        longest = max(len(e) for e in self.endings)
        if block_size is None or len(self.ctx) + longest <= block_size:
            return self.ctx, self.endings
        n_ctx = max(1, block_size - longest)
        return self.ctx[-n_ctx:], [e[:block_size - n_ctx] for e in self.endings]


def render_example(example: dict, enc) -> Example:
    """Tokenize one HellaSwag record (ValueError saying what is wrong with it). Endings are
    encoded with a leading space, as they follow the context's last word."""
    text, endings, label = check_record(example)
    return Example(enc.encode_ordinary(text), [enc.encode_ordinary(" " + e) for e in endings], label)


def lm_eval_clean(text: str) -> str:
    """lm-eval's hellaswag text clean-up: WikiHow's ' [title]' becomes '. ', other bracketed
    tags ([header], [step], ...) go, one double space becomes single, the ends are stripped."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def lm_eval_text(example: dict) -> tuple[str, list[str], int]:
    """(query, choices, label) of a record as lm-eval's hellaswag task shows it to the model:
    '<activity_label>: <ctx_a> <ctx_b capitalized>' and the four endings, each cleaned."""
    _, endings, label = check_record(example)
    fields = [example.get(key) for key in ("activity_label", "ctx_a", "ctx_b")]
    for key, value in zip(("activity_label", "ctx_a", "ctx_b"), fields):
        if not isinstance(value, str):
            raise ValueError(f"{key!r} must be text for lm-eval's rendering, not {value!r:.40}")
    activity, ctx_a, ctx_b = fields
    query = lm_eval_clean(f"{activity}: {ctx_a} {ctx_b.capitalize()}")
    return query, [lm_eval_clean(e) for e in endings], label


def render_lm_eval(example: dict, enc) -> Example:
    """Tokenize one record as lm-eval does: the query alone, and query + ' ' + choice whole,
    whose tokens after the query's are the ending (so a merge across the join, if any, is
    split the same way)."""
    query, choices, label = lm_eval_text(example)
    ctx = enc.encode_ordinary(query)
    endings = [enc.encode_ordinary(f"{query} {choice}")[len(ctx):] for choice in choices]
    if not ctx or not all(endings):
        raise ValueError("empty query or choice after lm-eval's clean-up")
    return Example(ctx, endings, label, tuple(len(choice) for choice in choices))


RENDERERS = {"nanogpt": render_example, "lm_eval": render_lm_eval}  # how a record becomes tokens

LABELS = (0, 1, 2, 3)


def check_record(example) -> tuple[str, list[str], int]:
    """(ctx, endings, label) of a record that has a non-empty ctx, a list of 4 non-empty
    endings and a label 0-3 (an int, or its digit as a string as some copies store it): a
    label of 1.9 or true, or endings given as one string, would silently score the wrong thing."""
    if not isinstance(example, dict):
        raise ValueError(f"a JSON object is expected, not {type(example).__name__}")
    missing = [key for key in ("ctx", "endings", "label") if key not in example]
    if missing:
        raise ValueError(f"no {missing[0]!r} field")
    ctx, endings, label = example["ctx"], example["endings"], example["label"]
    if not isinstance(ctx, str) or not ctx:
        raise ValueError(f"'ctx' must be non-empty text, not {ctx!r:.40}")
    if not (isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) and e for e in endings)):
        raise ValueError(f"'endings' must be a list of 4 non-empty strings, not {endings!r:.60}")
    if isinstance(label, str) and label in ("0", "1", "2", "3"):
        label = int(label)
    if type(label) is not int or label not in LABELS:  # not bool, float or another number
        raise ValueError(f"'label' must be 0, 1, 2 or 3, not {label!r:.20}")
    return ctx, endings, label


class _Rendered:
    """The lines of one data file, rendered on demand (the first n that a caller needs).
    Errors name the flag that gave the file (flag) and its line number."""

    def __init__(self, path: str, flag: str):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise UserError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise UserError(f"{flag} {path} line {line}: not UTF-8 text (byte 0x{data[e.start]:02x}), "
                            f"so not {DATA_NAME}") from None
        self.lines = [(number, line) for number, line in enumerate(text.split("\n"), start=1) if line.strip()]
        if not self.lines:
            raise UserError(f"{flag} {path}: no HellaSwag examples in the file")
        self.path, self.flag = path, flag
        self.examples: dict[str, list[Example]] = {style: [] for style in RENDERERS}

    def first(self, n: int, style: str = "nanogpt") -> list[Example]:
        examples, render = self.examples[style], RENDERERS[style]
        if len(examples) < n:
            enc = get_tokenizer_or_fail()
            for number, line in self.lines[len(examples):n]:
                try:
                    examples.append(render(json.loads(line), enc))
                except ValueError as e:  # json's errors are ValueErrors too
                    raise UserError(f"{self.flag} {self.path} line {number}: not a HellaSwag example "
                                    f"({e})") from None
        return examples[:n]


_CACHE: dict[tuple, _Rendered] = {}  # (real path, mtime, size) -> its rendered examples


def _rendered(path: str, flag: str) -> _Rendered:
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_mtime_ns, st.st_size)
    if key not in _CACHE:
        _CACHE[key] = _Rendered(path, flag)
    return _CACHE[key]


def load_examples(path: str, limit: int | None = None, flag: str = "--data-file",
                  style: str = "nanogpt") -> list[Example]:
    """The first limit (None or 0: all) examples of a jsonl file, tokenized once per process.
    flag names the option that gave path in the command being run (for its error messages).
    style: "nanogpt" (the record's ctx and endings, as build-nanogpt renders them) or
    "lm_eval" (lm-eval's hellaswag text, see render_lm_eval)."""
    data = _rendered(path, flag)
    return data.first(limit or len(data.lines), style)


def describe_data(path: str, limit: int | None = None) -> str:
    """One line that says which examples of which file are scored, and what chance scores: the
    shipped subset is named as such, so that its score is never taken for the full set's."""
    total = len(_rendered(path, "--data-file").lines)
    n = min(limit or total, total)
    which = f"all {total} examples" if n == total else f"the first {n} of {total} examples"
    subset = os.path.exists(SUBSET_FILE) and os.path.samefile(path, SUBSET_FILE)
    kind = f" (the subset the repository ships, not the full {DATA_EXAMPLES}-example set)" if subset else ""
    return f"hellaswag: {which} in {path}{kind}; chance is 0.25"


def collate(examples: list[Example], block_size: int | None = None):
    """Rows of a batch for a model that only takes token ids: 4 per example (context + ending
    i, cut by Example.fit), right-padded to the longest row.

    Returns tokens (4B, T) int64, mask (4B, T) bool that is True on ending tokens (the
    tokens that are scored), and labels (B,) int64."""
    rows = []
    for ex in examples:
        ctx, endings = ex.fit(block_size)
        rows += [(ctx, end) for end in endings]
    T = max(len(c) + len(e) for c, e in rows)
    tokens = np.full((len(rows), T), EOT, dtype=np.int64)
    mask = np.zeros((len(rows), T), dtype=bool)
    for i, (ctx, end) in enumerate(rows):
        tokens[i, :len(ctx) + len(end)] = ctx + end
        mask[i, len(ctx):len(ctx) + len(end)] = True
    labels = np.array([ex.label for ex in examples], dtype=np.int64)
    return torch.from_numpy(tokens), torch.from_numpy(mask), torch.from_numpy(labels)


class Packed(NamedTuple):
    """A batch for our GPT, one row per example: the context once, then each ending but its
    last token (which predicts nothing that is scored). Ending i attends to the context and
    to itself only and restarts its positions after the context, so every ending token sees
    exactly what it would see in its own row, but the context is run once, not 4 times.

    tokens, positions (B, L) int64 and attn_mask (B, 1, L, L) bool are the model's inputs.
    Scoring: the logits at the flat (b * L + t) indices `sources` predict `targets` for the
    ending rows `rows` (4b + i); `lengths` (4B,) counts each ending's scored tokens."""
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
            tokens[b, t:t + k], positions[b, t:t + k], segment[b, t:t + k] = end[:-1], np.arange(n, n + k), i + 1
            sources += [b * L + n - 1] + list(range(b * L + t, b * L + t + k))  # context's last token first
            targets += end
            rows += [4 * b + i] * len(end)
            lengths.append(len(end))
            t += k
    seg = torch.from_numpy(segment)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    same = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])  # key in the context or my own sequence
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return Packed(torch.from_numpy(tokens), torch.from_numpy(positions), (same & causal).unsqueeze(1),
                  as_long(sources), as_long(targets), as_long(rows), as_long(lengths))


# -----------------------------------------------------------------------------
# scoring


def model_block_size(model: nn.Module) -> int | None:
    """Longest sequence the model takes: our GPTConfig.block_size or HF's n_positions."""
    config = getattr(unwrap_model(model), "config", None)
    return getattr(config, "block_size", None) or getattr(config, "n_positions", None)


# positions per lm_head call: 26 MB of fp32 logits. From 32 MB up glibc maps every allocation
# afresh, and its page faults made 256 rows 10-20% slower on CPU (bench_hellaswag.py)
LOGIT_ROWS = 128


@torch.no_grad()
def score_packed(model: nn.Module, batch: Packed, dtype: torch.dtype = torch.float32):
    """Summed and mean cross-entropy of each ending, each (4B,) float32, for our GPT (a model with
    hidden_states and lm_head).

    The lm_head runs only at the positions that predict an ending token, once per position
    (the context's last token predicts all four endings' first tokens), its softmax over the real
    vocabulary as in training (the padded ids carry no probability)."""
    device = batch.tokens.device
    sources, inverse = torch.unique(batch.sources, return_inverse=True)
    lse = torch.empty(len(sources), device=device)  # log-sum-exp of each source position's logits
    target_logits = torch.empty(len(inverse), device=device)
    n_real = real_vocab_size(model.config.vocab_size)
    with autocast_context(device.type, dtype):
        h = model.hidden_states(batch.tokens, batch.positions, batch.attn_mask)
        h = h.view(-1, h.size(-1))[sources]
        for start in range(0, len(sources), LOGIT_ROWS):  # bounded (rows, vocab) logits
            logits = model.lm_head(h[start:start + LOGIT_ROWS])[:, :n_real].float()
            here = (inverse >= start) & (inverse < start + LOGIT_ROWS)
            target_logits[here] = logits[inverse[here] - start, batch.targets[here]]
            maxes, _, sums = exp_sums_(logits)
            lse[start:start + LOGIT_ROWS] = maxes + sums.log()
    token_loss = lse[inverse] - target_logits
    loss_sum = torch.zeros(len(batch.lengths), device=device).index_add_(0, batch.rows, token_loss)
    return loss_sum, loss_sum / batch.lengths


@torch.no_grad()
def score_rows(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor,
               dtype: torch.dtype = torch.float32):
    """Summed and mean cross-entropy of each row's masked tokens, each (rows,) float32, for a
    model that maps token ids to logits (collate's rows). The loss of token t comes from the
    logits at t - 1."""
    scored = mask[:, 1:]
    with autocast_context(tokens.device.type, dtype):
        out = model(tokens)
        logits = out[0] if isinstance(out, (tuple, list)) else out  # (logits, loss) or bare logits
        token_loss = F.cross_entropy(logits[:, :-1][scored].float(), tokens[:, 1:][scored], reduction="none")
    row = scored.nonzero()[:, 0]
    loss_sum = torch.zeros(len(tokens), device=tokens.device).index_add_(0, row, token_loss)
    return loss_sum, loss_sum / scored.sum(1)


def score_examples(model: nn.Module, examples: list[Example], device: str, *,
                   batch_size: int | None = None, dtype: torch.dtype = torch.float32,
                   block_size: int | None = None, progress: bool = False):
    """Per-ending (summed, mean) losses, each (n, 4) float32 on the CPU, in example order.

    Our GPT scores packed rows (pack, score_packed); any other model, collate's 4 rows per
    example through its full logits (score_rows). Examples are batched in order of length,
    so little padding is computed. batch_size None: 16 on CUDA; 4 on CPU, where bigger
    batches save no more per-op overhead than they add in padding and memory traffic."""
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
    from tqdm import tqdm
    bar = tqdm(total=len(examples), desc="hellaswag", unit="example", disable=not progress)
    loss_sum = torch.zeros(len(examples), 4)
    loss_mean = torch.zeros(len(examples), 4)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            batch = [examples[i] for i in idx]
            if gpt is not None:
                s, m = score_packed(gpt, pack(batch, block_size).to(device), dtype)
            else:
                tokens, mask, _ = collate(batch, block_size)
                s, m = score_rows(model, tokens.to(device), mask.to(device), dtype)
            loss_sum[idx] = s.view(-1, 4).cpu()
            loss_mean[idx] = m.view(-1, 4).cpu()
            bar.update(len(idx))
    finally:
        model.train(was_training)
        bar.close()
    return loss_sum, loss_mean


def evaluate(model: nn.Module, device: str, *, limit: int | None = None, batch_size: int | None = None,
             data_file: str | None = None, data_dir: str | None = None, rank: int = 0,
             world_size: int = 1, dtype: torch.dtype = torch.float32, progress: bool = False,
             block_size: int | None = None, flag: str = "--data-file", lm_eval: bool = False) -> dict:
    """HellaSwag accuracy of model on the first limit (None or 0: all) validation examples.

    model maps token ids (B, T) to logits (B, T, V), bare or as the first item of a tuple.
    With world_size > 1 every rank must call this (it ends in one all-reduce): rank r scores
    examples r, r + W, r + 2W, ... and all ranks return the totals.
    flag names the option that gave data_file in the command being run (for its errors).
    Returns {"acc": ..., "acc_norm": ..., "n": ...}: the summed and the per-token loss picks on
    the record's own text; with lm_eval also "lm_eval_acc" and "lm_eval_acc_norm": the summed
    and the per-character picks on lm-eval's text (its hellaswag task's acc and acc_norm)."""
    if world_size > 1 and not torch.distributed.is_initialized():
        raise ValueError("world_size > 1 needs an initialized process group")
    path = resolve_data_file(data_file, data_dir, flag)
    styles = ("nanogpt", "lm_eval") if lm_eval else ("nanogpt",)
    picks = []  # (n, 4) losses whose argmin is a prediction, one per reported accuracy
    for style in styles:
        mine = load_examples(path, limit, flag, style)[rank::world_size]
        loss_sum, loss_mean = score_examples(model, mine, device, batch_size=batch_size, dtype=dtype,
                                             block_size=block_size, progress=progress and rank == 0)
        if style == "nanogpt":
            picks += [loss_sum, loss_mean]
        else:
            # (n, 4) also where n is 0: a rank of a launch with more ranks than examples gets none
            chars = torch.tensor([ex.ending_chars for ex in mine], dtype=torch.float32).view(-1, 4)
            picks += [loss_sum, loss_sum / chars]
    labels = torch.tensor([ex.label for ex in mine], dtype=torch.long)
    counts = torch.tensor([int((losses.argmin(1) == labels).sum()) for losses in picks] + [len(mine)],
                          device=device)
    if world_size > 1:
        all_reduce_sum(counts)
    *correct, n = counts.tolist()
    names = ("acc", "acc_norm", "lm_eval_acc", "lm_eval_acc_norm")
    return {**{name: c / n for name, c in zip(names, correct)}, "n": n}


# -----------------------------------------------------------------------------
# command line


class HFLogits(nn.Module):
    """A Hugging Face GPT2LMHeadModel whose forward returns bare logits."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config  # n_positions gives the block size

    def forward(self, idx):
        return self.hf(input_ids=idx).logits


def load_hf_model(path: str, device: str) -> nn.Module:
    from hf_interop import load_hf_model as load_gpt2lmheadmodel
    return HFLogits(load_gpt2lmheadmodel(path, "--hf-model")).to(device).eval()


def run(args) -> dict:
    def load_data_and_model(device: str):
        data_file = resolve_data_file(args.data_file, args.data_dir)
        for style in RENDERERS:  # a bad file fails before loading a model; evaluate reuses these
            load_examples(data_file, args.limit, style=style)
        if args.checkpoint:
            sys.modules.setdefault("hellaswag", sys.modules[__name__])  # run as a program: the trainer's
            from train_gpt2 import GPT  # `import hellaswag` gets this module, not a second copy (only this command
            # imports the trainer, for the model class of our checkpoints)
            return data_file, GPT.from_checkpoint(args.checkpoint, device)
        return data_file, load_hf_model(args.hf_model, device)

    with process_group(args.device) as d:
        dtype = resolve_dtype(args.dtype, d.device_type)
        # each rank reads its node's files: one with a file missing or bad is named, by rank 0
        data_file, model = checked_on_every_rank(d, lambda: load_data_and_model(d.device))
        result = evaluate(model, d.device, limit=args.limit, batch_size=args.batch_size, data_file=data_file,
                          rank=d.rank, world_size=d.world_size, dtype=dtype, progress=True, lm_eval=True)
        print0(describe_data(data_file, args.limit))  # stdout only once there is a result
        print0(json.dumps(result))
        return result


def main(argv=None) -> int:
    args = parse_args(argv)
    return exit_code_on_every_rank(lambda: run(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
