"""GPT-2 pretraining in one file.

    python train_gpt2.py --data-dir edu_fineweb10B                    # one GPU or CPU
    torchrun --nproc_per_node=8 train_gpt2.py --data-dir edu_fineweb10B

The heart is token-normalized gradient accumulation: the gradient of one optimizer step
equals the gradient of the mean loss over every non-ignored target token of the step, on
every rank, whatever the split into micro-batch size x accumulation steps x world size.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import hashlib
import itertools
import json
import math
import os
import re
import signal
import shutil
import socket
import sys
import time
from dataclasses import dataclass

import cli  # the error contract shared by every script; standard library only, so it comes first
from cli import UserError, exit_code_of

if __name__ == "__main__":
    cli.exit_on_ctrl_c_while_starting()

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from fineweb import BIN_HEADER_INTS, BIN_MAGIC, BIN_VERSION, EOT, get_encoding  # shard format, tokenizer
from fineweb import one_line, os_error_reason

if __name__ == "__main__":
    # Run as a script, this file is the module `__main__`. hellaswag.py and hf_interop.py then
    # `import train_gpt2`, which would execute it a second time as another module with its own
    # GPT, ... classes: isinstance(model, GPT) would be False. Registering this module under its
    # import name makes every `import train_gpt2` return it: one class object per name.
    sys.modules.setdefault("train_gpt2", sys.modules[__name__])

IGNORE_INDEX = -1  # targets with this value carry no loss
GPT2_VOCAB = EOT + 1  # tokens of GPT-2's BPE: <|endoftext|> is the last
# rows per chunk of the chunked loss on CPU: 26 MB of fp32 logits, which malloc reuses; from
# 32 MB glibc maps every allocation afresh (256 rows: 16x the page faults, ~12% slower)
CPU_LOSS_CHUNK = 128


# -----------------------------------------------------------------------------
# config


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest sequence the position table covers
    vocab_size: int = 50304  # GPT-2's 50257 tokens padded to a multiple of 64 (faster matmuls)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


MODEL_PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    "cpu": dict(n_layer=4, n_head=4, n_embd=128, block_size=256),  # trains on a laptop CPU
}


@dataclass
class RunConfig:
    # initialization: None (random GPT-2 init) or a Hugging Face GPT-2 name or directory
    init_from: str | None = None
    # data and output
    data_dir: str = "edu_fineweb10B"
    out_dir: str = "out"
    align_docs: bool = False
    shuffle: bool = False
    # batch: batch_size rows of seq_len tokens per rank per micro-step
    batch_size: int = 64
    seq_len: int | None = None  # None: the model's block size, at most 1024
    total_batch_size: int = 524288  # tokens per optimizer step over all ranks (2**19)
    # optimization
    max_steps: int = 19073  # 10B tokens / 2**19 tokens per step
    warmup_steps: int = 715
    max_lr: float = 6e-4
    min_lr: float | None = None  # None: 10% of max_lr
    lr_schedule: str = "cosine"  # after warmup: cosine, linear, or wsd (warmup-stable-decay)
    cooldown_frac: float = 0.2  # wsd: the last 20% of max_steps decay linearly to min_lr
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)
    # evaluation, sampling and checkpoints (0 disables each)
    val_every: int = 250
    val_steps: int = 20
    sample_every: int = 250
    hellaswag_every: int = 250
    hellaswag_limit: int = 0  # 0: all 10042 examples
    hellaswag_file: str | None = None
    ckpt_every: int = 5000
    keep_last: int = 0  # 0 keeps every checkpoint
    resume: str | None = None  # "latest" or a checkpoint path
    # run tracking, on rank 0: every log.jsonl record also goes to W&B / TensorBoard
    wandb: str | None = None  # W&B project name
    tensorboard: bool = False  # event files in out_dir
    eval_only: bool = False  # evaluate the resumed (or --init-from) weights once, train nothing, write nothing
    # failures
    skip_nonfinite: int = 0
    skip_spikes: float = 0.0
    dist_timeout: float = 600.0
    # FSDP2: each rank holds 1/W of the parameters, gradients and AdamW state (torchrun only)
    fsdp: bool = False
    # runtime
    device: str = "auto"
    dtype: str = "auto"
    compile: bool | None = None  # None: on for CUDA (where Triton can run), off elsewhere
    activation_checkpointing: bool = False  # recompute each block in backward: less memory, ~1/3 more compute
    loss_chunk: int | None = None  # rows per lm_head + loss chunk; 0: full logits; None: CPU_LOSS_CHUNK on CPU, 0 on CUDA
    seed: int = 1337
    peak_tflops: float | None = None  # dense peak of one device for MFU; None: looked up by GPU name
    debug: bool = False


MAX_INT_FLAG = 2**62  # integer flags: step and row arithmetic stays inside int64
MIN_DIST_TIMEOUT = 30.0  # seconds


def validate_flag_values(run: RunConfig, model: GPTConfig):
    """Checks of single flags that must pass before anything uses them (--dist-timeout is used
    when joining the process group, before validate_config can run)."""
    for name, value in [*dataclasses.asdict(run).items(), *dataclasses.asdict(model).items()]:
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, float) and not math.isfinite(value):  # argparse's float() takes nan and inf
            raise UserError(f"{flag} must be a finite number, got {value}")
        if type(value) is int and name != "seed" and abs(value) > MAX_INT_FLAG:  # torch and numpy take int64
            raise UserError(f"{flag} {value} is out of range: at most 2**62 = {MAX_INT_FLAG}")
    if not MIN_DIST_TIMEOUT <= run.dist_timeout <= 1e9:  # a timedelta overflows far above that
        raise UserError(f"--dist-timeout must be in [{MIN_DIST_TIMEOUT}, 1e9] seconds, got {run.dist_timeout}: "
                        "healthy ranks wait this long for each other (rank 0 writing a checkpoint or samples, "
                        "the first step compiling), and a shorter wait reports them as dead")
    if not 0 <= run.seed < 2**64:  # numpy's generators (--shuffle) refuse negative seeds, torch larger ones
        raise UserError(f"--seed must be in 0..2**64-1, got {run.seed}")
    if run.resume is not None and not run.resume.strip():  # e.g. --resume "$CKPT" with CKPT unset
        raise UserError(f"--resume got an empty path ({run.resume!r}; an unset variable in the job script?): "
                        "pass --resume alone to continue from the newest checkpoint in --out-dir, or --resume PATH")


def validate_config(run: RunConfig, model: GPTConfig, world_size: int) -> int:
    """Check the run as a whole, before any work. Returns grad_accum_steps."""
    positive = dict(batch_size=run.batch_size, seq_len=run.seq_len,
                    total_batch_size=run.total_batch_size, n_layer=model.n_layer,
                    n_head=model.n_head, n_embd=model.n_embd, block_size=model.block_size,
                    vocab_size=model.vocab_size)
    for name, value in positive.items():
        if value <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("max_steps", "warmup_steps", "val_every", "val_steps", "sample_every",
                 "hellaswag_every", "hellaswag_limit", "ckpt_every", "keep_last", "skip_nonfinite"):
        if getattr(run, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(run, name)}")
    if run.loss_chunk is not None and run.loss_chunk < 0:
        raise UserError(f"--loss-chunk must be >= 0, got {run.loss_chunk}")
    if model.n_embd % model.n_head:
        raise UserError(f"--n-embd {model.n_embd} is not divisible by --n-head {model.n_head}")
    if run.seq_len > model.block_size:
        raise UserError(f"--seq-len {run.seq_len} is longer than the model's --block-size {model.block_size}")
    micro_tokens = run.batch_size * run.seq_len * world_size
    if run.total_batch_size % micro_tokens:
        raise UserError(
            f"--total-batch-size {run.total_batch_size} is not divisible by batch_size x seq_len x "
            f"world_size = {run.batch_size} x {run.seq_len} x {world_size} = {micro_tokens}")
    if run.max_lr <= 0 or (run.min_lr is not None and not 0 <= run.min_lr <= run.max_lr):
        raise UserError(f"need 0 < --max-lr and 0 <= --min-lr <= --max-lr (got {run.max_lr}, {run.min_lr})")
    if run.peak_tflops is not None and run.peak_tflops <= 0:
        raise UserError(f"--peak-tflops must be positive, got {run.peak_tflops}")
    if run.lr_schedule not in LR_SCHEDULES:
        raise UserError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {run.lr_schedule!r}")
    if not 0 <= run.cooldown_frac <= 1:
        raise UserError(f"--cooldown-frac must be in [0, 1], got {run.cooldown_frac}")
    if run.lr_schedule == "wsd" and run.warmup_steps > cooldown_start(run):
        raise UserError(f"--warmup-steps {run.warmup_steps} runs into the cooldown, which starts at step "
                        f"{cooldown_start(run)} (--max-steps x (1 - --cooldown-frac)): lower one of them")
    if run.eval_only and run.resume is None and run.init_from is None:
        raise UserError("--eval-only needs weights to evaluate: --resume [PATH] or --init-from NAME_OR_DIR")
    if run.eval_only and (run.wandb or run.tensorboard):
        raise UserError("--eval-only writes nothing, so it does not log to --wandb or --tensorboard either")
    if run.eval_only and not (run.val_every or run.hellaswag_every or run.sample_every):
        raise UserError("--eval-only with --val-every 0, --hellaswag-every 0 and --sample-every 0 has nothing to do")
    if run.grad_clip < 0 or run.weight_decay < 0 or run.skip_spikes < 0:
        raise UserError("--grad-clip, --weight-decay and --skip-spikes must be >= 0")
    if run.val_every and not run.val_steps:
        raise UserError("--val-steps 0 with --val-every > 0 evaluates nothing: pass --val-steps N or --val-every 0")
    text_flags = [flag for flag, on in (("--sample-every 0", run.sample_every),
                                        ("--hellaswag-every 0", run.hellaswag_every)) if on]
    if model.vocab_size < GPT2_VOCAB and text_flags:
        raise UserError(f"--vocab-size {model.vocab_size} is smaller than GPT-2's {GPT2_VOCAB} tokens, which "
                        f"sampling and HellaSwag feed the model: pass {' '.join(text_flags)}")
    if run.fsdp and world_size < 2:
        raise UserError("--fsdp shards the model over the processes of a torchrun launch and needs at "
                        "least 2; with one process drop --fsdp (it would hold the whole model anyway)")
    return run.total_batch_size // micro_tokens


# -----------------------------------------------------------------------------
# model


class LayerKVCache:
    """One attention layer's keys and values (B, n_head, length, head_size) of the tokens seen so
    far, so that decoding feeds each new token once instead of the whole sequence again."""

    def __init__(self):
        self.k = self.v = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.size(2)

    def append(self, k, v):
        """Add the new tokens' keys and values; returns all of them."""
        if self.k is not None:
            k, v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)
        self.k, self.v = k, v
        return k, v


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x, attn_mask=None, kv_cache: LayerKVCache | None = None):
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
        # causal: flash attention on CUDA; an explicit mask only where sequences are packed (scoring)
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

    def forward(self, x, attn_mask=None, kv_cache: LayerKVCache | None = None):
        x = x + self.attn(self.ln_1(x), attn_mask, kv_cache)
        return x + self.mlp(self.ln_2(x))


def exp_sums_(logits):
    """The parts of a log-softmax over the last dim of 2-D logits in one exp pass, in place:
    row maxes m, exps = exp(logits - m) written over the logits, and their row sums s.
    logsumexp = m + log(s) and softmax = exps / s, with no new (rows, vocab) buffer."""
    maxes = logits.amax(dim=-1, keepdim=True)
    exps = logits.sub_(maxes).exp_()
    return maxes.squeeze(1), exps, exps.sum(dim=-1)


def chunked_loss_and_grads(h, weight, targets, scale, chunk_rows, want_grad):
    """sum(token losses) * scale of lm_head + cross-entropy over rows, chunk_rows rows at a time,
    and, if want_grad, its gradients w.r.t. h and weight (else None, None)."""
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if want_grad else None
    grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_grad else None
    for start in range(0, h.size(0), chunk_rows):
        hc, tc = h[start:start + chunk_rows], targets[start:start + chunk_rows]
        logits = (hc @ weight.t()).float()
        weights = (tc != IGNORE_INDEX).float() * scale  # per-row loss weight, 0 for ignored
        safe_t = tc.clamp(min=0).unsqueeze(1)
        target_logit = logits.gather(1, safe_t).squeeze(1)
        maxes, exps, sums = exp_sums_(logits)
        lse = maxes + sums.log()
        loss += ((lse - target_logit) * weights).sum()
        if want_grad:  # d loss / d logits = weight * (softmax - one-hot)
            dlogits = exps.mul_((weights / sums).unsqueeze(1))
            dlogits.scatter_add_(1, safe_t, -weights.unsqueeze(1))
            grad_h[start:start + chunk_rows] = dlogits @ weight  # autocast picks the matmul dtype
            grad_w.addmm_(dlogits.t(), hc.float())  # accumulate inside the matmul
    return loss, grad_h, grad_w


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """lm_head + cross-entropy over rows in chunks, never holding the (rows, vocab) logits.

    The forward pass also computes, chunk by chunk, the gradients of the loss w.r.t. the
    hidden states and the head weight (softmax - one-hot, as fused linear-cross-entropy
    kernels do), so backward only scales them by the incoming gradient: the logits are
    never stored nor recomputed. Returns sum(token losses) * scale over targets != -1."""

    @staticmethod
    def forward(ctx, h, weight, targets, scale, chunk_rows):
        loss, grad_h, grad_w = chunked_loss_and_grads(h, weight, targets, scale, chunk_rows, want_grad=True)
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None, None


