"""The autocast dtype of a device: bf16, fp16 with a GradScaler, or fp32 (where autocast is off)."""

from __future__ import annotations

import torch


def resolve_dtype(name: str, device_type: str, capability: tuple[int, int] | None = None) -> torch.dtype:
    """The autocast dtype. auto: bf16 on CUDA GPUs that have bf16 tensor cores (compute capability
    8.0+, Ampere on), fp16 with a GradScaler on older ones (T4, V100, RTX 20xx), fp32 elsewhere."""
    if name == "auto":
        name = "float32"
        if device_type == "cuda":
            name = "bfloat16" if capability is None or capability >= (8, 0) else "float16"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
