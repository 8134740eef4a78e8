"""The step line and its log record: the loss and speed fields, the per-device rate where there is more
than one process, and the time elapsed and left. Standard library only."""


def per_device_rate(tok_per_device: float, world_size: int, device_type: str) -> str:
    """' (N/gpu)' or ' (N/rank)' after the tok/s of all ranks; '' for one CPU process."""
    if world_size == 1 and device_type != "cuda":
        return ""
    return f" ({tok_per_device:,.0f}/{'gpu' if device_type == 'cuda' else 'rank'})"


def per_device_and_mfu(tok_per_device: float, world_size: int, device_type: str, mfu: float | None) -> str:
    """' (N/gpu, mfu X%)' for the run's summary line: per_device_rate's number and the MFU, whichever there are."""
    parts = [per_device_rate(tok_per_device, world_size, device_type).strip(" ()")] + (
        [f"mfu {100 * mfu:.1f}%"] if mfu else []
    )
    return f" ({', '.join(part for part in parts if part)})" if any(parts) else ""


def duration(seconds: float) -> str:
    """'42s', '3m07s', '2h05m': short, and to the second only below an hour."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def elapsed_and_eta(elapsed: float, step_times: list[float], steps_left: int) -> str:
    """' | elapsed 1m02s | eta 3m10s': the time since the loop began, and steps_left times the mean step
    time after the first (which compiles; evaluations to come not counted)."""
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
