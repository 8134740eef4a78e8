"""The step line's speed and progress fields: the per-device rate where there is more than one
process, and the time elapsed and left. Standard library only."""


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