def chunked_lm_loss(h, weight, targets, scale, chunk_rows):
    """ChunkedLinearCrossEntropy where a gradient is wanted; under no_grad (evaluation) the loss
    alone. Inside autograd.Function.forward grad mode is always off and needs_input_grad is True
    for a Parameter even under no_grad, so the choice is made here."""
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return ChunkedLinearCrossEntropy.apply(h, weight, targets, scale, chunk_rows)
    return chunked_loss_and_grads(h, weight, targets, scale, chunk_rows, want_grad=False)[0]


def param_count(cfg: GPTConfig) -> int:
    """The parameters of GPT(cfg), counted without building it: the tied token embedding once,
    positions, and per block two LayerNorms (4C), attention (4C^2 + 4C) and MLP (8C^2 + 5C); ln_f."""
    C = cfg.n_embd
    return (cfg.vocab_size + cfg.block_size) * C + cfg.n_layer * (12 * C * C + 13 * C) + 2 * C


class GPT(nn.Module):
    lm_loss = staticmethod(chunked_lm_loss)  # compile_model gives a compiled GPT an eager-only one

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        self.activation_checkpointing = False  # a runtime choice, not part of the config (checkpoints)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if module in self._residual_projections():
                # each block adds two residual contributions: keep the stream's variance flat
                std *= (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def _residual_projections(self):
        return {m for block in self.transformer.h for m in (block.attn.c_proj, block.mlp.c_proj)}

    def hidden_states(self, idx, positions=None, attn_mask=None, kv_cache: list[LayerKVCache] | None = None):
        """The final LayerNorm's output (B, T, n_embd) for token ids idx (B, T).

        By default row b is one sequence: positions 0..T-1, causal attention. Scoring packs
        several sequences that share a prefix into one row (hellaswag.py): positions (B, T)
        then gives each token's position in its own sequence and attn_mask (B, 1, T, T) bool
        which earlier tokens it may attend to (True: attend). Decoding passes kv_cache (from
        new_kv_cache()): idx then continues the tokens cached there, and is added to it."""
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

    def forward(self, idx, targets=None, reduction="mean", loss_chunk=0):
        """Logits (B, T, vocab) and, with targets, the cross-entropy over targets != -1.

        reduction="sum" returns the summed token loss, which token-normalized gradient
        accumulation scales by the step's global token count. loss_chunk > 0 computes the
        loss with ChunkedLinearCrossEntropy in chunks of that many rows and returns no logits."""
        # the class's method: under --fsdp the instance's hidden_states also runs FSDP's
        # forward hooks (for scoring), and forward has already run them
        x = GPT.hidden_states(self, idx)
        if targets is None:
            return self.lm_head(x), None
        targets = targets.reshape(-1)
        if loss_chunk:
            scale = 1.0 if reduction == "sum" else 1.0 / (targets != IGNORE_INDEX).sum()
            h = x.view(-1, x.size(-1))
            return None, self.lm_loss(h, self.lm_head.weight, targets, scale, loss_chunk)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets,
                               ignore_index=IGNORE_INDEX, reduction=reduction)
        return logits, loss

    def num_params(self, without_positions=True):
        """Parameters, the tied token embedding / lm_head once. By default without the position
        table: what the matmuls use, the P of 6·P FLOPs per token (lm_head is a matmul, a lookup is not)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if without_positions else n

    def param_summary(self) -> str:
        """Parameter counts that add up to the total (the token embedding is also lm_head)."""
        total = self.num_params(without_positions=False)
        tokens, positions = self.transformer.wte.weight.numel(), self.transformer.wpe.weight.numel()
        return (f"{total / 1e6:.2f}M params ({tokens / 1e6:.2f}M token embedding = lm_head, "
                f"{positions / 1e6:.2f}M positions, {(total - tokens - positions) / 1e6:.2f}M blocks + ln_f)")

    def configure_optimizers(self, weight_decay, learning_rate, device_type):
        """AdamW that decays matrices and embeddings (dim >= 2) but not biases and LayerNorms."""
        params = [p for p in self.parameters() if p.requires_grad]  # tied weight appears once
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [dict(params=decay, weight_decay=weight_decay),
                  dict(params=no_decay, weight_decay=0.0)]
        # the fused kernel does the whole update in one launch (CUDA, CPU and MPS have one)
        fused = device_type in ("cuda", "cpu", "mps")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=fused)

    def new_kv_cache(self) -> list[LayerKVCache]:
        return [LayerKVCache() for _ in self.transformer.h]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=50, generator=None, kv_cache=True,
                 stop_token=None):
        """Extend idx (B, T) by up to max_new_tokens tokens, each drawn from the top_k most likely
        of softmax(logits / temperature); the model sees the newest block_size tokens.

        generator: one torch.Generator for the whole batch, or a list of one per row: then each
        row's draws do not depend on the other rows, and a row gets the same tokens in a batch of
        any size. As temperature goes to 0 the draw becomes the argmax (greedy); a temperature too
        small for the logits' float type behaves as that limit (no inf or NaN). stop_token: stop
        once every row has drawn it (rows that drew it earlier go on drawing, so each row's tokens
        are those of a run without stop_token up to there; cut them there).

        With kv_cache each step feeds only the new token. Once the sequence outgrows the block
        the window slides, every position changes, and each step runs the whole window, as
        without the cache: both ways draw the same tokens for the same generator."""
        block_size = self.config.block_size
        cache = None
        # the smallest positive float32: dividing by it keeps every nonzero gap below the max
        # logit far enough down that exp() gives 0, which is what any smaller temperature does
        temperature = max(temperature, torch.finfo(torch.float32).tiny)
        stopped = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            new_tokens = idx[:, -block_size:]
            if kv_cache and cache is not None and idx.size(1) <= block_size:
                new_tokens = idx[:, cache[0].length:]
            elif kv_cache:
                cache = self.new_kv_cache()  # the first step, or the window slid
            x = self.hidden_states(new_tokens, kv_cache=cache)
            logits = self.lm_head(x[:, -1, :]).float()
            # the max first: (logits - max) / T is in [-inf, 0], so a tiny T cannot overflow to NaN
            logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
            probs = F.softmax(logits, dim=-1)
            topk_probs, topk_idx = torch.topk(probs, min(top_k, probs.size(-1)), dim=-1)
            choice = draw(topk_probs, generator)
            idx = torch.cat((idx, torch.gather(topk_idx, -1, choice)), dim=1)
            if stop_token is not None:
                stopped |= idx[:, -1] == stop_token
                if stopped.all():
                    break
        return idx


def draw(probs, generator):
    """One index per row of probs (B, K), drawn with the row's weights: from one generator for the
    batch, or from a list of one generator per row."""
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.multinomial(row[None], 1, generator=g) for row, g in zip(probs, generator)])
    return torch.multinomial(probs, 1, generator=generator)


# -----------------------------------------------------------------------------
# data


def open_shard(path: str) -> np.ndarray:
    """Memory-map a token shard: build-nanogpt's .npy (uint16) or llm.c's .bin."""
    try:
        if path.endswith(".bin"):
            header = np.fromfile(path, dtype=np.int32, count=BIN_HEADER_INTS)
            if header.size < 3 or header[0] != BIN_MAGIC:
                raise UserError(f"{path}: not an llm.c token shard (bad magic). "
                                "HINT: are you passing the right file?")
            if header[1] != BIN_VERSION:
                raise UserError(f"{path}: unsupported llm.c shard version {header[1]} (expected {BIN_VERSION})")
            n_tokens = int(header[2])
            expected = 4 * BIN_HEADER_INTS + 2 * n_tokens
            actual = os.path.getsize(path)
            if actual != expected:
                raise UserError(f"{path}: header says {n_tokens} tokens ({expected} bytes) but the file "
                                f"has {actual} bytes: truncated or corrupt, re-create it")
            return np.memmap(path, dtype=np.uint16, mode="r", offset=4 * BIN_HEADER_INTS, shape=(n_tokens,))
        with open(path, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise UserError(f"{path}: not a .npy token shard (bad magic). HINT: are you passing the right file?")
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except UserError:
        raise
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"{path}: cannot read token shard ({e}); truncated or corrupt? re-create it") from None
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
        raise UserError(f"{path}: expected a 1-D uint16 token array, got {tokens.dtype} with shape "
                        f"{tokens.shape}. HINT: are you passing the right file?")
    return tokens


def find_shards(data_dir: str, split: str) -> list[str]:
    if not os.path.isdir(data_dir):
        raise UserError(f"--data-dir {data_dir} does not exist; create shards with fineweb.py")
    folder = glob.escape(data_dir)  # a folder named like a pattern (data[1]) is still that folder
    paths = sorted(p for ext in ("npy", "bin") for p in glob.glob(os.path.join(folder, f"*_{split}_*.{ext}")))
    if not paths:
        raise UserError(f"no '{split}' shards (*_{split}_*.npy or .bin) in --data-dir {data_dir}; "
                        "create them with fineweb.py")
    return paths


def aligned_rows(tokens: np.ndarray, T: int, chunk: int = 1 << 24) -> np.ndarray:
    """Row table of one shard for --align-docs: int64 (n_rows, 2) of (start, n_targets).

    A row's inputs are tokens[start : start+n] and its targets tokens[start+1 : start+n+1].
    Rows are filled with whole documents; the last target of a row is the <|endoftext|> that
    opens the next document, which also opens the next row, so every token is a target once.
    A document longer than a row fills whole rows and its remainder starts the next one."""
    n = len(tokens)
    starts = [np.flatnonzero(tokens[i:i + chunk] == EOT) + i for i in range(0, n, chunk)]
    bounds = np.concatenate([[0], *starts, [n - 1]]).astype(np.int64)  # shard edges count as boundaries
    rows = []
    start = 0
    while start < n - 1:
        j = np.searchsorted(bounds, start + T, side="right") - 1  # last boundary within reach
        end = int(bounds[j]) if bounds[j] > start else start + T
        rows.append((start, end - start))
        start = end
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


def shard_files(paths: list[str]) -> list[tuple[str, int]]:
    """(file name, size in bytes) of each shard: what tells one set of shards from another."""
    return [(os.path.basename(p), os.path.getsize(p)) for p in paths]


def differing_file(a: list[tuple[str, int]], b: list[tuple[str, int]]) -> tuple[str, str, str] | None:
    """The first file name (in order) whose size differs between two shard_files() lists, with its
    size in each ("N bytes" or "missing"); None if they are the same."""
    a_files, b_files = dict(a), dict(b)
    name = next((n for n in sorted({*a_files, *b_files}) if a_files.get(n) != b_files.get(n)), None)
    if name is None:
        return None
    size = lambda files: f"{files[name]} bytes" if name in files else "missing"  # noqa: E731
    return name, size(a_files), size(b_files)


class TokenRows:
    """The training (or validation) stream as a sequence of rows, with a pure row -> tokens map.

    Global row g lives in epoch g // rows_per_epoch. Each epoch visits the shards in order
    (or a seeded permutation with shuffle) and each shard's rows in order (or permuted).
    Plain rows are T+1 consecutive tokens starting at multiples of T, so a shard of n tokens
    holds (n - 1) // T rows; aligned rows come from aligned_rows()."""

    def __init__(self, data_dir, split, T, align_docs=False, shuffle=False, seed=0, vocab_size=None,
                 progress=False):
        self.paths = find_shards(data_dir, split)
        self.T, self.align_docs, self.shuffle, self.seed = T, align_docs, shuffle, seed
        self.vocab_size = vocab_size
        self.shards = [open_shard(p) for p in self.paths]
        if align_docs:  # about 0.5 s per 100M-token shard
            from tqdm import tqdm
            shards = tqdm(self.shards, desc=f"{split} row tables", unit="shard", disable=not progress, delay=2)
            self.tables = [aligned_rows(s, T) for s in shards]
            counts = [len(t) for t in self.tables]
        else:
            counts = [max(0, len(s) - 1) // T for s in self.shards]
        for path, shard, count in zip(self.paths, self.shards, counts):
            if count == 0:
                raise UserError(f"{path}: {len(shard)} tokens, fewer than one row of --seq-len {T} + 1; "
                                "remove it or re-create the shards")
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
            buf = self.shards[shard][start:start + n + 1]
            x[b, :n] = buf[:-1]
            y[b, :n] = buf[1:]
        if self.vocab_size is not None:
            row_max = np.maximum(x.max(axis=1), y.max(axis=1))
            if row_max.max() >= self.vocab_size:  # name the shard of the offending row, not of row g0
                b = int(row_max.argmax())
                shard, _, _ = self.row_span(g0 + b)
                raise cli.RankLocalError(f"{self.paths[shard]}: token id {row_max[b]} >= vocab size {self.vocab_size}; "
                                         "wrong tokenizer or --vocab-size too small")
        return x, y


class StepLoader:
    """Which rows each rank reads at each micro-step of each optimizer step.

    Step s consumes the rows_per_step consecutive global rows [s*R, (s+1)*R). Micro-step m of
    rank r reads rows s*R + (m*W + r)*B + [0, B): any split B x accumulation x W of the same
    R reads the same rows, so the loss curve does not depend on the GPU count."""

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
    """Prepares step s+1's micro-batches (and its token count) on a background thread while
    step s computes; on CUDA they are pinned so the host-to-device copies are asynchronous."""

    def __init__(self, loader: StepLoader, pin_memory: bool):
        from concurrent.futures import ThreadPoolExecutor
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


LR_SCHEDULES = ("cosine", "wsd", "linear")
# the fields get_lr reads: a resumed run whose values differ may find another LR at its step
SCHEDULE_KEYS = ("lr_schedule", "max_steps", "warmup_steps", "max_lr", "min_lr", "cooldown_frac")


def cooldown_start(run: RunConfig) -> int:
    """First step of WSD's linear cooldown: the last cooldown_frac of max_steps."""
    return run.max_steps - round(run.cooldown_frac * run.max_steps)


def get_lr(step: int, run: RunConfig) -> float:
    """Linear warmup to max_lr, then the decay of run.lr_schedule down to min_lr at max_steps:
    cosine, linear, or wsd (constant, then linear over the last cooldown_frac of the steps).
    min_lr is held after max_steps."""
    min_lr = run.max_lr * 0.1 if run.min_lr is None else run.min_lr
    if step < run.warmup_steps:  # from max_lr / warmup_steps up to max_lr
        return run.max_lr * (step + 1) / run.warmup_steps
    if step >= run.max_steps:
        return min_lr
    decay_start = cooldown_start(run) if run.lr_schedule == "wsd" else run.warmup_steps
    if step < decay_start:  # wsd's stable phase
        return run.max_lr
    progress = (step - decay_start) / max(1, run.max_steps - decay_start)
    if run.lr_schedule == "cosine":
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (run.max_lr - min_lr)
    return run.max_lr - progress * (run.max_lr - min_lr)


def lr_change_notice(saved_run_config: dict, run: RunConfig, step: int) -> str | None:
    """One line when the schedule flags of a resumed run put another LR at the resumed step than
    the checkpoint's run had there (e.g. a larger --max-steps stretches the cosine), else None."""
    saved = dataclasses.replace(run, **{k: saved_run_config[k] for k in SCHEDULE_KEYS if k in saved_run_config})
    old_lr, new_lr = get_lr(step, saved), get_lr(step, run)
    if old_lr == new_lr:
        return None
    changed = ", ".join(f"--{k.replace('_', '-')} {getattr(saved, k)} -> {getattr(run, k)}"
                        for k in SCHEDULE_KEYS if getattr(saved, k) != getattr(run, k))
    return f"note: the LR at step {step} moves from {old_lr:.4e} to {new_lr:.4e} ({changed})"


# -----------------------------------------------------------------------------
# distributed


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def enabled(self):
        return self.world_size > 1 or dist.is_initialized()

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def device_type(self):
        return torch.device(self.device).type  # cuda, mps or cpu


def resolve_device(device: str) -> str:
    """--device checked against what torch sees: auto picks CUDA, else Apple's MPS, else the CPU."""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", device):
        raise UserError(f"--device {device}: expected auto, cpu, cuda, cuda:N or mps")
    mps = torch.backends.mps.is_available()
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device} asked for, but torch sees no CUDA device")
    if device == "mps" and not mps:
        raise UserError("--device mps asked for, but torch sees no MPS device (Apple silicon, macOS 12.3+)")
    return device


