"""torch.compile for training: whether it can run here, the GPT compiled one block at a time, and
the cause of a failed first compiled step (the Trainer then goes on eagerly)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from trainkit.memory import is_out_of_memory


def compile_decision(
    requested: bool | None, device_type: str, capability: tuple[int, int] | None, platform: str, has_triton: bool
) -> tuple[bool, str | None]:
    """Whether to torch.compile (default: on CUDA only) and, when CUDA cannot, why not (Triton needs compute
    capability 7.0+ and an install)."""
    if requested is False or (requested is None and device_type != "cuda"):
        return False, None
    if device_type == "cuda":
        if capability is not None and capability < (7, 0):
            return False, f"compute capability {capability[0]}.{capability[1]} < 7.0, which Triton needs"
        if not has_triton:
            hint = "pip install triton-windows" if platform == "win32" else "pip install triton"
            return False, f"Triton is not installed ({hint})"
    return True, None


def compile_model(model: nn.Module, **options) -> nn.Module:
    """The GPT the training step runs, compiled one block at a time (dynamo traces one block, the others
    reuse its code) with its full_loss: a shallow copy of model sharing its parameters; model stays eager
    for evaluation, sampling and checkpoints. The embeddings and chunked loss stay eager (traced, 64
    chunks took 105 s to compile on CPU). Why, and DDP's overlap: docs/performance.md."""
    # the blocks already overlap DDP's all-reduce; its graph cuts (25 MB buckets, 28 MB blocks) cost fusion
    torch._dynamo.config.optimize_ddp = False  # read when a block is first traced
    compiled = copy.copy(model)
    compiled._modules = dict(model._modules)  # copy.copy shares the dict: model would get the wrappers too
    blocks = nn.ModuleList(torch.compile(block, **options) for block in model.transformer.h)
    compiled.transformer = nn.ModuleDict({**model.transformer, "h": blocks})
    compiled.full_loss = torch.compile(model.full_loss, **options)
    object.__setattr__(compiled, "_orig_mod", model)  # as torch.compile's wrapper: unwrap_model gives model
    return compiled


def compile_failure_cause(e: BaseException) -> BaseException:
    """The root cause of a failed first compiled step; an out-of-memory is raised instead (no compiler failure)."""
    while (inner := getattr(e, "inner_exception", None) or e.__cause__) is not None:
        e = inner
    if is_out_of_memory(e):
        raise e from None
    return e
