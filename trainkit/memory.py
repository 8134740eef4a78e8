"""Memory: whether a model fits the device before anything is allocated, what an out-of-memory error
is and the one line that ends a run on it, and the most memory a run held."""
from __future__ import annotations

import contextlib
import os
import re

import torch

from trainkit import cli
from trainkit.cli import UserError, one_line


def device_memory(device: str, device_type: str) -> tuple[int, str] | None:
    """(bytes, what they are) of the memory the model lives in, None where unknown (MPS)."""
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the {props.name}'s memory"
    if device_type == "cpu" and hasattr(os, "sysconf"):
        with contextlib.suppress(ValueError, OSError):
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
    return None


def check_model_fits(n_params: int, d, fsdp: bool, training: bool):
    """Refuse a model of n_params parameters whose weights (evaluation) or weights, gradients and AdamW moments (training,
    16 bytes per parameter) exceed the device's memory before any of it is allocated: a huge
    allocation fails with a traceback, and many smaller ones end in the kernel's OOM killer."""
    memory = device_memory(d.device, d.device_type)
    if memory is None:
        return
    n, bytes_per_param = n_params, 16 if training else 4
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


def out_of_memory_reason(e: BaseException) -> str:
    """'tried to allocate 2.00 GiB' out of an allocator's long message, else the message."""
    # CUDA: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ..."; CPU: "[enforce fail at
    # alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 411041792 bytes. ..."
    tried = re.search(r"tried to allocate [^.]*(\.\d+ \w+)?", one_line(e), re.I)
    return tried[0] if tried else one_line(e)


def out_of_memory_error(e: BaseException, device: str, last_ckpt: str | None, micro_batch: int | None = None,
                        auto: bool = False) -> cli.RankLocalError:
    """The line for an out-of-memory that ends the run. micro_batch: the rows per micro-step it ran
    out at, which --batch-size auto chose (auto; None: before it chose) or the user did. At one row
    fewer rows cannot help, and under auto the user named no --batch-size: the advice names what else
    shrinks a step."""
    if auto and micro_batch is None:  # the search itself, before its first trial
        advice = ("--batch-size auto could not try even one row per micro-step: pass --activation-checkpointing, "
                  "a shorter --seq-len or a smaller model")
    elif micro_batch == 1:
        advice = (f"not even one row per micro-step fits{' (--batch-size auto chose 1)' * auto}: pass "
                  "--activation-checkpointing, a shorter --seq-len or a smaller model")
    elif auto:
        advice = (f"--batch-size auto chose {micro_batch} rows per micro-step, which fit its trial but not this step: "
                  "pass a smaller --batch-size, --activation-checkpointing or a shorter --seq-len")
    else:
        advice = ("lower --batch-size (--total-batch-size stays the same through more accumulation steps) or pass "
                  "--activation-checkpointing")
    return cli.RankLocalError(f"out of memory on {device} ({out_of_memory_reason(e)}): {advice}. Last good "
                              f"checkpoint: {last_ckpt or 'none'}")


def peak_memory(device: str) -> str:
    """The most memory this process held: CUDA's allocated peak, else the process's peak RSS."""
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB GPU"
    import resource
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB RSS"
