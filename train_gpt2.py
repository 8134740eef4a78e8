"""GPT-2 pretraining in one file, told top to bottom as one optimizer step.

    python fineweb.py --out-dir edu_fineweb10B                        # text -> uint16 token shards
    python train_gpt2.py --data-dir edu_fineweb10B                    # one GPU (or a CPU)
    torchrun --nproc_per_node=8 train_gpt2.py --data-dir edu_fineweb10B

The heart is token-normalized gradient accumulation (see "accumulation & the step"). Sections: config ->
model -> data -> optimizer & schedule -> accumulation & the step -> the Trainer -> main(). What keeps long
runs alive lives in trainkit/, called from here by name; no trainkit module imports a script.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from trainkit import cli  # defines: UserError and the error contract (one `error:` line, exit codes); stdlib only
from trainkit import train_flags  # defines: the parser built from RunConfig's fields, the checks of a run's values
from trainkit.train_flags import CPU_LOSS_CHUNK, LR_SCHEDULES, OPTIMIZERS, SEED, batch_size_flag, dist_timeout_range
from trainkit.train_flags import flag_group, in_unit_interval, one_of, positive

if __name__ == "__main__":
    cli.exit_on_ctrl_c_while_starting()


# -----------------------------------------------------------------------------
# config (standard library only: --help and usage errors answer before torch is imported)


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 1024  # longest sequence the position table covers
    vocab_size: int = 50304  # GPT-2's 50257 tokens padded to a multiple of 64 (faster matmuls)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


MODEL_FIELDS = [field.name for field in dataclasses.fields(GPTConfig)]  # what a checkpoint's model_config holds
MODEL_PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    "cpu": dict(n_layer=4, n_head=4, n_embd=128, block_size=256),  # trains on a laptop CPU
}


# the groups of --help, in its order: each declares its flags (train_flags.flag_group: default, help, check, options)
DATA, MODEL, BATCH = flag_group("data and output"), flag_group("model"), flag_group("batch")
OPTIMIZATION = flag_group("optimization")
EVALUATION = flag_group("evaluation and checkpoints (0 disables each)")
TRACKING = flag_group("run tracking (rank 0; each gets exactly the records of log.jsonl)")
FAILURES, DISTRIBUTED, RUNTIME = flag_group("failures"), flag_group("distributed"), flag_group("runtime")
ON_OFF, SIZE, COUNT = argparse.BooleanOptionalAction, cli.positive_int, cli.non_negative_int  # SIZE: >= 1, COUNT: >= 0


@dataclass(frozen=True)
class RunConfig:
    """What the user asked for: one field per flag, declared once (train_flags.flag_group: default, help, --help
    group, check), in --help's order; docs/flags.md says more of each. What a launch decides is a LaunchPlan."""

    data_dir: str = DATA("edu_fineweb10B", "folder of *_train_*/*_val_* shards (.npy or llm.c .bin)")
    out_dir: str = DATA("out", "log.jsonl and checkpoints go here")
    align_docs: bool = DATA(False, "start rows at document boundaries; pad row tails (targets -1)")
    shuffle: bool | None = DATA(
        None, "seeded shard and row order each epoch (default: on; a resume keeps its own)", action=ON_OFF
    )
    doc_mask: bool = DATA(False, "each token attends only to its own document of the row (doc-mask.md)")
    model: str | None = MODEL(
        None, "size preset (default gpt2); the flags below override it", choices=sorted(MODEL_PRESETS)
    )
    n_layer: int | None = MODEL(None, "transformer blocks", type=SIZE)
    n_head: int | None = MODEL(None, "attention heads", type=SIZE)
    n_embd: int | None = MODEL(None, "embedding width", type=SIZE)
    block_size: int | None = MODEL(None, "longest sequence the model handles", type=SIZE)
    vocab_size: int | None = MODEL(None, "vocabulary size (default 50304: GPT-2's 50257 padded)", type=SIZE)
    init_from: str | None = MODEL(None, "start from Hugging Face GPT-2 weights (Hub name or folder); sets the shape")
    batch_size: int | str | None = BATCH(
        None, "rows per rank per micro-step (B), or auto (default: auto on CUDA, 64 elsewhere)", type=batch_size_flag
    )
    seq_len: int | None = BATCH(None, "tokens per row (T); default: the model's block size", type=SIZE)
    total_batch_size: int = BATCH(
        524288, "tokens per optimizer step over all ranks; a multiple of B x T x world size", type=SIZE
    )  # 2**19
    max_steps: int = OPTIMIZATION(19073, "optimizer steps", type=COUNT)  # 10B tokens / 2**19
    warmup_steps: int = OPTIMIZATION(715, "linear LR warmup steps", type=COUNT)
    max_lr: float = OPTIMIZATION(6e-4, "peak learning rate", type=float)
    min_lr: float | None = OPTIMIZATION(None, "final learning rate (default: 10%% of --max-lr)", type=float)
    lr_schedule: str = OPTIMIZATION(
        "cosine", "decay after warmup to --min-lr: cosine, linear or wsd", one_of(LR_SCHEDULES), choices=LR_SCHEDULES
    )
    cooldown_frac: float = OPTIMIZATION(
        0.2, "wsd: fraction of --max-steps spent in the final linear decay", in_unit_interval, type=float
    )
    weight_decay: float = OPTIMIZATION(0.1, "AdamW decay on matrices and embeddings", type=float)
    optimizer: str = OPTIMIZATION(
        "adamw",
        "adamw, or muon: Muon on the blocks' matrices, AdamW on the rest",
        one_of(OPTIMIZERS),
        choices=OPTIMIZERS,
    )
    # Muon's LR and momentum: modded-nanogpt's, nanochat's
    muon_lr: float = OPTIMIZATION(0.02, "Muon's peak LR, scaled by the schedule as --max-lr is", type=float)
    muon_momentum: float = OPTIMIZATION(0.95, "Muon's (Nesterov) momentum", type=float)
    grad_clip: float = OPTIMIZATION(1.0, "clip the gradient norm to this (0: off)", type=float)
    val_every: int = EVALUATION(250, "validation loss every N steps", type=COUNT)
    val_steps: int = EVALUATION(20, "batches per validation", type=COUNT)
    sample_every: int = EVALUATION(250, "print text samples every N steps", type=COUNT)
    sample_prompt: str | None = EVALUATION(
        None, 'the text those samples continue (default: "Hello, I\'m a language model,")', type=cli.may_be_empty
    )  # None: train_flags.SAMPLE_PROMPT (English)
    hellaswag_every: int = EVALUATION(250, "HellaSwag accuracy every N steps", type=COUNT)
    hellaswag_limit: int = EVALUATION(0, "examples per HellaSwag eval (0: all)", type=COUNT)
    hellaswag_file: str | None = EVALUATION(None, "local hellaswag_val.jsonl (default: download/cache)")
    ckpt_every: int = EVALUATION(5000, "checkpoint every N steps (and at the end)", type=COUNT)
    keep_last: int = EVALUATION(0, "keep only the newest K checkpoints (0: all)", type=COUNT)
    resume: str | None = EVALUATION(
        None, "continue from the newest checkpoint in --out-dir (or the given path)", nargs="?", const="latest"
    )
    eval_only: bool = EVALUATION(False, "with --resume [PATH] or --init-from: evaluate once, train and write nothing")
    wandb: str | None = TRACKING(None, "log to this Weights & Biases project (pip install wandb)", metavar="PROJECT")
    tensorboard: bool = TRACKING(False, "write TensorBoard event files to --out-dir (pip install tensorboard)")
    skip_nonfinite: int = FAILURES(
        0, "skip up to N steps with a non-finite loss or grad norm instead of stopping", type=COUNT
    )
    skip_spikes: float = FAILURES(
        0.0, "skip updates whose loss or grad norm is Z std devs above the recent window (0: off)", type=float
    )
    dist_timeout: float = FAILURES(
        600.0, "seconds a collective may wait for a dead or stuck rank", dist_timeout_range, type=float
    )
    debug: bool = FAILURES(False, "show tracebacks for user errors")
    fsdp: bool = DISTRIBUTED(False, "shard parameters, gradients and AdamW state over the ranks (FSDP2)")
    device: str = RUNTIME("auto", "auto (CUDA, else MPS, else CPU), cpu, cuda, cuda:N or mps (Apple; untested)")
    dtype: str = RUNTIME("auto", "autocast dtype (auto: by device)", choices=["auto", "float32", "bfloat16", "float16"])
    compile: bool | None = RUNTIME(None, "torch.compile the model (default: on CUDA with Triton)", action=ON_OFF)
    activation_checkpointing: bool = RUNTIME(False, "recompute activations in backward: less memory, more compute")
    loss_chunk: int | None = RUNTIME(
        None, f"lm_head + loss in chunks of N rows (0: off; default {CPU_LOSS_CHUNK} on CPU)", type=COUNT
    )
    seed: int = RUNTIME(1337, "seed for init and shuffling", type=SEED)
    peak_tflops: float | None = RUNTIME(
        None, "dense peak TFLOP/s of one device, for MFU (default: by GPU name)", positive, type=float
    )

    @property
    def cooldown_start(self) -> int:
        """First step of WSD's linear cooldown: the last cooldown_frac of max_steps."""
        return self.max_steps - round(self.cooldown_frac * self.max_steps)