def setup_distributed(device: str = "auto", timeout_s: float = 600.0) -> Dist:
    """Join the torchrun process group if launched by torchrun, else a single process.

    NCCL on CUDA, gloo elsewhere. device is "auto", "cpu", "cuda", "cuda:N" or "mps"."""
    device = resolve_device(device)
    if "RANK" not in os.environ:
        return Dist(device=device)
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    import datetime
    cuda = device.startswith("cuda")
    # device_id binds NCCL's communicator to this rank's GPU (else barrier() warns and guesses it)
    dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=torch.device(device) if cuda else None)
    return Dist(rank=rank, local_rank=local_rank, world_size=world, device=device)


def cleanup_distributed():
    if dist.is_initialized():
        dist.destroy_process_group()


def print0(*args, **kwargs):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs, flush=True)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks in place (gloo has no AVG; callers divide themselves)."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def decided_on_rank0(d: Dist, decide):
    """decide() run on rank 0 only (the rank that writes --out-dir), its result sent to every rank;
    a UserError there is raised on every rank, so that none waits in a collective for one that stopped."""
    answer = [None, None]  # (result, refusal)
    if d.is_main:
        try:
            answer[0] = decide()
        except UserError as e:
            answer[1] = str(e)
    if dist.is_initialized():
        dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise UserError(answer[1])
    return answer[0]


def checked_on_every_rank(d: Dist, action):
    """action() on every rank, where each may fail on what only it sees (a file on its node's disk):
    the ranks compare outcomes (one all-gather) and, if any raised a UserError, every rank raises
    the lowest rank's, named by rank unless it is rank 0's, so that rank 0 prints it once and none
    waits in a collective for one that stopped. Returns this rank's action()."""
    result, refusal = None, None
    try:
        result = action()
    except UserError as e:
        refusal = str(e)
    if dist.is_initialized():
        refusals = [None] * dist.get_world_size()
        dist.all_gather_object(refusals, refusal)
        rank, refusal = next(((r, m) for r, m in enumerate(refusals) if m is not None), (0, None))
        refusal = f"rank {rank}: {refusal}" if refusal is not None and rank else refusal
    if refusal is not None:
        raise UserError(refusal)
    return result


class RankLost(Exception):
    """Another rank of the launch died (or stopped answering) and a collective here failed: every
    surviving rank prints this as its one `error:` line and exits 1 (not a UserError: the input
    was fine, and rank 0 may be the rank that died)."""


def is_lost_rank(e: BaseException) -> bool:
    """A collective failed because a peer is gone: gloo raises a RuntimeError naming its socket
    (connection closed or reset, timed out), NCCL a DistBackendError."""
    return isinstance(e, dist.DistError) or (
        isinstance(e, RuntimeError) and re.search(r"gloo|nccl|connection (closed|reset)|timed out", str(e), re.I))


def lost_rank_error(e: BaseException, rank: int, last_ckpt: str | None, saves: bool = True) -> RankLost:
    """The line for a failed collective; saves: the command writes checkpoints (so name the last)."""
    # gloo: "[.../pair.cc:553] Connection closed by peer [127.0.0.1]:14728. This is typically ..."
    reason = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip()).split(". ")[0].splitlines()[0]
    checkpoint = (f". Last good checkpoint: {last_ckpt or 'none'}"
                  + (" (resume with the same command plus --resume)" if last_ckpt else "")) if saves else ""
    return RankLost(f"rank {rank}: another rank of this launch died or stopped answering ({reason}), so this rank "
                    f"stopped too; torchrun's report below names the rank that failed first{checkpoint}")


@contextlib.contextmanager
def process_group(device: str = "auto", timeout_s: float = 600.0, last_checkpoint=None):
    """setup_distributed and cleanup_distributed around one command's work on every rank, with the
    faults of a launch as one line each: the ranks wait for each other before any tears the group
    down (ranks that left at different times aborted at exit); a collective that failed because
    another rank died is a RankLost (naming last_checkpoint(), for a command that saves them); and
    after a UserError torchrun's SIGTERM, sent once one rank has exited, no longer cuts rank 0
    short of printing its line."""
    d = setup_distributed(device, timeout_s)
    try:
        yield d
        if d.enabled:
            dist.barrier()
    except UserError:
        if d.enabled:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise
    except Exception as e:
        if d.enabled and is_lost_rank(e):  # another rank died during set-up, evaluation or the last barrier
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun SIGTERMs the survivors: print the line first
            raise lost_rank_error(e, d.rank, last_checkpoint and last_checkpoint(), saves=bool(last_checkpoint)) \
                from None
        raise
    finally:
        cleanup_distributed()


def exit_code_on_every_rank(action, debug: bool = False) -> int:
    """exit_code_of(action) for a command torchrun may launch: a RankLost is printed by every
    surviving rank (rank 0 may be the one lost), exit code 1 (the input was fine)."""
    try:
        return exit_code_of(action, debug)
    except RankLost as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1


def launch_fingerprint(run: RunConfig, model_cfg: GPTConfig) -> list[tuple[str, object]]:
    """What every rank of a launch must share, in flag order: each run and model flag, then the
    shards of --data-dir (names and sizes; a missing folder or split is left to the loader to refuse)."""
    items = [(f"--{name.replace('_', '-')}", value) for cfg in (run, model_cfg)
             for name, value in dataclasses.asdict(cfg).items()]
    for split in ("train", "val"):
        try:
            files = shard_files(find_shards(run.data_dir, split))
        except (UserError, OSError):
            files = []
        items.append((f"{split} shards in --data-dir", files))
    return items


def first_difference(rank: int, mine: list, theirs: list) -> str | None:
    """The first item where rank's launch fingerprint (mine) differs from rank 0's (theirs), in words."""
    for (what, a), (_, b) in zip(theirs, mine):
        if a == b:
            continue
        if what.startswith("--"):
            return f"{what} {a} on rank 0 but {what} {b} on rank {rank}"
        name, size_a, size_b = differing_file(a, b)
        return f"{what}: {name} is {size_a} on rank 0 but {size_b} on rank {rank}"
    return None


def check_ranks_agree(run: RunConfig, model_cfg: GPTConfig):
    """Under torchrun, refuse a launch whose ranks got different flags or data (a different
    --max-steps ends in a collective waiting for a rank that left; a different --max-lr trains
    replicas that silently drift apart). One all-gather; every rank raises the same error."""
    if not dist.is_initialized():
        return
    fingerprints = [None] * dist.get_world_size()
    dist.all_gather_object(fingerprints, launch_fingerprint(run, model_cfg))
    for rank, fingerprint in enumerate(fingerprints[1:], start=1):
        difference = first_difference(rank, fingerprint, fingerprints[0])
        if difference:
            # torchrun SIGTERMs the other ranks once one has exited: none exits before every rank
            # ignores it, so that rank 0 lives to print the line
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            dist.barrier()
            raise UserError(f"the ranks of this launch were started differently: {difference}; "
                            "every rank needs the same command and the same --data-dir files")


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of t: its shard if t is sharded (a DTensor under --fsdp), else t."""
    return t.to_local() if hasattr(t, "to_local") else t


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def shard_model(model: GPT, d: Dist, dtype: torch.dtype, compile_block=None) -> GPT:
    """FSDP2, in place: every block, then the root (embeddings, the tied wte/lm_head, ln_f),
    sharded over the ranks, each rank keeping 1/W of every parameter, gradient and AdamW state.
    The parameters move to d.device one fully_shard call at a time, so a model built on the
    CPU is never whole on the GPU. With a low-precision dtype, forward and backward run on
    gathered parameters cast to it and gradients are reduced in fp32. compile_block (e.g.
    torch.compile) wraps each block before it is sharded: torch's advice is to compile the
    module inside FSDP, and per block as torchtitan does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    mesh = init_device_mesh(d.device_type, (d.world_size,))
    policy = MixedPrecisionPolicy() if dtype == torch.float32 else \
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    blocks = model.transformer.h
    for i, block in enumerate(blocks):
        if compile_block:
            blocks[i] = block = compile_block(block)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    # The root keeps its parameters gathered after forward: backward needs them at once, and
    # scoring (hellaswag.py) calls lm_head after hidden_states, which is registered as a
    # forward so that it gathers them.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    register_fsdp_forward_method(model, "hidden_states")
    return model


def uncompile_blocks(model: GPT):
    """Run the blocks that shard_model compiled eagerly (after a failed compile): FSDP's hooks
    stay on the compiled wrappers, whose forward becomes the plain block."""
    compiled = [block for block in model.transformer.h if hasattr(block, "_orig_mod")]
    if compiled and hasattr(model, "reset_iter_state"):  # torch 2.13+: the failed step left FSDP mid-forward
        model.reset_iter_state()
    for block in compiled:
        block.forward = block._orig_mod.__call__  # a method, not a module: setattr would register a child


