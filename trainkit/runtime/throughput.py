"""How fast a run goes: tokens per second, MFU against a GPU's dense peak (datasheets, or --peak-tflops), and
the step line and its log record (docs/output.md)."""

from __future__ import annotations

import re

import torch

# --- tokens per second and MFU --------------------------------------------------------------------

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


def flops_per_token(cfg, T: int, n_params: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward + backward matmuls) plus attention's
    QK^T and AV, 12 * n_layer * n_embd * T (PaLM appendix B; causal masking not discounted)."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.n_embd * T


def mfu_peak(peak_tflops: float | None, device: str, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of one device for MFU: --peak-tflops, else the table's for a CUDA GPU in bf16/fp16, else None."""
    if peak_tflops:
        return peak_tflops * 1e12
    if torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return peak_flops(torch.cuda.get_device_name(device))
    return None


class Throughput:
    """tok/s of all ranks and per GPU, and MFU = FLOPs / (dt x W x one GPU's peak), of tokens_per_step-token steps."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak, world_size: int, device_type: str):
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak
        self.W, self.device_type = world_size, device_type  # the per-device rate: /gpu on CUDA, /rank elsewhere

    def of(self, dt: float) -> tuple[float, float, float | None]:
        """(tok/s of all ranks, tok/s per GPU, MFU per GPU or None) of a step that took dt."""
        tok_per_s = self.tokens_per_step / dt
        mfu = self.flops_per_token * self.tokens_per_step / (dt * self.W * self.peak) if self.peak else None
        return tok_per_s, tok_per_s / self.W, mfu

    def summary(self, step_times: list[float], elapsed: float, peak_mem: str) -> str:
        """Totals, and the mean speed of the steps after this process's first (which compiles and warms up)."""
        timed = step_times[1:] or step_times
        speed = ""
        if timed:
            tok_per_s, tok_per_gpu, mfu = self.of(sum(timed) / len(timed))
            per_device = per_device_rate(tok_per_gpu, self.W, self.device_type).strip(" ()")
            rates = ", ".join(part for part in (per_device, f"mfu {100 * mfu:.1f}%" if mfu else "") if part)
            speed = f" | mean {tok_per_s:,.0f} tok/s" + (f" ({rates})" if rates else "")
            speed += f" over {'steps after the first' if len(step_times) > 1 else 'the only step'}"
        done = f"done: {len(step_times) * self.tokens_per_step:,} tokens in {elapsed:.1f}s"
        return f"{done}{speed} | peak memory {peak_mem}"


# --- the step line's fields -----------------------------------------------------------------------


def per_device_rate(tok_per_device: float, world_size: int, device_type: str) -> str:
    """' (N/gpu)' or ' (N/rank)' after the tok/s of all ranks; '' for one CPU process."""
    if world_size == 1 and device_type != "cuda":
        return ""
    return f" ({tok_per_device:,.0f}/{'gpu' if device_type == 'cuda' else 'rank'})"


def duration(seconds: float) -> str:
    """'42s', '3m07s', '2h05m': short, and to the second only below an hour."""
    s = max(0, round(seconds))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def elapsed_and_eta(elapsed: float, step_times: list[float], steps_left: int) -> str:
    """' | elapsed 1m02s | eta 3m10s': eta = steps_left x the mean step after the first (evaluations not counted)."""
    fields = f" | elapsed {duration(elapsed)}"
    timed = step_times[1:] or step_times
    if timed and steps_left > 0:
        fields += f" | eta {duration(steps_left * sum(timed) / len(timed))}"
    return fields


def step_line(step: int, max_steps: int, r, rates, world_size: int, device_type: str, progress: str) -> tuple:
    """(the step's line, its log.jsonl record) of r, the trainer's StepResult; rates: Throughput.of(r.dt)'s
    (tok/s, tok/s per device, MFU or None); progress: elapsed_and_eta's fields."""
    tok_per_s, tok_per_gpu, mfu = rates
    line = (
        f"step {step:5d}/{max_steps} | loss {r.loss:.6f} | lr {r.lr:.4e} | norm {r.grad_norm:.4f} | "
        f"dt {1000 * r.dt:.1f}ms | tok/s {tok_per_s:,.0f}"
        + per_device_rate(tok_per_gpu, world_size, device_type)
        + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else "")
        + (f" | skipped ({r.skipped})" if r.skipped else "")
        + progress
    )
    record = dict(step=step, loss=r.loss, lr=r.lr, grad_norm=r.grad_norm, tokens=r.n_tokens, dt_ms=1000 * r.dt)
    record.update(tok_per_s=tok_per_s, tok_per_s_per_gpu=tok_per_gpu, mfu=mfu, skipped=r.skipped)
    return line, {k: v for k, v in record.items() if v is not None}  # (no mfu on CPU; skipped: rarely)
