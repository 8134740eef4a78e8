"""FSDP2 (--fsdp): each rank holds 1/W of every parameter, gradient and AdamW state.

What the trainer's step needs of it: shard_model to build it, fsdp_no_sync as the counterpart
of DDP's no_sync on every micro-step but the last, and local_part for checks on what a rank holds.
Checkpoints gather the full state (checkpoints.full_state), so any mode resumes any other.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


def local_part(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of t: its shard if t is sharded (a DTensor under --fsdp), else t."""
    return t.to_local() if hasattr(t, "to_local") else t


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_model(model: nn.Module, dist_state, dtype: torch.dtype, compile_block=None) -> nn.Module:
    """FSDP2, in place, on a GPT (dist_state: launch.Dist): every block, then the root (embeddings, the tied wte/lm_head, ln_f),
    sharded over the ranks, each rank keeping 1/W of every parameter, gradient and AdamW state.
    The parameters move to dist_state.device one fully_shard call at a time, so a model built on the
    CPU is never whole on the GPU. With a low-precision dtype, forward and backward run on
    gathered parameters cast to it and gradients are reduced in fp32. compile_block (e.g.
    torch.compile) wraps each block before it is sharded: torch's advice is to compile the
    module inside FSDP, and per block as torchtitan does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(dist_state.device_type, (dist_state.world_size,))
    policy = (
        MixedPrecisionPolicy()
        if dtype == torch.float32
        else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    )
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


def uncompile_blocks(model: nn.Module):
    """Run the blocks that shard_model compiled eagerly (after a failed compile): FSDP's hooks
    stay on the compiled wrappers, whose forward becomes the plain block."""
    compiled = [block for block in model.transformer.h if hasattr(block, "_orig_mod")]
    if compiled and hasattr(model, "reset_iter_state"):  # torch 2.13+: the failed step left FSDP mid-forward
        model.reset_iter_state()
    for block in compiled:
        block.forward = block._orig_mod.__call__  # a method, not a module: setattr would register a child


@contextlib.contextmanager
def fsdp_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