def grad_norm_of(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients as one vector. FSDP's gradients are shards (DTensors) whose
    norm comes back as a partial one; full_tensor() sums it over the ranks, so every rank gets
    the norm DDP computes and clips by it."""
    norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# -----------------------------------------------------------------------------
# evaluation & checkpoint


def autocast_context(device_type: str, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


@torch.no_grad()
def evaluate_loss(model: GPT, rows: TokenRows, B: int, n_batches: int, rank: int, world: int,
                  device: str, dtype: torch.dtype, loss_chunk: int = 0) -> float:
    """Token-weighted mean loss over the first n_batches x world x B rows of a stream."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, token count
    for i in range(n_batches):
        x, y = rows.batch((i * world + rank) * B, B)
        x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        with autocast_context(torch.device(device).type, dtype):
            _, loss_sum = model(x, y, reduction="sum", loss_chunk=loss_chunk)
        totals[0] += loss_sum.double()
        totals[1] += (y != IGNORE_INDEX).sum()
    model.train()
    all_reduce_sum(totals)
    return (totals[0] / totals[1]).item()


SAMPLE_PROMPT = "Hello, I'm a language model,"


def encode_prompt(enc, prompt: str, vocab_size: int) -> list[int]:
    """Token ids of prompt (a literal <|endoftext|> is that token; an empty prompt is <|endoftext|>
    alone, the start of a document), or a UserError if one lies beyond the model's vocabulary."""
    ids = enc.encode(prompt, allowed_special={"<|endoftext|>"}) or [EOT]
    beyond = [t for t in ids if t >= vocab_size]
    if beyond:
        raise UserError(f"the prompt has token {beyond[0]} ({enc.decode([beyond[0]])!r}), beyond the model's "
                        f"vocabulary of {vocab_size} ids")
    return ids


SAMPLE_BATCH_BYTES = 2 << 30  # default rows drawn at once: as many as fit in this much memory,
SAMPLE_BATCH_ROWS = 64  # and at most this many, so that the first texts come soon


def sample_batch_rows(config: GPTConfig, tokens: int, element_size: int = 4) -> int:
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


def sample_text(model: GPT, enc, device: str, prompt=SAMPLE_PROMPT, n=4, length=32, temperature=1.0,
                top_k=50, seed=42, end_at_eot=True, batch_rows=None, stop_early=True):
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
    batch_rows = batch_rows or sample_batch_rows(model.config, len(ids) + length,
                                                 next(model.parameters()).element_size())
    stop_token = EOT if end_at_eot and stop_early else None
    try:
        for first in range(0, n, batch_rows):
            rows = range(first, min(n, first + batch_rows))
            idx = torch.tensor([ids] * len(rows), dtype=torch.long, device=device)
            generators = [sample_generator(seed, i, device) for i in rows]
            out = model.generate(idx, length, temperature=temperature, top_k=top_k, generator=generators,
                                 stop_token=stop_token)
            for row in out[:, len(ids):].tolist():
                if end_at_eot and EOT in row:
                    row = row[:row.index(EOT) + 1]
                yield prompt + enc.decode([t for t in row if t < enc.n_vocab])
    finally:
        model.train(was_training)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare module inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or getattr(model, "_orig_mod")
    return model


def clean_state_dict(model: nn.Module) -> dict:
    """State dict of the bare GPT, without DDP's `module.` or torch.compile's `_orig_mod.` prefixes."""
    return unwrap_model(model).state_dict()


def rekey_optimizer_state(state: dict, keys: list) -> dict:
    """An optimizer state dict with its parameters renamed in order: the i-th parameter of its
    param_groups becomes keys[i]. optimizer.state_dict() names parameters 0, 1, 2, ... and the
    torch.distributed.checkpoint helpers by their names, in the same order."""
    order = [p for group in state["param_groups"] for p in group["params"]]
    new = dict(zip(order, keys, strict=True))
    return dict(state={new[p]: s for p, s in state["state"].items()},
                param_groups=[{**g, "params": [new[p] for p in g["params"]]} for g in state["param_groups"]])


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state dicts as a single process holds them: unsharded, unprefixed,
    the optimizer's parameters numbered. Under FSDP every rank must call this: it gathers the
    shards to rank 0, on the CPU; the other ranks get empty dicts."""
    if not is_fsdp(model):
        return clean_state_dict(model), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    n_params = sum(len(g["params"]) for g in optimizer.param_groups)
    return model_state, rekey_optimizer_state(optim_state, list(range(n_params))) if optim_state else {}


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict):
    """Load what full_state() returns (every rank passes the whole state; under FSDP each keeps its shard)."""
    if not is_fsdp(model):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        return
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    # the parameters' names in the optimizer's order, as the helpers list them
    names = [n for g in get_optimizer_state_dict(model, optimizer)["param_groups"] for n in g["params"]]
    set_optimizer_state_dict(model, optimizer, rekey_optimizer_state(optim_state, names), options=options)


def checkpoint_path(out_dir: str, step: int) -> str:
    return os.path.join(out_dir, f"ckpt_{step:07d}.pt")


# this trainer's checkpoint names (checkpoint_path's); anything else in --out-dir (a user's
# ckpt_best.pt) is never picked by --resume nor deleted by --keep-last
CKPT_NAME = re.compile(r"ckpt_(\d{7,})\.pt")


def list_checkpoints(out_dir: str) -> list[str]:
    """Our checkpoints in out_dir, oldest step first."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    ours = sorted((int(m[1]), m[0]) for m in map(CKPT_NAME.fullmatch, names) if m)
    return [os.path.join(out_dir, name) for _, name in ours]


def latest_checkpoint(out_dir: str) -> str | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def checkpoint_step(path: str) -> int:
    """The step in one of our checkpoint names (CKPT_NAME)."""
    return int(CKPT_NAME.fullmatch(os.path.basename(path))[1])


def earlier_checkpoint(path: str) -> str | None:
    """What to use instead of a bad checkpoint: the newest of ours before it in its folder."""
    found = list_checkpoints(os.path.dirname(path) or ".")
    same = [p for p in found if os.path.samefile(p, path)] if os.path.exists(path) else []
    if same:
        found = found[:found.index(same[0])]
    return found[-1] if found else None


def state_digest(state: dict) -> str:
    """sha256 of a checkpoint's contents (all but its "checksum"): every tensor's dtype, shape and
    bytes and every plain value, in order. Detects bytes flipped anywhere in the payload."""
    h = hashlib.sha256()

    def visit(x):
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().contiguous()
            h.update(f"tensor {x.dtype} {tuple(x.shape)}:".encode())
            h.update(x.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(x, dict):
            h.update(b"{")
            for k, v in x.items():
                visit(k)
                visit(v)
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"(" if isinstance(x, tuple) else b"[")
            for v in x:
                visit(v)
            h.update(b")")
        else:
            h.update(f"{type(x).__name__} {x!r};".encode())
    visit({k: v for k, v in state.items() if k != "checksum"})
    return h.hexdigest()


class _WriteErrorKeeper:
    """A file for torch.save that keeps the OSError of a failed write: torch re-raises it as a
    RuntimeError that no longer says why (e.g. that the disk is full)."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data):
        try:
            return self.file.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self.file.flush()


def fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: str, state: dict, keep_last: int = 0):
    """Write path.tmp, fsync it, rename it to path, fsync the folder: a crash, a full disk or a
    power loss leaves the new checkpoint whole or absent, and the previous one intact. The
    sha256 of the contents goes inside (load_checkpoint checks it)."""
    tmp, out_dir = path + ".tmp", os.path.dirname(path) or "."
    try:
        with open(tmp, "wb") as f:
            writer = _WriteErrorKeeper(f)
            try:
                torch.save(dict(state, checksum=state_digest(state)), writer)
            except RuntimeError as e:
                raise writer.error or e from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(out_dir)
    except BaseException as e:  # disk full, quota, permissions; a second Ctrl-C
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if not isinstance(e, (OSError, RuntimeError)):
            raise
        raise UserError(f"could not write checkpoint {path}: {os_error_reason(e)}; the previous checkpoint "
                        f"{latest_checkpoint(out_dir) or '(none)'} is intact") from None
    if keep_last:
        for old in list_checkpoints(out_dir)[:-keep_last]:
            if old != path:
                os.remove(old)


def load_checkpoint(path: str, map_location="cpu") -> dict:
    """Load one of our checkpoints (a file, or a run's --out-dir for its newest) with
    weights_only=True (tensors and plain types, no pickled code), and check that it is ours
    and whole; otherwise a UserError that names the earlier checkpoint to use."""
    if os.path.isdir(path):
        newest = latest_checkpoint(path)
        if newest is None:
            raise UserError(f"no checkpoint (ckpt_NNNNNNN.pt) in {path}")
        path = newest
    if not os.path.isfile(path):
        raise UserError(f"checkpoint {path} does not exist")
    earlier = earlier_checkpoint(path)
    instead = f"use the earlier checkpoint {earlier}" if earlier else "there is no earlier checkpoint next to it"
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for a damaged zip or pickle
        what = "empty file (0 bytes)" if os.path.getsize(path) == 0 else \
            f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        raise UserError(f"{path}: cannot load checkpoint ({what}); truncated or corrupt: {instead}") from None
    problem = checkpoint_problem(ckpt)
    if problem:
        raise UserError(f"{path}: {problem}")
    if ckpt["checksum"] != state_digest(ckpt):
        raise UserError(f"{path}: damaged checkpoint (its contents do not match the sha256 written with it): "
                        f"{instead}")
    bad = first_nonfinite(ckpt["model"])
    if bad:  # the trainer never writes one (check_state_finite): another program did
        raise UserError(f"{path}: the model weights hold NaN or inf ({bad}): {instead}")
    return ckpt


def first_nonfinite(state: dict) -> str | None:
    """The name of the first floating-point tensor in state that holds a NaN or inf (None: none does)."""
    return next((name for name, t in state.items()
                 if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all()), None)


def checkpoint_problem(ckpt) -> str | None:
    """Why a loaded object is not a checkpoint written by this trainer (None: it looks like one)."""
    if not isinstance(ckpt, dict):
        return f"not a train_gpt2.py checkpoint (it holds a {type(ckpt).__name__}, not a dict)"
    missing = [k for k in ("model", "model_config", "checksum") if k not in ckpt]
    if missing == ["checksum"]:
        return "no checksum: not written by this train_gpt2.py (an older version, or another program)"
    if missing:
        keys = ", ".join(map(str, list(ckpt)[:8])) or "none"
        return f"not a train_gpt2.py checkpoint (no {', '.join(missing)}; its keys: {keys})"
    config = ckpt["model_config"]
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    if not isinstance(config, dict) or set(config) - known:
        unknown = sorted(map(str, set(config) - known)) if isinstance(config, dict) else [type(config).__name__]
        return f"not a train_gpt2.py checkpoint (unknown model_config {', '.join(unknown)})"
    return None


def model_from_checkpoint(path: str, device="cpu") -> GPT:
    """The GPT stored in one of our checkpoints, in eval mode on device."""
    ckpt = load_checkpoint(path)
    model = GPT(GPTConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()


class RunLog:
    """log.jsonl on rank 0: one JSON object per line. Other ranks write nothing.

    Each record is one write, and a failed write (disk full) is cut back: the file always ends
    with a whole record. A checkpoint stores the log's length and the sha256 of its contents up
    to there (position()); resuming cuts the log back to that point only when the log here is
    that run's log (an empty or missing log starts afresh), and refuses otherwise."""

    sinks = ()  # run trackers that get every record too (open_sinks)

    def __init__(self, out_dir: str, enabled: bool, resume_point: tuple | None = None, resumed_from: str = ""):
        self.path, self.file = os.path.join(out_dir, "log.jsonl"), None
        self.last_checkpoint = resumed_from or None  # named when a write fails
        self.size, self.sha = 0, hashlib.sha256()
        if not enabled:
            return
        if os.path.islink(self.path) and not os.path.exists(self.path):  # open() would create its target
            raise UserError(f"cannot open {self.path}: it is a symbolic link to {os.readlink(self.path)}, which "
                            "does not exist; remove the link or point it at a file")
        try:
            kept = read_log_up_to(self.path, resume_point, resumed_from)
            self.file = open(self.path, "ab", buffering=0)  # unbuffered: one write per record
            if resume_point:
                self.file.truncate(len(kept))  # drop what the run logged after its checkpoint
        except OSError as e:
            raise UserError(f"cannot open {self.path}: {os_error_reason(e)}; make it a writable file, or choose "
                            "another --out-dir") from None
        self.size = len(kept)
        self.sha.update(kept)

    def write(self, **record):
        if self.file:
            self._append((json.dumps(strict_json_record(record), allow_nan=False) + "\n").encode())
        for sink in list(self.sinks):
            self._to_sink(sink, f"at step {record['step']}", sink.write, record)

    def resend_step(self, step: int):
        """The sinks get the records of step that the log holds: a resumed run's step was evaluated
        before its checkpoint, so each tracker then holds what log.jsonl holds from that step on."""
        if not self.file:
            return
        with open(self.path, "rb") as f:
            for line in f.read(self.size).splitlines():
                record = json.loads(line)
                record.update({k: float(v) for k, v in record.pop("nonfinite", {}).items()})  # strict_json_record undone
                if record["step"] == step:
                    for sink in list(self.sinks):
                        self._to_sink(sink, f"at step {step}", sink.write, record)

    def _to_sink(self, sink, when: str, call, *args):
        """A run tracker that fails (W&B's service gone, a full disk) gets no more records, with a
        warning: the training and log.jsonl go on, and log.jsonl holds every record."""
        try:
            call(*args)
        except Exception as e:
            self.sinks = [s for s in self.sinks if s is not sink]
            cli.print_warning(f"{sink.flag} failed {when} ({type(e).__name__}: {one_line(e)}) and gets no more "
                              f"records; {self.path} has them all")

    def _append(self, data: bytes):
        try:
            view = memoryview(data)
            while view:  # a short write means the disk filled mid-record: the next write says why
                view = view[self.file.write(view):]
        except OSError as e:
            with contextlib.suppress(OSError):
                self.file.truncate(self.size)  # back to the last whole record
            self._fail(e)
        self.size += len(data)
        self.sha.update(data)

    def sync(self):
        """Make the log durable (before a checkpoint that points into it)."""
        if self.file:
            try:
                os.fsync(self.file.fileno())
            except OSError as e:
                self._fail(e)

    def _fail(self, e: OSError):
        raise UserError(f"cannot write {self.path}: {os_error_reason(e)} (the log ends at its last whole record). "
                        f"Last good checkpoint: {self.last_checkpoint or 'none'}") from None

    def position(self) -> tuple[int, str]:
        """(bytes written, sha256 of them): where a resume from a checkpoint taken now cuts the log."""
        return self.size, self.sha.hexdigest()

    def close(self):
        if self.file:
            self.file.close()
        for sink in list(self.sinks):
            self._to_sink(sink, "at the end", sink.close)


def strict_json_record(record: dict) -> dict:
    """record with its NaN and infinite numbers as null, listed by name and value under "nonfinite":
    JSON has no NaN or Infinity, and strict readers (jq, JavaScript, pandas' default) reject them."""
    bad = {k: str(v) for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
    return {**record, **dict.fromkeys(bad), "nonfinite": bad} if bad else record


def read_log_up_to(path: str, resume_point: tuple | None, resumed_from: str) -> bytes:
    """What a run keeps of the log.jsonl at path: all of it, or resuming, its bytes up to the
    checkpoint's recorded (offset, sha256), when it is the log of the checkpoint's run (a missing or
    empty log is fine: a new one starts). Otherwise a UserError: cutting it would corrupt it."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size  # (0 for a device: /dev/full reads zeros forever)
            kept = f.read(min(resume_point[0], size) if resume_point else size)
    except FileNotFoundError:
        return b""
    if resume_point and kept and (len(kept) != resume_point[0] or hashlib.sha256(kept).hexdigest() != resume_point[1]):
        raise UserError(f"{path} is not the log of the run that wrote {resumed_from}: resuming would "
                        "corrupt it; move it aside or resume into an --out-dir without a log.jsonl")
    return kept


def set_aside_later_branch(out_dir: str, step: int, resume_point: tuple | None, resumed_from: str):
    """Resuming at `step` abandons what the run in out_dir did after it. Its later checkpoints move,
    with a copy of its log.jsonl, into a new out_dir/branch_NNNNNNN (the step that branch reached),
    a run folder of its own (--resume works on it): nothing is deleted or overwritten, --keep-last
    no longer counts them, and a plain --resume in out_dir continues the new branch."""
    later = [p for p in list_checkpoints(out_dir) if checkpoint_step(p) > step]
    if not later:
        return
    log = os.path.join(out_dir, "log.jsonl")
    read_log_up_to(log, resume_point, resumed_from)  # a log that is not this run's: refused before anything moves
    reached = checkpoint_step(later[-1])
    branch = os.path.join(out_dir, f"branch_{reached:07d}")
    for n in itertools.count(2):  # a name no earlier branch took
        try:
            os.mkdir(branch)
            break
        except FileExistsError:
            branch = os.path.join(out_dir, f"branch_{reached:07d}_{n}")
    try:
        if os.path.isfile(log):
            shutil.copyfile(log, os.path.join(branch, "log.jsonl"))
            with open(os.path.join(branch, "log.jsonl"), "rb+") as f:
                os.fsync(f.fileno())
        for path in later:
            os.rename(path, os.path.join(branch, os.path.basename(path)))
        fsync_dir(branch)
        fsync_dir(out_dir)
    except OSError as e:
        raise UserError(f"could not move the later checkpoints of {out_dir} into {branch}: {os_error_reason(e)} "
                        "(nothing was deleted)") from None
    names = os.path.basename(later[0]) + (f" ... {os.path.basename(later[-1])}" if len(later) > 1 else "")
    print0(f"resuming at step {step}: moved the later branch of this run ({len(later)} checkpoint"
           f"{'s' * (len(later) > 1)}, {names}) with a copy of its log.jsonl to {branch}; nothing was deleted")


class OutDirLock:
    """One live run per --out-dir: rank 0 holds an exclusive flock on OUT/.lock, which names its pid
    and host for the refusal of a second run. The kernel drops the lock when the process ends, however
    it ends, so the file a killed run leaves blocks nothing; a run that ends normally removes it."""

    def __init__(self, out_dir: str):
        self.out_dir, self.path, self.file = out_dir, os.path.join(out_dir, ".lock"), None

    def acquire(self):
        try:
            import fcntl
        except ImportError:  # Windows
            return self._cannot_lock("no flock on this system")
        while True:
            f = open(self.path, "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                owner = f.read().strip() or "owner not yet recorded"
                f.close()
                raise UserError(f"--out-dir {self.out_dir} is in use by another training run ({owner}; it holds "
                                f"{self.path}): wait for it to end (then --resume continues it), or choose "
                                "another --out-dir") from None
            except OSError as e:  # a file system without locks (Lustre without -o flock)
                f.close()
                return self._cannot_lock(os_error_reason(e))
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    break
            f.close()  # a run that just ended removed this file after we opened it: lock the new one
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self.file = f

    def _cannot_lock(self, why: str):
        print0(f"note: cannot lock {self.path} ({why}): a second run on this --out-dir would not be stopped")

    def release(self):
        if self.file:
            with contextlib.suppress(OSError):
                os.remove(self.path)  # while still locked: whoever opens it next locks a new file
            self.file.close()
            self.file = None


def import_extra(module: str, flag: str, package: str):
    """An optional package, imported only when a flag asks for it: a UserError with the pip line if missing."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{flag} needs the {package} package: pip install {package}") from None


class TensorBoardSink:
    """--tensorboard: each record's numbers as scalars and its strings as text, tagged with their
    log.jsonl keys at the record's step, in event files in --out-dir. A resumed run hides what
    earlier attempts logged from its step on (purge_step), as log.jsonl is cut back there."""

    flag = "--tensorboard"

    def __init__(self, out_dir: str, purge_step: int | None):
        tensorboard = import_extra("torch.utils.tensorboard", "--tensorboard", "tensorboard")
        self.writer = tensorboard.SummaryWriter(out_dir, purge_step=purge_step)

    def write(self, record: dict):
        for key, value in record.items():
            if key != "step":
                add = self.writer.add_text if isinstance(value, str) else self.writer.add_scalar
                add(key, value, record["step"])

    def close(self):
        self.writer.close()


class WandbSink:
    """--wandb PROJECT: each record as a wandb.log at its step (W&B merges the records of one step
    into one row). WANDB_MODE=offline keeps the run in OUT/wandb for `wandb sync`. Each launch,
    a resume too, is a new W&B run that starts at its first step."""

    flag = "--wandb"

    def __init__(self, project: str, out_dir: str, config: dict):
        wandb = import_extra("wandb", "--wandb", "wandb")
        try:
            self.run = wandb.init(project=project, dir=out_dir, config=config)
        except Exception as e:  # no API key, no network, a bad project name...
            reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise UserError(f"--wandb: could not start a W&B run ({type(e).__name__}: {reason}); "
                            "run `wandb login` or set WANDB_MODE=offline") from None
        if getattr(self.run, "disabled", False):
            cli.print_warning("--wandb: W&B is disabled here (WANDB_MODE=disabled or WANDB_DISABLED), so the W&B "
                              "run stays empty; log.jsonl gets every record")

    def write(self, record: dict):
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self):
        self.run.finish()


def open_sinks(run: RunConfig, model_cfg: GPTConfig, resumed_at: int | None) -> list:
    """The trackers the run asked for (a resumed one's from its step on: RunLog.resend_step)."""
    sinks = []
    if run.tensorboard:
        sinks.append(TensorBoardSink(run.out_dir, purge_step=resumed_at))
    if run.wandb:
        config = dict(run=dataclasses.asdict(run), model=dataclasses.asdict(model_cfg))
        sinks.append(WandbSink(run.wandb, run.out_dir, config))
    return sinks


# -----------------------------------------------------------------------------
# train loop

# Keys that fix which rows each step reads and what the model is: resuming must keep them.
RESUME_KEYS = ("seq_len", "total_batch_size", "align_docs", "shuffle", "seed")

# Dense (not 2:4-sparse) bf16/fp16 tensor-core peak of one GPU in TFLOP/s, matched against
# torch.cuda.get_device_name() in order, most specific pattern first. Consumer cards use the
# "FP16/BF16 with FP32 accumulate" figure, which is what autocast's matmuls do. A GPU that
# matches nothing gets no MFU (pass --peak-tflops): a wrong peak is worse than none.
PEAK_TFLOPS = (
    (r"H100.*NVL", 835),  # H100 datasheet (NVL column): 1,671 with sparsity
    (r"H100.*PCIe", 756),  # H100 datasheet (PCIe column): 1,513 with sparsity
    (r"H100|GH200", 989),  # H100 SXM5 and Grace Hopper datasheets: 1,979 with sparsity
    (r"H200.*NVL", 835),  # H200 datasheet (NVL column): 1,671 with sparsity
    (r"H200", 989),  # H200 SXM datasheet: 1,979 with sparsity
    (r"B200", 2250),  # HGX B200 datasheet, per GPU: 4.5 PFLOPS with sparsity
    (r"A100", 312),  # A100 datasheet (SXM and PCIe): 624 with sparsity
    (r"\bA10\b", 125),  # A10 datasheet: 250 with sparsity. Not the A10G: NVIDIA publishes no figure for it
    (r"\bA30\b", 165),  # A30 datasheet: 330 with sparsity
    (r"\bA40\b", 149.7),  # A40 datasheet: 299.4 with sparsity
    (r"L40S", 362),  # L40S datasheet: 733 with sparsity
    (r"\bL40\b", 181),  # L40 datasheet: 362 with sparsity
    (r"\bL4\b", 121),  # L4 datasheet: 242 with sparsity
    (r"RTX A6000", 154.8),  # RTX A6000 datasheet: 309.7 with sparsity
    (r"RTX 6000 Ada", 364.2),  # RTX 6000 Ada datasheet: 728.5 with sparsity
    (r"RTX 5090", 209.5),  # Blackwell GeForce whitepaper, FP16 with FP32 accumulate (419 sparse)
    (r"RTX 4090(?! ?D)", 165.2),  # Ada whitepaper, FP16/BF16 with FP32 accumulate (330.4 sparse)
    (r"RTX 3090(?! ?Ti)", 71),  # Ampere GA102 whitepaper, FP16/BF16 with FP32 accumulate (142 sparse)
    (r"V100S", 130),  # V100S datasheet, fp16 (no bf16 on Volta)
    (r"V100.*PCIe", 112),  # V100 datasheet (PCIe column), fp16
    (r"V100", 125),  # V100 datasheet (SXM2 column), fp16
    (r"\bT4\b", 65),  # T4 datasheet, fp16 mixed precision
)


def peak_flops(device_name: str) -> float | None:
    """Dense bf16/fp16 peak FLOP/s of one GPU named device_name, or None if unknown."""
    return next((tflops * 1e12 for pattern, tflops in PEAK_TFLOPS if re.search(pattern, device_name, re.I)), None)


def flops_per_token(cfg: GPTConfig, T: int, n_params: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward + backward matmuls) plus attention's
    QK^T and AV, 12 * n_layer * n_embd * T (PaLM appendix B; causal masking not discounted)."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * T


def resolve_dtype(name: str, device_type: str, capability: tuple[int, int] | None = None) -> torch.dtype:
    """The autocast dtype. auto: bf16 on CUDA GPUs that have bf16 tensor cores (compute capability
    8.0+, Ampere on), fp16 with a GradScaler on older ones (T4, V100, RTX 20xx), fp32 elsewhere."""
    if name == "auto":
        name = "float32"
        if device_type == "cuda":
            name = "bfloat16" if capability is None or capability >= (8, 0) else "float16"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def compile_decision(requested: bool | None, device_type: str, capability: tuple[int, int] | None,
                     platform: str, has_triton: bool) -> tuple[bool, str | None]:
    """Whether to torch.compile (default: on CUDA only) and, when CUDA cannot, why not.
    Inductor's GPU kernels are Triton's, which needs compute capability 7.0+ and an install
    (on Windows the separate triton-windows package)."""
    if requested is False or (requested is None and device_type != "cuda"):
        return False, None
    if device_type == "cuda":
        if capability is not None and capability < (7, 0):
            return False, f"compute capability {capability[0]}.{capability[1]} < 7.0, which Triton needs"
        if not has_triton:
            hint = "pip install triton-windows" if platform == "win32" else "pip install triton"
            return False, f"Triton is not installed ({hint})"
    return True, None


def device_memory(device: str, device_type: str) -> tuple[int, str] | None:
    """(bytes, what they are) of the memory the model lives in, None where unknown (MPS)."""
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the {props.name}'s memory"
    if device_type == "cpu" and hasattr(os, "sysconf"):
        with contextlib.suppress(ValueError, OSError):
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
    return None


def check_model_fits(cfg: GPTConfig, d: Dist, fsdp: bool, training: bool):
    """Refuse a model whose weights (evaluation) or weights, gradients and AdamW moments (training,
    16 bytes per parameter) exceed the device's memory before any of it is allocated: a huge
    allocation fails with a traceback, and many smaller ones end in the kernel's OOM killer."""
    memory = device_memory(d.device, d.device_type)
    if memory is None:
        return
    n, bytes_per_param = param_count(cfg), 16 if training else 4
    need = n * bytes_per_param / (d.world_size if fsdp else 1)
    if d.device_type == "cpu":  # the ranks of this node share its RAM
        need *= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if need > memory[0]:
        what = "weights, gradients and AdamW state" if training else "weights"
        raise UserError(f"the model has {n / 1e9:.3g}B parameters: its {what} ({bytes_per_param} bytes per parameter"
                        f"{', sharded by --fsdp' if fsdp else ''}) need {need / 2**30:.3g} GiB, more than "
                        f"{memory[1]} ({memory[0] / 2**30:.3g} GiB): choose a smaller --model or --n-layer, "
                        "--n-embd, --vocab-size, --block-size" + ("" if fsdp or d.world_size < 2 else ", or --fsdp"))


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))  # the CPU allocator's message


