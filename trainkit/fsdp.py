"""FSDP2 (--fsdp): each rank holds 1/W of every parameter, gradient and AdamW state. shard_model builds it,
fsdp_no_sync is DDP's no_sync, local_part what a rank holds; checkpoints gather the full state.
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
    """FSDP2 in place on a GPT (dist_state: launch.Dist): each block, then the root, moved to
    dist_state.device one at a time
    (never whole on the GPU); a low-precision dtype computes in it and reduces in fp32. compile_block wraps
    each block before it is sharded (torch's advice; per block as torchtitan)."""
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
    # the root stays gathered after forward: backward needs it at once, and scoring calls lm_head after
    # hidden_states (registered as a forward, so that it gathers)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    register_fsdp_forward_method(model, "hidden_states")
    return model


def uncompile_blocks(model: nn.Module):
    """Run the blocks shard_model compiled eagerly (after a failed compile); FSDP's hooks stay on the wrappers."""
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