def build_parser() -> argparse.ArgumentParser:
    """The command line: RunConfig's fields as flags (trainkit/train_flags.py)."""
    return train_flags.build_parser(RunConfig, "Pretrain GPT-2 on token shards (torchrun for several GPUs).")


if __name__ == "__main__":
    build_parser().parse_args()  # --help, or a usage error: answered now, not after importing torch


# -----------------------------------------------------------------------------
# imports: torch, and the modules that keep long runs alive (README's module table says what each holds)

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from trainkit import components
from trainkit.cli import print0, print_result
from trainkit.components import Checkpointer, LaunchInputs, LaunchPlan, resume_state
from trainkit.data.shard_scan import open_split
from trainkit.data.shards import no_output_for
from trainkit.data.tokenizer import EOT, real_vocab_size
from trainkit.evaluation import hellaswag_eval
from trainkit.evaluation.sampling import sample_text
from trainkit.hf.weights import gpt2_state_from_hf
from trainkit.runfiles.checkpoints import checkpoint_path, latest_checkpoint, load_checkpoint
from trainkit.runfiles.resume import data_files, eval_checkpoint
from trainkit.runfiles.run_folder import OutDirLock, RunLog, open_run_log
from trainkit.runtime.device import compile_failure_cause, compile_model, fsdp_no_sync, is_fsdp, is_out_of_memory
from trainkit.runtime.device import out_of_memory_error, out_of_memory_reason, peak_memory, sample_peak, shard_model
from trainkit.runtime.device import uncompile_blocks, watch_peak
from trainkit.runtime.kernels import IGNORE_INDEX, chunked_lm_loss, document_attention, evaluate_loss, full_lm_loss
from trainkit.runtime.launch import Dist, check_ranks_agree, checked_on_every_rank, decided_on_rank0
from trainkit.runtime.launch import exit_code_on_every_rank, is_lost_rank, lost_rank_error, process_group
from trainkit.runtime.optimizers import MuonWithAdamW
from trainkit.runtime.recovery import StopSignal, UpdateGuard, choose_micro_batch, guarded_update, redo_smaller
from trainkit.runtime.recovery import save_first_on_failure, size_after_failure, stopped_line
from trainkit.runtime.throughput import Throughput, elapsed_and_eta, flops_per_token, mfu_peak, step_line