def out_of_memory_error(e: BaseException, device: str, last_ckpt: str | None) -> cli.RankLocalError:
    # CUDA: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ..."; CPU: "[enforce fail at
    # alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 411041792 bytes. ..."
    tried = re.search(r"tried to allocate [^.]*(\.\d+ \w+)?", one_line(e), re.I)
    return cli.RankLocalError(
        f"out of memory on {device} ({tried[0] if tried else one_line(e)}): lower --batch-size (--total-batch-size stays "
        "the same through more accumulation steps) or pass --activation-checkpointing. Last good checkpoint: "
        f"{last_ckpt or 'none'}")


# a stop as requested: preemption, Ctrl-C, and a closed terminal or ssh session (no SIGHUP on Windows)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))


class StopSignal:
    """SIGTERM, SIGINT and SIGHUP ask the run to finish its step, checkpoint and exit 0; a second
    SIGINT aborts. at_once (an evaluation, which has nothing to save): every one ends it there,
    as cli.Interrupted (exit code 128 + signum)."""

    def __init__(self, at_once: bool = False):
        self.requested, self.at_once = False, at_once
        self.terminal_fds = [fd for fd in (1, 2) if os.isatty(fd)]  # a hung-up terminal no longer says it is one
        self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def _handle(self, signum, frame):
        if signum == getattr(signal, "SIGHUP", None):
            self.leave_terminal()
        if self.at_once or (self.requested and signum == signal.SIGINT):
            raise cli.Interrupted(signum)
        self.requested = True

    def leave_terminal(self):
        """After SIGHUP the terminal is gone and writing to it fails (EIO), which would end the run
        before its checkpoint: what went to the terminal goes to /dev/null (files and pipes still get theirs)."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in self.terminal_fds:
            os.dup2(devnull, fd)
        os.close(devnull)

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def ignore_sigterm_from_now(self):
        """After another rank died torchrun SIGTERMs the survivors: this one still prints its line."""
        self.previous[signal.SIGTERM] = signal.SIG_IGN


class SpikeDetector:
    """Flags a value more than z standard deviations above the mean of a recent window.

    Every value enters the window, flagged or not: after a lasting shift (new data) the window
    moves to the new level within a few steps, instead of flagging every later value."""

    def __init__(self, z: float, window: int = 50, warmup: int = 20):
        self.z, self.window, self.warmup, self.values = z, window, warmup, []

    def is_spike(self, value: float) -> bool:
        spike = False
        if self.z and len(self.values) >= self.warmup:
            mean = sum(self.values) / len(self.values)
            std = (sum((v - mean) ** 2 for v in self.values) / len(self.values)) ** 0.5
            spike = value > mean + self.z * max(std, 1e-8)
        self.values = (self.values + [value])[-self.window:]
        return spike


# A level shift leaves the window flagging fewer than window/2 values in a row for any Z >= 1
# (the new values soon dominate its mean and std); more in a row is a trend no skip can fix.
MAX_SPIKES_IN_A_ROW = 25


def get_tokenizer_or_fail(hint: str | None = None):
    """The GPT-2 tokenizer, or a UserError saying how to get it (and `hint`, another way out)."""
    try:
        return get_encoding()
    except RuntimeError as e:
        raise UserError(f"{e} (or {hint})" if hint else str(e)) from None


def find_resume_checkpoint(run: RunConfig) -> str | None:
    """The checkpoint --resume names: the newest in --out-dir ("latest") or in a given folder, or a file."""
    if run.resume is None:
        return None
    if run.resume == "latest":
        return latest_checkpoint(run.out_dir)
    if os.path.isdir(run.resume):
        return latest_checkpoint(run.resume) or run.resume  # (load_checkpoint says there is none)
    return run.resume


def choose_resume_checkpoint(run: RunConfig) -> str | None:
    """On rank 0, holding --out-dir's lock: the checkpoint to resume (None: start from scratch), or
    a UserError where starting from scratch would mix a new run into an earlier one's files."""
    path = find_resume_checkpoint(run)
    if path:
        return path
    if run.resume is None and list_checkpoints(run.out_dir):
        raise UserError(f"--out-dir {run.out_dir} already holds checkpoints: pass --resume to continue "
                        "that run, or choose another --out-dir")
    log = os.path.join(run.out_dir, "log.jsonl")
    if os.path.isfile(log) and os.path.getsize(log):
        raise UserError(f"--out-dir {run.out_dir} holds the log.jsonl of an earlier run but no checkpoint "
                        "to resume: move the log aside to start a new run there, or choose another --out-dir")
    if run.resume is not None:
        print0(f"--resume: no checkpoint in {run.out_dir}, starting from scratch")
    return None


