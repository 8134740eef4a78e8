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


def compile_model(model: nn.Module, **options) -> nn.Module:
    """The GPT the training step runs, compiled one block at a time: a shallow copy of model, with
    the same parameters, whose blocks are torch.compile wrappers of model's blocks and whose
    full-logits loss (lm_head + cross-entropy, full_loss) is compiled too. The blocks are
    identical but for their parameters, which dynamo takes as graph inputs: it traces the first
    block and every other one reuses that code, so compiling costs one block whatever the depth
    (the whole GPT as one graph traced all of them: docs/performance.md). The embeddings and the
    chunked loss stay eager; traced, the chunk loop would be unrolled (64 chunks: 105 s to
    compile on CPU; 256 never finished). DDP wraps the copy: its hooks fire as each block's
    backward ends, so the all-reduce of the later blocks overlaps the backward of the earlier ones.
    Dynamo's DDP optimizer, which splits a graph at DDP's bucket boundaries to get that overlap
    inside one graph, is turned off: the blocks already give it, and its cuts through a block
    (25 MB buckets; GPT-2 124M's blocks hold 28 MB) would only cost fusion.
    model itself stays eager, for evaluation, sampling and checkpoints (no `_orig_mod.` in its
    names), and torch.compile's options (backend, mode) apply to each compiled part."""
    torch._dynamo.config.optimize_ddp = False  # read when a block is first traced
    compiled = copy.copy(model)
    compiled._modules = dict(model._modules)  # copy.copy shares the dict: model would get the wrappers too
    blocks = nn.ModuleList(torch.compile(block, **options) for block in model.transformer.h)
    compiled.transformer = nn.ModuleDict({**model.transformer, "h": blocks})
    compiled.full_loss = torch.compile(model.full_loss, **options)
    object.__setattr__(compiled, "_orig_mod", model)  # as torch.compile's wrapper: unwrap_model gives model
    return compiled


def compile_failure_cause(e: BaseException) -> BaseException:
    """The root cause of a failed first compiled step (dynamo wraps the backend's error). An
    out-of-memory is no failure of the compiler: it is raised (the step redoes itself smaller: fit_batch.py)."""
    while (inner := getattr(e, "inner_exception", None) or e.__cause__) is not None:
        e = inner
    if is_out_of_memory(e):
        raise e from None
    return e