# -----------------------------------------------------------------------------
# model


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x, attn_mask=None, kv_cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        is_causal = attn_mask is None
        if kv_cache is not None:  # decoding: attend to the cached tokens too
            past = kv_cache.length
            k, v = kv_cache.append(k, v)
            if past and T > 1:  # new tokens see every cached token and the new ones before them
                attn_mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
            is_causal = past == 0 and T > 1
        # causal: flash attention on CUDA; a mask where sequences are packed (scoring, --doc-mask: trainkit/runtime/kernels.py)
        if isinstance(attn_mask, BlockMask):
            y = flex_attention(q, k, v, block_mask=attn_mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, attn_mask=None, kv_cache=None):
        x = x + self.attn(self.ln_1(x), attn_mask, kv_cache)
        return x + self.mlp(self.ln_2(x))


def param_count(cfg: GPTConfig) -> int:
    """The parameters of GPT(cfg) without building it: the tied embedding once, per block 12C^2 + 13C, ln_f."""
    C = cfg.n_embd
    return (cfg.vocab_size + cfg.block_size) * C + cfg.n_layer * (12 * C * C + 13 * C) + 2 * C


class GPT(nn.Module):
    lm_loss = staticmethod(chunked_lm_loss)  # eager even in compile_model's GPT: traced, its chunk loop unrolls
    full_loss = staticmethod(full_lm_loss)  # compiled in compile_model's GPT (the softmax fused into the logits)

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        self.activation_checkpointing = False  # a runtime choice, not part of the config (checkpoints)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if module in {m for block in self.transformer.h for m in (block.attn.c_proj, block.mlp.c_proj)}:
                # each block adds two residual contributions: keep the stream's variance flat
                std *= (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, reduction="mean", loss_chunk=0, doc_mask=False):
        """(logits over the real vocabulary, cross-entropy over targets != -1: mean, "sum" or "none" per target);
        loss_chunk > 0: the loss in chunks of that many rows, no logits. doc_mask: --doc-mask."""
        x = self.hidden_states(idx, *(document_attention(idx) if doc_mask else ()))
        n_real = real_vocab_size(self.config.vocab_size)  # the padded ids' logits are computed, never softmaxed
        if targets is None:
            return self.lm_head(x)[..., :n_real], None
        targets = targets.reshape(-1)
        if loss_chunk:
            scale = dict(sum=1.0, none=None)[reduction] if reduction != "mean" else 1 / (targets != IGNORE_INDEX).sum()
            h = x.view(-1, x.size(-1))  # every matmul on the padded rows, their faster shape
            return None, self.lm_loss(h, self.lm_head.weight, targets, scale, loss_chunk, n_real)
        return self.full_loss(x, self.lm_head.weight, targets, reduction, n_real)

    def hidden_states(self, idx, positions=None, attn_mask=None, kv_cache=None):
        """The final LayerNorm's output (B, T, n_embd): causal rows by default; packed scoring passes positions and
        attn_mask (docs/hellaswag.md), decoding a kv_cache (trainkit/evaluation/sampling.py) that idx continues."""
        B, T = idx.size()
        if positions is None:
            start = kv_cache[0].length if kv_cache else 0
            if start + T > self.config.block_size:
                raise ValueError(f"sequence of length {start + T} is longer than block_size {self.config.block_size}")
            positions = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for block, layer_cache in zip(self.transformer.h, kv_cache or [None] * len(self.transformer.h)):
            if self.activation_checkpointing and torch.is_grad_enabled():
                # keep only the block's input; backward recomputes its inside (same numbers, less memory)
                x = torch.utils.checkpoint.checkpoint(block, x, attn_mask, use_reentrant=False)
            else:
                x = block(x, attn_mask, layer_cache)
        return self.transformer.ln_f(x)

    def num_params(self, without_positions=True):
        """Parameters, the tied token embedding / lm_head once. By default without the position
        table: what the matmuls use, the P of 6·P FLOPs per token (lm_head is a matmul, a lookup is not)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if without_positions else n

    def param_summary(self) -> str:
        """Parameter counts that add up to the total (the token embedding is also lm_head)."""
        total = self.num_params(without_positions=False)
        tokens, positions = self.transformer.wte.weight.numel(), self.transformer.wpe.weight.numel()
        return (
            f"{total / 1e6:.2f}M params ({tokens / 1e6:.2f}M token embedding = lm_head, "
            f"{positions / 1e6:.2f}M positions, {(total - tokens - positions) / 1e6:.2f}M blocks + ln_f)"
        )

    @classmethod
    def from_checkpoint(cls, path: str, device="cpu") -> GPT:
        """The GPT stored in one of our checkpoints (a file, or a run's folder for its newest), in eval mode."""
        ckpt = load_checkpoint(path, model_fields=MODEL_FIELDS)
        model = cls(GPTConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
        return model.to(device).eval()

    @classmethod
    def from_hf(cls, name_or_dir: str, vocab_size=None, block_size=None, **options) -> GPT:
        """The GPT holding a Hugging Face GPT-2's weights (trainkit/hf/weights.py's gpt2_state_from_hf), fp32 on the CPU."""
        config, state = gpt2_state_from_hf(name_or_dir, vocab_size, block_size, **options)
        model = cls(GPTConfig(**config))
        model.load_state_dict(state)
        return model.eval()


# -----------------------------------------------------------------------------
# data


def aligned_rows(tokens: np.ndarray, T: int, chunk: int = 1 << 24) -> np.ndarray:
    """--align-docs' rows of one shard, int64 (n_rows, 2) of (start, n_targets): whole documents per row, each
    row ending on the <|endoftext|> that opens the next (every token a target once; README)."""
    n = len(tokens)
    starts = [np.flatnonzero(tokens[i : i + chunk] == EOT) + i for i in range(0, n, chunk)]
    bounds = np.concatenate([[0], *starts, [n - 1]]).astype(np.int64)  # shard edges count as boundaries
    rows, start = [], 0
    while start < n - 1:
        j = np.searchsorted(bounds, start + T, side="right") - 1  # last boundary within reach
        end = int(bounds[j]) if bounds[j] > start else start + T
        rows.append((start, end - start))
        start = end
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


class TokenRows:
    """A split's shards as a pure map of global row g -> tokens: epoch g // rows_per_epoch, its shards and their
    rows in order (or seeded permutations); plain rows are T+1 tokens from multiples of T."""

    def __init__(self, data_dir, split, T, align_docs=False, shuffle=False, seed=0, vocab_size=None, progress=False):
        self.T, self.align_docs, self.shuffle, self.seed, self.vocab_size = T, align_docs, shuffle, seed, vocab_size
        split_files = open_split(data_dir, split, T, align_docs, aligned_rows, vocab_size, progress)
        self.paths, self.shards, self.tables, counts = split_files
        self.shard_rows = np.array(counts, dtype=np.int64)
        self.rows_per_epoch = int(self.shard_rows.sum())
        self._epoch_cache = {}

    def _epoch_layout(self, epoch):
        """Shard order, cumulative row offsets and (filled lazily) row permutations of one epoch."""
        if epoch not in self._epoch_cache:
            order = np.arange(len(self.shards))
            if self.shuffle:
                order = np.random.default_rng((self.seed, epoch)).permutation(len(self.shards))
            self._epoch_cache = {epoch: (order, np.cumsum(self.shard_rows[order]), {})}  # keep one epoch
        return self._epoch_cache[epoch]

    def locate(self, g):
        """Global row -> (shard index, row index within that shard)."""
        epoch, r = divmod(int(g), self.rows_per_epoch)
        order, ends, perms = self._epoch_layout(epoch)
        pos = int(np.searchsorted(ends, r, side="right"))
        shard = int(order[pos])
        row = r - (int(ends[pos - 1]) if pos else 0)
        if self.shuffle:
            if shard not in perms:
                perms[shard] = np.random.default_rng((self.seed, epoch, shard)).permutation(int(self.shard_rows[shard]))
            row = int(perms[shard][row])
        return shard, row

    def row_span(self, g):
        shard, row = self.locate(g)
        if self.align_docs:
            start, n = self.tables[shard][row]
            return shard, int(start), int(n)
        return shard, row * self.T, self.T

    def count_targets(self, g0, n_rows):
        """Number of non-ignored targets in rows [g0, g0 + n_rows): known without reading tokens."""
        if not self.align_docs:
            return n_rows * self.T
        return sum(self.row_span(g)[2] for g in range(g0, g0 + n_rows))

    def batch(self, g0, B):
        """Rows [g0, g0 + B) as int64 arrays x, y of shape (B, T); padding targets are -1."""
        x = np.full((B, self.T), EOT, dtype=np.int64)
        y = np.full((B, self.T), IGNORE_INDEX, dtype=np.int64)
        for b in range(B):
            shard, start, n = self.row_span(g0 + b)
            buf = self.shards[shard][start : start + n + 1]
            x[b, :n] = buf[:-1]
            y[b, :n] = buf[1:]
        if self.vocab_size is not None:  # (a shard changed since start-up, where check_token_ids read its max_id)
            row_max = np.maximum(x.max(axis=1), y.max(axis=1))
            if row_max.max() >= real_vocab_size(self.vocab_size):  # name the shard of the offending row, not of row g0
                b = int(row_max.argmax())
                shard, _, _ = self.row_span(g0 + b)
                raise cli.RankLocalError(no_output_for(self.paths[shard], int(row_max[b]), self.vocab_size))
        return x, y


class StepLoader:
    """Micro-step m of rank r in step s reads rows s*R + (m*W + r)*B + [0, B): any split B x accumulation x W
    of the step's R rows reads the same rows, so the loss curve does not depend on the GPU count."""

    def __init__(self, rows: TokenRows, B, grad_accum_steps, rank, world_size):
        self.rows, self.B, self.accum, self.rank, self.W = rows, B, grad_accum_steps, rank, world_size
        self.rows_per_step = B * grad_accum_steps * world_size

    def step_tokens(self, step):
        """N: non-ignored target tokens of the whole step on all ranks."""
        return self.rows.count_targets(step * self.rows_per_step, self.rows_per_step)

    def micro_batch(self, step, micro_step):
        g0 = step * self.rows_per_step + (micro_step * self.W + self.rank) * self.B
        return self.rows.batch(g0, self.B)


class Prefetcher:
    """Loads step s+1's micro-batches and N on a thread while step s computes (pinned on CUDA: async copies)."""

    def __init__(self, loader: StepLoader, pin_memory: bool):
        self.loader, self.pin_memory = loader, pin_memory
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.pending = {}

    def _load(self, step):
        batches = []
        for m in range(self.loader.accum):
            x, y = (torch.from_numpy(a) for a in self.loader.micro_batch(step, m))
            batches.append((x.pin_memory(), y.pin_memory()) if self.pin_memory else (x, y))
        return batches, self.loader.step_tokens(step)

    def get(self, step):
        """(micro_batches, n_tokens) of step; starts loading step + 1."""
        future = self.pending.pop(step, None) or self.pool.submit(self._load, step)
        self.pending = {step + 1: self.pool.submit(self._load, step + 1)}
        return future.result()

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)


# -----------------------------------------------------------------------------
# optimizer & schedule


def get_lr(step: int, run: RunConfig) -> float:
    """Linear warmup to max_lr, then run.lr_schedule's decay (cosine, linear, or wsd: constant, then linear over
    the last cooldown_frac) to min_lr at max_steps, held after (docs/schedules.md)."""
    min_lr = run.max_lr * 0.1 if run.min_lr is None else run.min_lr
    if step < run.warmup_steps:  # from max_lr / warmup_steps up to max_lr
        return run.max_lr * (step + 1) / run.warmup_steps
    if step >= run.max_steps:
        return min_lr
    decay_start = run.cooldown_start if run.lr_schedule == "wsd" else run.warmup_steps
    if step < decay_start:  # wsd's stable phase
        return run.max_lr
    progress = (step - decay_start) / max(1, run.max_steps - decay_start)
    if run.lr_schedule == "cosine":
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (run.max_lr - min_lr)
    return run.max_lr - progress * (run.max_lr - min_lr)


def set_lr(optimizer, lr: float):
    """The LR of this step on every parameter group (a MuonWithAdamW scales Muon's by its ratio)."""
    if isinstance(optimizer, MuonWithAdamW):
        return optimizer.set_lr(lr)
    for group in optimizer.param_groups:
        group["lr"] = lr


def build_optimizer(model, weight_decay: float, learning_rate: float, device_type, muon_lr=None, muon_momentum=0.95):
    """AdamW decaying matrices and embeddings (dim >= 2), not biases and LayerNorms. With muon_lr, Muon takes
    the blocks' matrices (as modded-nanogpt and nanochat split them) and AdamW the rest."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied weight appears once
    matrices = {p for p in model.transformer.h.parameters() if p.dim() == 2} if muon_lr else set()
    groups = [
        dict(params=[p for p in params if p.dim() >= 2 and p not in matrices], weight_decay=weight_decay),
        dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0),
    ]
    # the fused kernel does the whole update in one launch (CUDA, CPU and MPS have one)
    fused = device_type in ("cuda", "cpu", "mps")
    adamw = torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    if not muon_lr:
        return adamw
    return MuonWithAdamW(adamw, [p for p in params if p in matrices], muon_lr, muon_momentum, learning_rate)


# -----------------------------------------------------------------------------
# accumulation & the step
#
# Why the loss is scaled by W / N, and nothing else. One optimizer step's gradient must be the gradient of the mean
# loss over all N non-ignored target tokens of the step: its R rows, split into micro-batches of B rows, accumulation
# steps and W ranks. Averaging each micro-batch's mean loss (loss / grad_accum_steps, as build-nanogpt does) is exact
# only when every micro-batch holds as many targets as every other; with --align-docs padding they do not, and the
# micro-batch with fewer targets would weigh as much as a full one. So each micro-batch backpropagates its *summed*
# token loss times W / N: backward adds the micro-steps' gradients in .grad, DDP (and FSDP's reduce-scatter) divides
# the ranks' sum by W, and what is left is d(sum of all token losses) / N, exactly. N is known before the first
# backward (the loader counts targets from its row table), so no pass over the gradients is ever needed after
# backward. With one micro-batch on one rank, W / N times a sum is the plain mean: the model returns its mean loss and
# no scaling op is added at all.


def gradient_sync(model: nn.Module, enabled: bool):
    """A context where backward does (enabled) or does not reduce gradients across ranks (DDP: forward too)."""
    if enabled:
        return contextlib.nullcontext()
    if is_fsdp(model):
        return fsdp_no_sync(model)
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


def accumulate_gradients(
    model, micro_batches, n_tokens: int, world_size: int, device, dtype, loss_chunk=0, scaler=None, doc_mask=False
) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches ((x, y) arrays or tensors), each term sum(token losses)
    * W / N (times an fp16 GradScaler's scale); returns this rank's summed token loss (float64)."""
    micro_batches = list(micro_batches)
    device_type = torch.device(device).type
    single = len(micro_batches) == 1 and world_size == 1
    loss_scale = world_size / n_tokens
    loss_total = torch.zeros((), dtype=torch.float64, device=device)
    for i, (x, y) in enumerate(micro_batches):
        x = torch.as_tensor(x).to(device, non_blocking=True)
        y = torch.as_tensor(y).to(device, non_blocking=True)
        with gradient_sync(model, enabled=i == len(micro_batches) - 1):
            with torch.autocast(device_type, dtype, enabled=dtype != torch.float32):
                _, loss = model(x, y, reduction="mean" if single else "sum", loss_chunk=loss_chunk, doc_mask=doc_mask)
            term = loss if single else loss * loss_scale
            (scaler.scale(term) if scaler else term).backward()
        loss_total += loss.detach() * n_tokens if single else loss.detach()
    return loss_total


def clip_gradients(model: nn.Module, grad_clip: float, optimizer, scaler=None) -> torch.Tensor:
    """The gradients' 2-norm before clipping (a device tensor: no host sync), clipped in place to grad_clip (0:
    not); unscaled first under fp16, the whole norm under FSDP (full_tensor of the shards')."""
    if scaler:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    if grad_clip:
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, grad_norm)
    return grad_norm