def data_change(saved: dict | None, now: dict) -> str | None:
    """How the shards of a checkpoint's run (Trainer.data_files; None in older checkpoints) and
    this run's differ, in words; None when they match."""
    if not saved:
        return None
    for split in ("train", "val"):
        difference = saved[split] is not None and now[split] is not None and differing_file(saved[split], now[split])
        if difference:
            name, then, today = difference
            return f"{split} shard {name}: {then} then, {today} now"
    if saved["manifest_sha256"] != now["manifest_sha256"]:
        return "its manifest.json differs"
    return None


def check_resume_compatible(ckpt: dict, run: RunConfig, model_cfg: GPTConfig, path: str):
    diffs = [f"{k}: checkpoint {v} vs now {getattr(model_cfg, k)}"
             for k, v in ckpt["model_config"].items() if getattr(model_cfg, k) != v]
    diffs += [f"{k}: checkpoint {ckpt['run_config'][k]} vs now {getattr(run, k)}"
              for k in RESUME_KEYS if ckpt["run_config"][k] != getattr(run, k)]
    if diffs:
        raise UserError(f"cannot resume from {path}: {'; '.join(diffs)}. Use the same model and "
                        "batch flags (the number of GPUs may change)")


def prepare_out_dir(out_dir: str):
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test_{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UserError(f"cannot write to --out-dir {out_dir}: {e.strerror}") from None


def compile_model(model: nn.Module, **options) -> nn.Module:
    """torch.compile, in one place (tests make it fail here to exercise the eager fallback).
    A GPT's chunked loss stays out of the graph, which would unroll its chunk loop (64 chunks:
    105 s to compile on CPU; 256 never finished): it runs eagerly between the compiled body and
    its backward. torch.compiler.disable imports torch._dynamo, 2 s that every command would pay
    at start-up as a decorator: it is applied here, where compiling imports it anyway."""
    if isinstance(model, GPT):
        model.lm_loss = torch.compiler.disable(chunked_lm_loss)
    return torch.compile(model, **options)


def gradient_sync(model: nn.Module, enabled: bool):
    """Context in which backward does (enabled) or does not reduce gradients across ranks.

    DDP's no_sync() must cover the forward too: DDP prepares its reducer there. FSDP2 keeps
    the unsharded gradients of a backward without sync and adds them into the next one's."""
    if enabled:
        return contextlib.nullcontext()
    if is_fsdp(model):
        return fsdp_no_sync(model)
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


@contextlib.contextmanager
def fsdp_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def accumulate_gradients(model: nn.Module, micro_batches, n_tokens: int, world_size: int, device: str,
                         dtype: torch.dtype, loss_chunk: int = 0, scaler=None) -> torch.Tensor:
    """Forward and backward over one optimizer step's micro-batches on this rank.

    Each micro-batch backpropagates sum(token losses) * W / N, where N is the step's count of
    non-ignored targets over all micro-batches and ranks; DDP's average over W ranks then
    leaves exactly d(sum of all token losses) / N. With one micro-batch on one rank that is
    the plain mean loss and no scaling op is added. Returns the summed token loss (float64)
    of this rank. micro_batches yields (x, y) numpy arrays or CPU tensors (pinned for an
    asynchronous copy to CUDA); model may be DDP-wrapped or FSDP-sharded (its reduce-scatter
    averages over W like DDP). With an fp16 GradScaler, each term is scaled by it (the gradients
    come out times its scale; unscale_ before using them)."""
    micro_batches = list(micro_batches)
    device_type = torch.device(device).type
    single = len(micro_batches) == 1 and world_size == 1
    loss_scale = world_size / n_tokens
    loss_total = torch.zeros((), dtype=torch.float64, device=device)
    for i, (x, y) in enumerate(micro_batches):
        x = torch.as_tensor(x).to(device, non_blocking=True)
        y = torch.as_tensor(y).to(device, non_blocking=True)
        with gradient_sync(model, enabled=i == len(micro_batches) - 1):
            with autocast_context(device_type, dtype):
                _, loss = model(x, y, reduction="mean" if single else "sum", loss_chunk=loss_chunk)
            term = loss if single else loss * loss_scale
            (scaler.scale(term) if scaler else term).backward()
        loss_total += loss.detach() * n_tokens if single else loss.detach()
    return loss_total


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
    """One training run. The constructor checks the input and builds data, model and optimizer
    (resuming if asked); fit() runs the loop. One optimizer step is train_step():
    forward_backward() on every micro-batch, reduce_and_clip(), then the guarded update."""

    def __init__(self, run: RunConfig, model_cfg: GPTConfig, d: Dist, out_dir_lock: OutDirLock | None = None):
        self.d, self.device, self.device_type = d, d.device, d.device_type
        self.out_dir_lock = out_dir_lock or OutDirLock(run.out_dir)  # taken below; the caller releases it
        pretrained = None
        if run.init_from:  # the weights decide the model's shape
            from hf_interop import gpt_from_hf
            pretrained = gpt_from_hf(run.init_from, vocab_size=model_cfg.vocab_size, block_size=model_cfg.block_size)
            model_cfg = pretrained.config
            print0(f"--init-from {run.init_from}: {model_cfg}")
        if run.seq_len is None:
            run.seq_len = min(model_cfg.block_size, 1024)
        self.run, self.model_cfg = run, model_cfg
        self.grad_accum_steps = validate_config(run, model_cfg, d.world_size)
        check_model_fits(model_cfg, d, run.fsdp, training=not run.eval_only)
        capability = torch.cuda.get_device_capability(self.device) if self.device_type == "cuda" else None
        self.dtype = resolve_dtype(run.dtype, self.device_type, capability)
        if run.fsdp and self.dtype == torch.float16:  # each rank's scaler would see only its shard's overflows
            raise UserError("--fsdp does not support float16 (its GradScaler needs every rank to agree on "
                            "overflows): pass --dtype bfloat16 on Ampere or newer, --dtype float32, or drop --fsdp")
        # fp16's narrow range needs a dynamic loss scale; a skipped step lowers it (DESIGN.md: fp16)
        self.scaler = torch.amp.GradScaler(self.device_type) if self.dtype == torch.float16 else None
        import importlib.util
        self.use_compile, why_not = compile_decision(run.compile, self.device_type, capability, sys.platform,
                                                     importlib.util.find_spec("triton") is not None)
        if why_not:
            print0(f"compile off: {why_not}")
        self.loss_chunk = run.loss_chunk if run.loss_chunk is not None else (
            CPU_LOSS_CHUNK if self.device_type == "cpu" else 0)
        torch.manual_seed(run.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
        if self.device_type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 matmuls
        self._build_data()  # bad input fails before any model work
        if run.eval_only:  # an evaluation writes nothing, so any --out-dir will do, in use or not
            self.ckpt_path = find_resume_checkpoint(run)
            if run.resume is not None and not self.ckpt_path:
                raise UserError(f"--eval-only --resume: no checkpoint (ckpt_*.pt) in --out-dir {run.out_dir}")
        else:
            self.ckpt_path = decided_on_rank0(d, self._claim_out_dir)
        self.loss_spikes, self.norm_spikes = SpikeDetector(run.skip_spikes), SpikeDetector(run.skip_spikes)
        self.nonfinite_skipped = self.spikes_in_a_row = 0
        self._build_model(pretrained)
        self.log = RunLog(run.out_dir, enabled=False)  # rank 0 opens the real one
        decided_on_rank0(d, self._open_log)
        if self.ckpt_path and not run.eval_only and self.start_step < run.max_steps:  # (else: nothing to train)
            self.log.write(event="resume", step=self.start_step)  # plot_log.py marks it on the curves
        self.stop = StopSignal(at_once=run.eval_only)
        self.prefetcher = Prefetcher(self.loader, pin_memory=self.device_type == "cuda")
        self.compiled_once = False
        self.last_ckpt = self.ckpt_path
        if not run.eval_only and 0 < run.max_steps < run.warmup_steps:  # (once the input has checked out)
            cli.print_warning(f"--warmup-steps {run.warmup_steps} is longer than --max-steps {run.max_steps}: the "
                              f"learning rate only rises, to {get_lr(run.max_steps - 1, run):.3g} at the last step, "
                              f"and never reaches --max-lr {run.max_lr}")

    # ---- set-up

    def _claim_out_dir(self) -> str | None:
        """Rank 0: make --out-dir, lock it for this run, and pick the checkpoint to resume."""
        prepare_out_dir(self.run.out_dir)
        self.out_dir_lock.acquire()
        return choose_resume_checkpoint(self.run)

    def _open_log(self):
        """Rank 0: log.jsonl, cut back to the resumed checkpoint after its later branch is set aside.
        A run with nothing to train (--eval-only, or resumed at --max-steps) touches neither."""
        run = self.run
        writes = not run.eval_only and not (self.ckpt_path and self.start_step >= run.max_steps)
        if writes and self.ckpt_path:
            set_aside_later_branch(run.out_dir, self.start_step, self.log_point, self.ckpt_path)
        resumed_at = self.start_step if self.ckpt_path else None
        sinks = open_sinks(run, self.model_cfg, resumed_at) if writes else []
        self.log = RunLog(run.out_dir, writes, self.log_point, self.ckpt_path)  # (after the sinks: a W&B that
        self.log.sinks = sinks  # cannot start leaves no empty log.jsonl behind)
        if resumed_at is not None:
            self.log.resend_step(resumed_at)

    def _build_data(self):
        """Train and val rows, the step loader, the tokenizer and the HellaSwag file."""
        run, d, vocab_size = self.run, self.d, self.model_cfg.vocab_size
        self.train_rows = TokenRows(run.data_dir, "train", run.seq_len, run.align_docs, run.shuffle, run.seed,
                                    vocab_size, progress=d.is_main)
        self.loader = StepLoader(self.train_rows, run.batch_size, self.grad_accum_steps, d.rank, d.world_size)
        if self.train_rows.rows_per_epoch < self.loader.rows_per_step:
            raise UserError(f"the train shards hold {self.train_rows.rows_per_epoch} rows of {run.seq_len} tokens, "
                            f"fewer than one optimizer step ({self.loader.rows_per_step} rows): lower --total-batch-size")
        self.val_rows = None
        if run.val_every:
            try:
                self.val_rows = TokenRows(run.data_dir, "val", run.seq_len, run.align_docs, vocab_size=vocab_size)
            except UserError as e:
                raise UserError(f"{e} (or pass --val-every 0)") from None
            val_rows_needed = run.val_steps * run.batch_size * d.world_size
            if self.val_rows.rows_per_epoch < val_rows_needed:
                raise UserError(f"the val shards hold {self.val_rows.rows_per_epoch} rows, fewer than --val-steps x "
                                f"--batch-size x world size = {val_rows_needed}: lower --val-steps")
        self.enc = get_tokenizer_or_fail("pass --sample-every 0") if run.sample_every else None
        if run.hellaswag_every:
            import hellaswag
            get_tokenizer_or_fail("pass --hellaswag-every 0")
            # download and render now: a bad file fails here, not at the first evaluation (which
            # a resumed run reaches only after --hellaswag-every steps); evaluate() reuses the examples
            run.hellaswag_file = hellaswag.resolve_data_file(run.hellaswag_file, flag="--hellaswag-file")
            hellaswag.load_examples(run.hellaswag_file, run.hellaswag_limit, flag="--hellaswag-file")

    def _build_model(self, pretrained: GPT | None):
        """The bare model (self.raw_model, for evaluation and checkpoints), the optimizer, the
        resumed state, and the model the step runs (compiled, DDP-wrapped). Under --fsdp both
        are the same sharded module, on which every rank evaluates together."""
        run = self.run
        self.raw_model = (pretrained or GPT(self.model_cfg)).train()
        if run.fsdp:
            shard_model(self.raw_model, self.d, self.dtype, compile_model if self.use_compile else None)
        else:
            self.raw_model.to(self.device)
        self.optimizer = self.raw_model.configure_optimizers(run.weight_decay, run.max_lr, self.device_type)
        self.start_step, self.log_point = 0, None
        if self.ckpt_path:
            self._load_resume_state(self.ckpt_path)
        self.raw_model.activation_checkpointing = run.activation_checkpointing
        self._wrap_model()

    def _wrap_model(self):
        """self.model: raw_model compiled if use_compile, in DDP under torchrun. Under --fsdp,
        raw_model itself (the sharded module; its blocks compiled, or eager after a failed compile)."""
        if self.run.fsdp:
            if not self.use_compile:
                uncompile_blocks(self.raw_model)
            self.model = self.raw_model
            return
        self.model = compile_model(self.raw_model) if self.use_compile else self.raw_model
        if self.d.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP
            # gradients live in DDP's buckets: no second copy of them (6 GB at gpt2-xl)
            self.model = DDP(self.model, device_ids=[self.d.local_rank] if self.device_type == "cuda" else None,
                             gradient_as_bucket_view=True)

    def _load_resume_state(self, path: str):
        ckpt = load_checkpoint(path)
        check_resume_compatible(ckpt, self.run, self.model_cfg, path)
        load_full_state(self.raw_model, self.optimizer, ckpt["model"], ckpt["optimizer"])
        self.start_step, self.log_point = ckpt["step"], (ckpt["log_offset"], ckpt["log_sha256"])
        if self.start_step > self.run.max_steps and not self.run.eval_only:
            raise UserError(f"{path} is at step {self.start_step}, past --max-steps {self.run.max_steps}: "
                            "pass a larger --max-steps to train on")
        self.load_skip_state(ckpt["skip_state"])
        torch.set_rng_state(ckpt["rng_cpu"])
        if self.scaler and "scaler" in ckpt:
            self.scaler.load_state_dict(ckpt["scaler"])
        if "rng_cuda" in ckpt and self.device_type == "cuda":
            torch.cuda.set_rng_state(ckpt["rng_cuda"], self.device)
        print0(f"{'evaluating' if self.run.eval_only else 'resumed from'} {path} at step {self.start_step}")
        change = data_change(ckpt.get("data_files"), self.data_files())  # (checkpoints before data_files: None)
        if change and not self.run.eval_only:
            cli.print_warning(f"--data-dir {self.run.data_dir} changed since {path} was written ({change}): from step "
                              f"{self.start_step} on this run reads other rows than the run it continues would have")
        notice = lr_change_notice(ckpt["run_config"], self.run, self.start_step)
        if notice and not self.run.eval_only:
            print0(notice)

    def checkpoint_state(self, step: int) -> dict:
        """Everything a resume needs (DESIGN.md: state that makes resume exact)."""
        rows_per_step = self.loader.rows_per_step
        model_state, optimizer_state = full_state(self.raw_model, self.optimizer)
        state = dict(model=model_state, optimizer=optimizer_state, step=step,
                     model_config=dataclasses.asdict(self.model_cfg), run_config=dataclasses.asdict(self.run),
                     rng_cpu=torch.get_rng_state(), world_size=self.d.world_size,
                     next_row=step * rows_per_step, epoch=step * rows_per_step // self.train_rows.rows_per_epoch)
        state["log_offset"], state["log_sha256"] = self.log.position()
        state["data_files"] = self.data_files()
        state["skip_state"] = self.skip_state()
        if self.device_type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        if self.scaler:
            state["scaler"] = self.scaler.state_dict()
        return state

    def data_files(self) -> dict:
        """The shards this run reads, and the sha256 of fineweb.py's manifest.json beside them
        (None without one): a resume compares them with the checkpoint's (data_change)."""
        manifest = os.path.join(self.run.data_dir, "manifest.json")
        digest = None
        with contextlib.suppress(OSError), open(manifest, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        return dict(train=shard_files(self.train_rows.paths),
                    val=shard_files(self.val_rows.paths) if self.val_rows else None, manifest_sha256=digest)

    def skip_state(self) -> dict:
        """The update guards' memory, so a resumed run skips exactly what an uninterrupted one would."""
        return dict(loss_window=self.loss_spikes.values, norm_window=self.norm_spikes.values,
                    spikes_in_a_row=self.spikes_in_a_row, nonfinite_skipped=self.nonfinite_skipped)

    def load_skip_state(self, state: dict):
        self.loss_spikes.values, self.norm_spikes.values = list(state["loss_window"]), list(state["norm_window"])
        self.spikes_in_a_row, self.nonfinite_skipped = state["spikes_in_a_row"], state["nonfinite_skipped"]

    def check_state_finite(self, step: int, path: str):
        """Refuse to checkpoint NaN or inf weights or optimizer state, whatever put them there
        (every rank checks its tensors; one all-reduce makes them agree)."""
        params = dict(self.raw_model.named_parameters())
        moments = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        finite = torch.stack([torch.isfinite(local_part(t)).all() for t in [*params.values(), *moments]])
        bad = torch.tensor(float(not finite.all()), device=self.device)
        if all_reduce_sum(bad).item():
            names = [n for n, ok in zip(params, finite.tolist()) if not ok]
            where = f"model weights ({names[0]}, ...)" if names else "model weights or optimizer state"
            raise UserError(f"step {step}: not writing {path}: the {where} hold non-finite values. "
                            f"Last good checkpoint: {self.last_ckpt or 'none'}")

    def save(self, step: int):
        path = checkpoint_path(self.run.out_dir, step)
        self.check_state_finite(step, path)
        # under --fsdp every rank takes part in gathering the state to rank 0
        state = self.checkpoint_state(step) if self.d.is_main or self.run.fsdp else None
        if self.d.is_main:
            self.log.sync()  # the log up to the checkpoint's position is on disk before the checkpoint
            save_checkpoint(path, state, self.run.keep_last)
            self.last_ckpt = path  # on disk: named if a peer dies in the barrier below
        if self.d.enabled:
            dist.barrier()  # no rank runs ahead (or exits) before the checkpoint is on disk
        # on every rank, once rank 0 has written it: they decide together whether a stop needs another save
        self.last_ckpt = self.log.last_checkpoint = path

    # ---- one optimizer step

    def forward_backward(self, micro_batches, n_tokens: int) -> torch.Tensor:
        """This rank's summed token loss; leaves d(step token-mean loss)/d(param) in .grad.
        Compilation happens in the first step: if it fails, the run goes on eagerly."""
        def run():
            return accumulate_gradients(self.model, micro_batches, n_tokens, self.d.world_size, self.device,
                                        self.dtype, self.loss_chunk, self.scaler)
        if not self.use_compile or self.compiled_once:
            return run()
        try:
            loss_total = run()
        except Exception as e:  # dynamo, inductor, Triton and the C++ toolchain fail in many types
            while (inner := getattr(e, "inner_exception", None) or e.__cause__) is not None:
                e = inner  # dynamo wraps the backend's error: name the root cause
            print0(f"compile failed, continuing without it: {type(e).__name__}: {(str(e).strip() or '?').splitlines()[0]}")
            self.use_compile = False
            self.optimizer.zero_grad(set_to_none=True)  # a backward may have run in part
            self._wrap_model()
            return run()
        self.compiled_once = True
        return loss_total

    def reduce_and_clip(self, loss_total: torch.Tensor) -> tuple[float, float, bool]:
        """(summed loss of all ranks, grad norm before clipping, stop requested anywhere), with one
        collective and one host sync; clips the gradients in place."""
        # torch.full fills on the device with the value as a kernel argument: unlike torch.tensor(value,
        # device=...), no copy from pageable host memory, which would block until the backward ends
        stop_flag = torch.full((1,), float(self.stop.requested), dtype=torch.float64, device=self.device)
        stats = all_reduce_sum(torch.cat([loss_total.view(1), stop_flag]))
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # the norm and clipping see the true gradients
        params = [p for p in self.raw_model.parameters() if p.grad is not None]
        grad_norm = grad_norm_of([p.grad for p in params])
        if self.run.grad_clip:
            torch.nn.utils.clip_grads_with_norm_(params, self.run.grad_clip, grad_norm)
        loss_sum, stop_votes, norm = torch.cat([stats, grad_norm.double().view(1)]).tolist()
        return loss_sum, norm, stop_votes > 0

    def skip_reason(self, step: int, loss: float, norm: float) -> str | None:
        """Why this step's update must not be applied (None: apply it); raises when out of skips."""
        if self.scaler and math.isfinite(loss) and not math.isfinite(norm):
            return "overflow"  # fp16 gradients overflowed at this loss scale: the scaler lowers it, no failure
        if not (math.isfinite(loss) and math.isfinite(norm)):
            if self.nonfinite_skipped >= self.run.skip_nonfinite:
                raise UserError(f"step {step}: non-finite loss {loss} or grad norm {norm}; stopped "
                                f"before the update. Last good checkpoint: {self.last_ckpt or 'none'}")
            self.nonfinite_skipped += 1
            return "nonfinite"
        if any([self.loss_spikes.is_spike(loss), self.norm_spikes.is_spike(norm)]):  # both windows see the step
            self.spikes_in_a_row += 1
            if self.spikes_in_a_row > MAX_SPIKES_IN_A_ROW:
                raise UserError(f"step {step}: {self.spikes_in_a_row} updates in a row flagged by --skip-spikes "
                                f"{self.run.skip_spikes}: the loss or grad norm has moved for good (or Z is too low) "
                                "and skipping cannot fix that; stopped before the update. Last good checkpoint: "
                                f"{self.last_ckpt or 'none'}")
            return "spike"
        self.spikes_in_a_row = 0
        return None

    def train_step(self, step: int) -> StepResult:
        """One optimizer step. Its one host sync is in reduce_and_clip; the update is queued without
        waiting, so dt runs from this step's start to the next sync and includes the GPU finishing the
        previous step's update: in a steady run, the time per step."""
        t0 = time.perf_counter()
        micro_batches, n_tokens = self.prefetcher.get(step)  # N is known before any backward
        loss_total = self.forward_backward(micro_batches, n_tokens)
        loss_sum, norm, stop_requested = self.reduce_and_clip(loss_total)
        loss = loss_sum / n_tokens
        lr = get_lr(step, self.run)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        skipped = self.skip_reason(step, loss, norm)
        if self.scaler:  # fused AdamW takes the scaler's inf flag on the device: no sync
            if not skipped:
                self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, norm, lr, n_tokens, time.perf_counter() - t0, stop_requested, skipped)

    # ---- evaluation and the loop

    def evaluate(self, step: int, last_step: bool) -> dict:
        """Validation loss, HellaSwag and samples, each on its own schedule (and at the last step).
        Returns what it logged."""
        run, d = self.run, self.d
        results = {}

        def due(every):
            return every and (step % every == 0 or last_step)
        if self.val_rows and due(run.val_every):
            val_loss = evaluate_loss(self.raw_model, self.val_rows, run.batch_size, run.val_steps, d.rank,
                                     d.world_size, self.device, self.dtype, self.loss_chunk)
            print0(f"step {step:5d} | val loss {val_loss:.4f}")
            results.update(val_loss=val_loss)
            self.log.write(step=step, val_loss=val_loss)
        if due(run.hellaswag_every):
            import hellaswag
            result = hellaswag.evaluate(self.raw_model, self.device, data_file=run.hellaswag_file,
                                        limit=run.hellaswag_limit or None, rank=d.rank,
                                        world_size=d.world_size, dtype=self.dtype, flag="--hellaswag-file")
            print0(f"step {step:5d} | hellaswag acc_norm {result['acc_norm']:.4f} ({result['n']} examples)")
            results.update(hellaswag_acc=result["acc_norm"], hellaswag_n=result["n"])
            self.log.write(step=step, hellaswag_acc=result["acc_norm"], hellaswag_n=result["n"])
        # a sharded model needs every rank in its forward; only rank 0 prints
        if self.enc and (d.is_main or run.fsdp) and step > 0 and due(run.sample_every):
            for text in sample_text(self.raw_model, self.enc, self.device, stop_early=not run.fsdp):
                print0(f"sample: {text}")
        return results

    def evaluate_only(self):
        """--eval-only: the evaluations training runs at the loaded step, with the same numbers;
        printed, then one JSON line. Nothing is written to --out-dir."""
        try:
            results = self.evaluate(self.start_step, last_step=True)
        except Exception as e:
            self.raise_if_lost_rank(e)
            raise
        finally:
            self.prefetcher.close()
            self.stop.restore()
        print0(json.dumps(dict(step=self.start_step, **results)))

    def raise_if_lost_rank(self, e: Exception):
        """A collective that failed because another rank died becomes this rank's one line; no
        checkpoint is written after it (the state may be half-updated, and saving needs the peers)."""
        if self.d.enabled and is_lost_rank(e):
            self.stop.ignore_sigterm_from_now()
            raise lost_rank_error(e, self.d.rank, self.last_ckpt) from None

    def throughput(self, dt: float) -> tuple[float, float, float | None]:
        """(tok/s of all ranks, tok/s per GPU, MFU per GPU or None) of a step that took dt.
        Tokens processed count padding; MFU = FLOPs of all ranks / (dt x W x peak of one GPU)."""
        W = self.d.world_size
        tok_per_s = self.tokens_per_step / dt
        mfu = self.flops_per_token * self.tokens_per_step / (dt * W * self.peak) if self.peak else None
        return tok_per_s, tok_per_s / W, mfu

    def log_step(self, step: int, r: StepResult):
        tok_per_s, tok_per_gpu, mfu = self.throughput(r.dt)
        print0(f"step {step:5d}/{self.run.max_steps} | loss {r.loss:.6f} | lr {r.lr:.4e} | norm {r.grad_norm:.4f} | "
               f"dt {1000 * r.dt:.1f}ms | tok/s {tok_per_s:,.0f} ({tok_per_gpu:,.0f}/gpu)"
               + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else "")
               + (f" | skipped ({r.skipped})" if r.skipped else ""))
        record = dict(step=step, loss=r.loss, lr=r.lr, grad_norm=r.grad_norm, tokens=r.n_tokens,
                      dt_ms=1000 * r.dt, tok_per_s=tok_per_s, tok_per_s_per_gpu=tok_per_gpu)
        if mfu is not None:
            record["mfu"] = mfu
        if r.skipped:
            record["skipped"] = r.skipped
        self.log.write(**record)

    def print_header(self):
        run, d = self.run, self.d
        n_params = self.raw_model.num_params()
        self.tokens_per_step = self.loader.rows_per_step * run.seq_len  # processed by all ranks, padding included
        self.flops_per_token = flops_per_token(self.model_cfg, run.seq_len, n_params)
        self.peak = self.peak_flops()
        print0(f"model: {self.raw_model.param_summary()} | device {self.device} | dtype "
               f"{str(self.dtype).removeprefix('torch.')} | compile {self.use_compile} | world {d.world_size}"
               + (" | fsdp (sharded parameters, gradients, AdamW state)" if run.fsdp else ""))
        print0(f"batch: {run.total_batch_size} tokens/step = {run.batch_size} rows x {run.seq_len} tokens x "
               f"{self.grad_accum_steps} accumulation steps x {d.world_size} ranks | "
               f"{self.train_rows.rows_per_epoch} train rows per epoch")

    def peak_flops(self) -> float | None:
        """Peak FLOP/s of one device for MFU: --peak-tflops, else the table's figure for a CUDA GPU
        running bf16/fp16 (the table holds tensor-core figures), else None (no MFU shown)."""
        if self.run.peak_tflops:
            return self.run.peak_tflops * 1e12
        if self.device_type == "cuda" and self.dtype in (torch.bfloat16, torch.float16):
            return peak_flops(torch.cuda.get_device_name(self.device))
        return None

    def fit(self):
        run = self.run
        self.print_header()
        t_start, step_times = time.perf_counter(), []
        stop_agreed = False
        try:
            if self.ckpt_path and self.start_step == run.max_steps:  # e.g. a requeued job that had finished
                print0(f"{self.ckpt_path} is already at --max-steps {run.max_steps}: nothing to train "
                       "(raise --max-steps to go on)")
                return
            for step in range(self.start_step, run.max_steps + 1):
                last_step = step == run.max_steps
                if step > self.start_step or not self.ckpt_path:  # the resumed step was evaluated before saving
                    self.evaluate(step, last_step)
                    if step > self.start_step and (last_step or (run.ckpt_every and step % run.ckpt_every == 0)):
                        self.save(step)
                if stop_agreed:
                    if self.last_ckpt != checkpoint_path(run.out_dir, step):
                        self.save(step)
                    print0(f"stopped by signal at step {step}; checkpoint {checkpoint_path(run.out_dir, step)}. "
                           f"Resume with the same command plus --resume")
                    break
                if last_step:
                    break
                result = self.train_step(step)
                stop_agreed = result.stop_requested
                step_times.append(result.dt)
                self.log_step(step, result)
        except Exception as e:
            self.raise_if_lost_rank(e)
            raise
        finally:
            self.prefetcher.close()
            self.stop.restore()
            self.log.close()
        self.print_summary(time.perf_counter() - t_start, step_times)

    def print_summary(self, elapsed: float, step_times: list[float]):
        """Totals, and the mean speed of the steps after this process's first (which compiles and warms up)."""
        if self.device_type == "cuda":
            peak_mem = f"{torch.cuda.max_memory_allocated(self.device) / 2**30:.2f} GiB GPU"
        else:
            import resource
            peak_mem = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB RSS"
        timed = step_times[1:] or step_times
        speed = ""
        if timed:
            tok_per_s, tok_per_gpu, mfu = self.throughput(sum(timed) / len(timed))
            speed = (f" | mean {tok_per_s:,.0f} tok/s ({tok_per_gpu:,.0f}/gpu" + (f", mfu {100 * mfu:.1f}%" if mfu else "")
                     + f") over {'steps after the first' if len(step_times) > 1 else 'the only step'}")
        print0(f"done: {len(step_times) * self.tokens_per_step:,} tokens in {elapsed:.1f}s{speed} | "
               f"peak memory {peak_mem}")


def train(run: RunConfig, model_cfg: GPTConfig, d: Dist):
    out_dir_lock = OutDirLock(run.out_dir)  # rank 0 takes it in Trainer(), once the input checks out
    try:
        check_ranks_agree(run, model_cfg)
        trainer = Trainer(run, model_cfg, d, out_dir_lock)
        if run.eval_only:
            trainer.evaluate_only()
        else:
            trainer.fit()
    except Exception as e:
        if is_out_of_memory(e):
            raise out_of_memory_error(e, d.device, None if run.eval_only else latest_checkpoint(run.out_dir)) from None
        raise
    finally:
        out_dir_lock.release()


# -----------------------------------------------------------------------------
# main


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the None/False ones whose help says what happens instead."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    defaults = RunConfig()
    p = cli.ArgumentParser(description="Pretrain GPT-2 on token shards (torchrun for several GPUs).",
                           formatter_class=HelpFormatter)
    g = p.add_argument_group("data and output")
    g.add_argument("--data-dir", default=defaults.data_dir, help="folder of *_train_*/*_val_* shards (.npy or llm.c .bin)")
    g.add_argument("--out-dir", default=defaults.out_dir, help="log.jsonl and checkpoints go here")
    g.add_argument("--align-docs", action="store_true", help="start rows at document boundaries; pad row tails (targets -1)")
    g.add_argument("--shuffle", action="store_true", help="seeded permutation of shard order and row order each epoch")
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=sorted(MODEL_PRESETS), help="size preset (default gpt2); the flags below override it")
    g.add_argument("--n-layer", type=int, help="transformer blocks")
    g.add_argument("--n-head", type=int, help="attention heads")
    g.add_argument("--n-embd", type=int, help="embedding width")
    g.add_argument("--block-size", type=int, help="longest sequence the model handles")
    g.add_argument("--vocab-size", type=int, help="vocabulary size (default 50304: GPT-2's 50257 padded)")
    g.add_argument("--init-from", help="start from Hugging Face GPT-2 weights: gpt2, gpt2-medium, gpt2-large, "
                   "gpt2-xl (Hub) or a local directory; sets the model shape")
    g = p.add_argument_group("batch")
    g.add_argument("--batch-size", type=int, default=defaults.batch_size, help="rows per rank per micro-step (B)")
    g.add_argument("--seq-len", type=int, help="tokens per row (T); default: the model's block size")
    g.add_argument("--total-batch-size", type=int, default=defaults.total_batch_size,
                   help="tokens per optimizer step over all ranks; a multiple of B x T x world size")
    g = p.add_argument_group("optimization")
    g.add_argument("--max-steps", type=int, default=defaults.max_steps, help="optimizer steps")
    g.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps, help="linear LR warmup steps")
    g.add_argument("--max-lr", type=float, default=defaults.max_lr, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=defaults.min_lr, help="final learning rate (default: 10%% of --max-lr)")
    g.add_argument("--lr-schedule", default=defaults.lr_schedule, choices=LR_SCHEDULES,
                   help="decay after warmup: cosine or linear to --min-lr at --max-steps; wsd holds --max-lr, "
                        "then decays linearly over the last --cooldown-frac of the steps")
    g.add_argument("--cooldown-frac", type=float, default=defaults.cooldown_frac,
                   help="wsd: fraction of --max-steps spent in the final linear decay")
    g.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="AdamW decay on matrices and embeddings")
    g.add_argument("--grad-clip", type=float, default=defaults.grad_clip, help="clip the gradient norm to this (0: off)")
    g = p.add_argument_group("evaluation and checkpoints (0 disables each)")
    g.add_argument("--val-every", type=int, default=defaults.val_every, help="validation loss every N steps")
    g.add_argument("--val-steps", type=int, default=defaults.val_steps, help="batches per validation")
    g.add_argument("--sample-every", type=int, default=defaults.sample_every, help="print text samples every N steps")
    g.add_argument("--hellaswag-every", type=int, default=defaults.hellaswag_every, help="HellaSwag accuracy every N steps")
    g.add_argument("--hellaswag-limit", type=int, default=defaults.hellaswag_limit, help="examples per HellaSwag eval (0: all)")
    g.add_argument("--hellaswag-file", default=defaults.hellaswag_file, help="local hellaswag_val.jsonl (default: download/cache)")
    g.add_argument("--ckpt-every", type=int, default=defaults.ckpt_every, help="checkpoint every N steps (and at the end)")
    g.add_argument("--keep-last", type=int, default=defaults.keep_last, help="keep only the newest K checkpoints (0: all)")
    g.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from the newest checkpoint in --out-dir (or the given path)")
    g.add_argument("--eval-only", action="store_true",
                   help="with --resume [PATH] or --init-from: run the evaluations above once at that step "
                        "(same numbers as in training), print them, train and write nothing")
    g = p.add_argument_group("run tracking (rank 0; each gets exactly the records of log.jsonl)")
    g.add_argument("--wandb", metavar="PROJECT", help="log to this Weights & Biases project (pip install wandb; "
                   "WANDB_MODE=offline keeps the run in OUT/wandb)")
    g.add_argument("--tensorboard", action="store_true",
                   help="write TensorBoard event files to --out-dir (pip install tensorboard)")
    g = p.add_argument_group("failures")
    g.add_argument("--skip-nonfinite", type=int, default=defaults.skip_nonfinite,
                   help="skip up to N steps with a non-finite loss or grad norm instead of stopping")
    g.add_argument("--skip-spikes", type=float, default=defaults.skip_spikes,
                   help="skip updates whose loss or grad norm is Z std devs above the recent window (0: off)")
    g.add_argument("--dist-timeout", type=float, default=defaults.dist_timeout,
                   help="seconds a collective may wait for a dead or stuck rank")
    g.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    g = p.add_argument_group("distributed")
    g.add_argument("--fsdp", action="store_true",
                   help="shard parameters, gradients and AdamW state over the ranks (FSDP2, under torchrun): "
                        "for models whose 16 bytes per parameter do not fit one GPU")
    g = p.add_argument_group("runtime")
    g.add_argument("--device", default=defaults.device,
                   help="auto (CUDA, else MPS, else CPU), cpu, cuda, cuda:N or mps (Apple; untested)")
    g.add_argument("--dtype", default=defaults.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="autocast dtype; auto: bfloat16 on CUDA GPUs of compute capability 8.0+, float16 "
                        "(with a GradScaler) on older ones, float32 elsewhere")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on for CUDA where Triton can run, off elsewhere); "
                        "a failure to compile falls back to eager with one line")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward: less memory, about 1/3 more compute")
    g.add_argument("--loss-chunk", type=int, default=defaults.loss_chunk,
                   help="compute lm_head + loss in chunks of N rows without materializing the logits "
                        f"(0: off; default {CPU_LOSS_CHUNK} on CPU, off on CUDA)")
    g.add_argument("--seed", type=int, default=defaults.seed, help="seed for init and shuffling")
    g.add_argument("--peak-tflops", type=float, default=defaults.peak_tflops,
                   help="dense peak TFLOP/s of one device, for MFU (default: looked up by GPU name; none on CPU)")
    return p


