"""The autocast dtype of a device: bf16, fp16 with a GradScaler, or fp32 (where autocast is off), and
whether a run compiles."""

from __future__ import annotations

import importlib.util
import sys

import torch

from trainkit.cli import UserError
from trainkit.compiling import compile_decision
from trainkit.console import print0


def resolve_dtype(name: str, device_type: str, capability: tuple[int, int] | None = None) -> torch.dtype:
    """The autocast dtype; auto: bf16 on CUDA 8.0+ (Ampere on), fp16 on older GPUs, fp32 elsewhere."""
    if name == "auto":
        name = "float32"
        if device_type == "cuda":
            name = "bfloat16" if capability is None or capability >= (8, 0) else "float16"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def choose_precision_and_compile(run, dist_state) -> tuple[torch.dtype, bool]:
    """The autocast dtype and whether to compile."""
    capability = torch.cuda.get_device_capability(dist_state.device) if dist_state.device_type == "cuda" else None
    dtype = resolve_dtype(run.dtype, dist_state.device_type, capability)
    if run.fsdp and dtype == torch.float16:  # each rank's scaler would see only its shard's overflows
        raise UserError(
            "--fsdp does not support float16 (its GradScaler needs every rank to agree on "
            "overflows): pass --dtype bfloat16 on Ampere or newer, --dtype float32, or drop --fsdp"
        )
    compiled, why_not = compile_decision(
        run.compile, dist_state.device_type, capability, sys.platform, importlib.util.find_spec("triton") is not None
    )
    if why_not:
        print0(f"compile off: {why_not}")
    if dist_state.device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls
    return dtype, compiled