# -----------------------------------------------------------------------------
# the launch: resolved once (a LaunchPlan), before the Trainer exists


def resolve_launch(run: RunConfig, dist_state: Dist, run_folder: OutDirLock, evaluated=None):
    """The model's shape: the preset (default gpt2) and the --n-* flags, or --init-from's weights (which only
    --block-size and --vocab-size may shrink or pad); then the rest of the LaunchPlan (trainkit/components.py)."""
    fields = dict(block_size=None) if run.init_from else dict(MODEL_PRESETS[run.model or "gpt2"])
    given = {name: getattr(run, name) for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")}
    model_cfg, pretrained = GPTConfig(**fields | {k: v for k, v in given.items() if v is not None}), None
    if run.init_from:  # the weights decide the model's shape (block_size None: theirs)
        pretrained = GPT.from_hf(run.init_from, model_cfg.vocab_size, model_cfg.block_size)
        model_cfg = pretrained.config
        print0(f"--init-from {run.init_from}: {model_cfg}")
    n_params = param_count(model_cfg)
    return components.resolve_launch(run, dist_state, run_folder, model_cfg, pretrained, n_params, TokenRows, evaluated)


def build_model(run: RunConfig, plan: LaunchPlan, dist_state: Dist, pretrained: GPT | None) -> GPT:
    """The bare model (evaluation, checkpoints) on the device; under --fsdp sharded, blocks compiled if plan.compile."""
    raw_model = (pretrained or GPT(plan.model)).train()
    if run.fsdp:
        shard_model(raw_model, dist_state, getattr(torch, plan.dtype), torch.compile if plan.compile else None)
    else:
        raw_model.to(dist_state.device)
    raw_model.activation_checkpointing = run.activation_checkpointing
    return raw_model


def wrap_model(raw_model: GPT, compiled: bool, dist_state: Dist, fsdp: bool) -> nn.Module:
    """What the step runs: raw_model compiled if compiled, in DDP under torchrun; under --fsdp raw_model itself."""
    if fsdp:
        if not compiled:
            uncompile_blocks(raw_model)
        return raw_model
    model = compile_model(raw_model) if compiled else raw_model
    if dist_state.enabled:  # the gradients live in DDP's buckets: no second copy of them (6 GB at gpt2-xl)
        device_ids = [dist_state.local_rank] if dist_state.device_type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    return model


# -----------------------------------------------------------------------------
# the Trainer


@dataclass
class StepResult:
    """What one optimizer step reports (loss = all-reduced token loss / N)."""

    loss: float
    grad_norm: float
    lr: float
    n_tokens: int
    dt: float
    stop_requested: bool  # some rank got SIGTERM/SIGINT: every rank stops after this step
    skipped: str | None = None  # "nonfinite", "spike" or "overflow" (fp16): the update was not applied


class Trainer:
    """One run of a resolved LaunchPlan: __init__ builds the model, optimizer, resumed state and log; fit() loops."""

    def __init__(self, run: RunConfig, plan: LaunchPlan, inputs: LaunchInputs, dist_state: Dist):
        self.run, self.plan, self.dist_state, self.device = run, plan, dist_state, dist_state.device
        watch_peak()  # the private memory the summary reports (runtime/device.py), from here on
        self.train_rows, self.val_rows, self.shard_check = inputs.train_rows, inputs.val_rows, inputs.shard_check
        self.enc, self.token_bytes, self.run_folder = inputs.enc, inputs.token_bytes, inputs.run_folder
        # the shards read, as checkpoints record them: sampled once (the shard check stops a run whose shards change)
        self.shards_read = data_files(self.train_rows.paths, self.val_rows.paths if self.val_rows else None)
        self.dtype = getattr(torch, plan.dtype)
        # fp16's narrow range needs a dynamic loss scale; a skipped step lowers it
        self.scaler = torch.amp.GradScaler(dist_state.device_type) if self.dtype == torch.float16 else None
        fp16 = self.scaler is not None
        self.guard = UpdateGuard(run.skip_nonfinite, run.skip_spikes, fp16, lambda: self.checkpointer.last)
        torch.manual_seed(run.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
        self.raw_model = build_model(run, plan, dist_state, inputs.pretrained)
        muon = dict(muon_lr=run.muon_lr, muon_momentum=run.muon_momentum) if run.optimizer == "muon" else {}
        self.optimizer = build_optimizer(self.raw_model, run.weight_decay, run.max_lr, dist_state.device_type, **muon)
        trainer_state = self.raw_model, self.optimizer, self.guard, self.scaler, self.device
        self.resumed = None
        if inputs.checkpoint:
            self.resumed = resume_state(inputs.checkpoint, run, plan, trainer_state, self.shards_read, get_lr)
        self.compiled = plan.compile
        self.model = wrap_model(self.raw_model, self.compiled, dist_state, run.fsdp)
        self.log = RunLog(run.out_dir, enabled=False)  # rank 0 opens the real one
        decided_on_rank0(dist_state, self._open_log)
        self.stop = StopSignal(at_once=run.eval_only)
        self.compile_proven = not self.compiled  # until the first compiled forward-backward has run
        if plan.batch_size == "auto":  # the launch's last decision: the largest micro-batch that fits
            B = choose_micro_batch(
                run, plan, self.forward_backward, self.model, self.optimizer, self.val_rows, dist_state, self.log
            )
            self.plan = dataclasses.replace(plan, batch_size=B)
        self.use_micro_batch(self.plan.batch_size)
        files = self.shard_check, self.log, self.shards_read, self.train_rows.rows_per_epoch, self.run_folder
        self.checkpointer = Checkpointer(run, self.plan, dist_state, trainer_state, *files)
        tokens_per_step = plan.rows_per_rank * dist_state.world_size * plan.seq_len  # all ranks, padding included
        flops = flops_per_token(plan.model, plan.seq_len, self.raw_model.num_params())
        peak = mfu_peak(run.peak_tflops, self.device, self.dtype)
        self.speed = Throughput(tokens_per_step, flops, peak, dist_state.world_size, dist_state.device_type)

    # ---- set-up

    def use_micro_batch(self, B: int):
        """Read the steps B rows per micro-step from now on (after an out-of-memory: fewer)."""
        if hasattr(self, "prefetcher"):  # it holds micro-batches of the old size
            self.prefetcher.close()
        rank, W = self.dist_state.rank, self.dist_state.world_size
        self.loader = StepLoader(self.train_rows, B, self.plan.rows_per_rank // B, rank, W)
        self.prefetcher = Prefetcher(self.loader, pin_memory=self.dist_state.device_type == "cuda")

    def forward_backward(self, micro_batches, n_tokens: int) -> torch.Tensor:
        """This rank's summed token loss; leaves d(step token-mean loss)/d(param) in .grad. If the first
        compiled call fails to compile, one line says why and it runs again eagerly (an out-of-memory is raised)."""
        W, options = self.dist_state.world_size, (self.plan.loss_chunk, self.scaler, self.run.doc_mask)
        try:
            loss_total = accumulate_gradients(self.model, micro_batches, n_tokens, W, self.device, self.dtype, *options)
        except Exception as e:
            if self.compile_proven:
                raise
            self.fall_back_to_eager(compile_failure_cause(e))
            loss_total = accumulate_gradients(self.model, micro_batches, n_tokens, W, self.device, self.dtype, *options)
        self.compile_proven = True
        return loss_total

    def fall_back_to_eager(self, cause: BaseException):
        """After a failed compile: the model unwrapped, the partial gradients dropped."""
        print0(f"compile failed, continuing without it: {cli.reason_of(cause, typed=True)}")
        self.compiled, self.compile_proven = False, True
        self.optimizer.zero_grad(set_to_none=True)  # a backward may have run in part
        self.model = wrap_model(self.raw_model, False, self.dist_state, self.run.fsdp)

    def _open_log(self):
        """Rank 0: the run's identity, log.jsonl and trackers, in the folder still the one claimed (not --eval-only)."""
        if not self.run.eval_only:
            self.run_folder.check_claimed(None)  # (nothing of the run lands elsewhere)
            self.log = open_run_log(self.run, self.plan.model, self.resumed)

    # ---- one optimizer step

    def train_step(self, step: int) -> StepResult:
        """One optimizer step, as README's "The step, in order", with one host sync (the .tolist() after the clip;
        docs/performance.md). An out-of-memory redoes it at a smaller micro-batch (one process)."""
        t0 = time.perf_counter()
        micro_batches, n_tokens = self.prefetcher.get(step)  # 1-3. the step's rows, and N: known before any backward
        while True:  # 4. each micro-batch: backward of sum*W/N; out of memory: the same rows again, smaller
            try:
                loss_total = self.forward_backward(micro_batches, n_tokens)
                break
            except Exception as e:
                smaller = size_after_failure(e, micro_batches, self.plan.rows_per_rank, self.dist_state.world_size)
                if smaller is None:
                    raise
                reason = out_of_memory_reason(e)
            micro_batches = redo_smaller(
                step, micro_batches, smaller, reason, self.plan.rows_per_rank, self.optimizer, self.device, self.log
            )
            self.use_micro_batch(smaller)
        # 5. one all-reduce: the summed loss, the stop votes (SIGTERM/SIGINT on any rank), the shard checks' verdict.
        # torch.full fills on the device with the value as a kernel argument: unlike torch.tensor(value,
        # device=...), no copy from pageable host memory, which would block until the backward ends
        this_rank = self.stop.requested, self.shard_check.failed()
        votes = [torch.full((1,), float(v), dtype=torch.float64, device=self.device) for v in this_rank]
        stats = torch.cat([loss_total.view(1), *votes])
        if dist.is_initialized():
            dist.all_reduce(stats)  # summed over the ranks (gloo has no average; N divides below)
        norm = clip_gradients(self.raw_model, self.run.grad_clip, self.optimizer, self.scaler)  # 6. norm and clip
        loss_sum, stop_votes, shard_faults, norm = torch.cat([stats, norm.double().view(1)]).tolist()  # (the sync)
        if shard_faults:  # a rank's copy of a shard is not the one its manifest records: every rank stops here
            checked_on_every_rank(self.dist_state, self.shard_check.result)
        lr = get_lr(step, self.run)  # 7. the LR of this step (Muon's follows it: trainkit/runtime/optimizers.py)
        set_lr(self.optimizer, lr)
        skipped = guarded_update(self.optimizer, self.guard, self.scaler, step, loss_sum / n_tokens, norm)  # 8. update
        return StepResult(loss_sum / n_tokens, norm, lr, n_tokens, time.perf_counter() - t0, stop_votes > 0, skipped)

    # ---- the loop

    def fit(self):
        """Evaluate when due, save when due, stop when last or when a stop is agreed, else one step."""
        run, step_times, stop_agreed, stopped_at = self.run, [], False, None
        self.print_header()
        t_start = time.perf_counter()
        with self.running():
            for step in range(self.plan.start_step, run.max_steps + 1):
                last_step = step == run.max_steps
                resumed_here = step == self.plan.start_step and self.plan.resume_from
                if not resumed_here:  # the resumed step was evaluated before saving
                    save_first_on_failure(self.checkpointer, step, lambda: self.evaluate(step, last_step))
                    if step > self.plan.start_step and (last_step or (run.ckpt_every and step % run.ckpt_every == 0)):
                        self.checkpointer.save(step)
                if stop_agreed:
                    if self.checkpointer.last != checkpoint_path(run.out_dir, step):
                        self.checkpointer.save(step, stopping=True)
                    stopped_at = step
                    break
                if last_step:
                    break
                result = self.train_step(step)
                stop_agreed = result.stop_requested
                step_times.append(result.dt)
                elapsed = time.perf_counter() - t_start
                self.log_step(step, result, elapsed_and_eta(elapsed, step_times, run.max_steps - step - 1))
        print0(self.speed.summary(step_times, time.perf_counter() - t_start, peak_memory(self.device)))
        if stopped_at is not None:  # the last line, what a Ctrl-C leaves on the screen: the work is safe
            print0(stopped_line(checkpoint_path(run.out_dir, stopped_at), stopped_at))

    def evaluate(self, step: int, last_step: bool) -> dict:
        """Validation loss, HellaSwag and samples, each on its schedule and at the last step; returns what it logged."""
        run, dist_state = self.run, self.dist_state
        results = {}

        def due(every):
            return every and (step % every == 0 or last_step)

        if self.val_rows and due(run.val_every):
            options = self.dtype, self.token_bytes, self.plan.loss_chunk, run.doc_mask
            results = evaluate_loss(self.raw_model, self.val_rows, self.loader.B, run.val_steps, dist_state, *options)
            print0(f"step {step:5d} | " + " | ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in results.items()))
            self.log.write(step=step, **results)
        if due(run.hellaswag_every):
            data = dict(data_file=self.plan.hellaswag_file, limit=run.hellaswag_limit or None, flag="--hellaswag-file")
            ranks = dict(rank=dist_state.rank, world_size=dist_state.world_size)
            result = hellaswag_eval.evaluate(self.raw_model, self.device, dtype=self.dtype, **data, **ranks)
            print0(f"step {step:5d} | hellaswag acc_norm {result['acc_norm']:.4f} ({result['n']} examples)")
            results.update(hellaswag_acc=result["acc_norm"], hellaswag_n=result["n"])
            self.log.write(step=step, hellaswag_acc=result["acc_norm"], hellaswag_n=result["n"])
        # a sharded model needs every rank in its forward; only rank 0 prints
        if self.enc and (dist_state.is_main or run.fsdp) and step > 0 and due(run.sample_every):
            prompt = train_flags.SAMPLE_PROMPT if run.sample_prompt is None else run.sample_prompt
            for text in sample_text(self.raw_model, self.enc, self.device, prompt, stop_early=not run.fsdp):
                print0(f"sample: {text}", keep_newlines=True)  # its control characters escaped
        return results

    def evaluate_only(self):
        """--eval-only: training's evaluations at the loaded step, printed, then one JSON line; writes nothing."""
        with self.running():
            results = self.evaluate(self.plan.start_step, last_step=True)
            checked_on_every_rank(self.dist_state, self.shard_check.result)
        print_result(json.dumps(dict(step=self.plan.start_step, **results)))

    @contextlib.contextmanager
    def running(self):
        """Around the loop or an evaluation: a collective failed by a dead rank becomes one line (and no save);
        the shard check and prefetch threads, the signal handlers and the log are released however it ends."""
        self.shard_check.start()  # started here, so that every way out of the run passes its close() below
        try:
            yield
        except Exception as e:
            if self.dist_state.enabled and is_lost_rank(e):
                self.stop.ignore_sigterm_from_now()
                raise lost_rank_error(e, self.dist_state.rank, self.checkpointer.last) from None
            raise
        finally:  # the run's threads end here, before the process group is destroyed
            self.shard_check.close()
            self.prefetcher.close()
            self.stop.restore()
            self.log.close()

    # ---- what a step prints

    def print_header(self):
        run, dist_state, plan = self.run, self.dist_state, self.plan
        print0(
            f"model: {self.raw_model.param_summary()} | device {self.device} | dtype {plan.dtype} | compile "
            f"{self.compiled} | world {dist_state.world_size}"
            + (" | fsdp (sharded parameters, gradients, AdamW state)" if run.fsdp else "")
        )
        print0(
            f"batch: {run.total_batch_size} tokens/step = {self.loader.B} rows x {plan.seq_len} tokens x "
            f"{self.loader.accum} accumulation steps x {dist_state.world_size} ranks | "
            f"{self.train_rows.rows_per_epoch} train rows per epoch"
        )

    def log_step(self, step: int, r: StepResult, progress: str):
        sample_peak()  # (where no thread samples the private memory: under an address-space limit)
        world, device_type = self.dist_state.world_size, self.dist_state.device_type
        line, record = step_line(step, self.run.max_steps, r, self.speed.of(r.dt), world, device_type, progress)
        print0(line)
        self.log.write(**record)


# -----------------------------------------------------------------------------
# main


def train(run: RunConfig, dist_state: Dist, evaluated=None):
    """Resolve the plan, build the Trainer, train or evaluate (evaluated: as resolve_launch's)."""
    run_folder = OutDirLock(run.out_dir)  # rank 0 takes it in resolve_launch(), once the input checks out
    plan = trainer = None
    try:
        check_ranks_agree(run)
        plan, inputs = resolve_launch(run, dist_state, run_folder, evaluated)
        if plan.resume_from and plan.start_step == run.max_steps and not run.eval_only:  # a requeued finished job
            print0(
                f"{plan.resume_from} is already at --max-steps {run.max_steps}: nothing to train (raise --max-steps to go on)"
            )
            return
        trainer = Trainer(run, plan, inputs, dist_state)
        del inputs  # (the checkpoint's tensors: now in the model and optimizer)
        if run.eval_only:
            trainer.evaluate_only()
            return
        if 0 < run.max_steps < run.warmup_steps:  # (once the input has checked out)
            cli.print_warning(
                f"--warmup-steps {run.warmup_steps} is longer than --max-steps {run.max_steps}: the "
                f"learning rate only rises, to {get_lr(run.max_steps - 1, run):.3g} at the last step, "
                f"and never reaches --max-lr {run.max_lr}"
            )
        trainer.fit()
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        last_ckpt = None if run.eval_only else latest_checkpoint(run.out_dir)
        asked = plan.batch_size if plan else run.batch_size  # (auto's choice: trainer.loader.B)
        raise out_of_memory_error(e, dist_state.device, last_ckpt, asked, trainer and trainer.loader.B) from None
    finally:
        run_folder.release()


def main(argv=None) -> int:
    parser = build_parser()
    run = RunConfig(**vars(parser.parse_args(argv)))

    def setup_and_train():
        train_flags.check_flags(run)
        with process_group(run.device, run.dist_timeout, lambda: latest_checkpoint(run.out_dir)) as dist_state:
            if run.eval_only and run.resume is not None:  # the checkpoint's own flags, where this command is silent
                path = eval_checkpoint(run)
                checkpoint = load_checkpoint(path, model_fields=MODEL_FIELDS, resume=True)
                given = train_flags.given_flags(parser, argv, RunConfig)
                train(train_flags.as_trained(run, checkpoint["run_config"], given), dist_state, (path, checkpoint))
            else:
                train(run, dist_state)

    return exit_code_on_every_rank(setup_and_train, run.debug)


if __name__ == "__main__":
    sys.exit(main())