def build_configs(args: argparse.Namespace) -> tuple[RunConfig, GPTConfig]:
    model_fields = dict(MODEL_PRESETS[args.model or "gpt2"])
    if args.init_from:  # the weights set the shape; block_size None: theirs
        shape_flags = [flag for flag, value in (("--model", args.model), ("--n-layer", args.n_layer),
                                                ("--n-head", args.n_head), ("--n-embd", args.n_embd)) if value]
        if shape_flags:
            raise UserError(f"--init-from {args.init_from} takes the model's shape from its weights: drop "
                            f"{', '.join(shape_flags)} (--block-size and --vocab-size may still shrink or pad it)")
        model_fields = dict(block_size=None)
    for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        if getattr(args, name) is not None:
            model_fields[name] = getattr(args, name)
    model_cfg = GPTConfig(**model_fields)
    run = RunConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RunConfig)
                       if hasattr(args, f.name)})
    return run, model_cfg


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def setup_and_train():
        run, model_cfg = build_configs(args)
        validate_flag_values(run, model_cfg)
        with process_group(run.device, run.dist_timeout, lambda: latest_checkpoint(run.out_dir)) as d:
            train(run, model_cfg, d)
    return exit_code_on_every_rank(setup_and_train, args.debug)


if __name__ == "__main__":
    sys.exit(main())
