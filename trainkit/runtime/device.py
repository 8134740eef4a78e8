"""The device: the autocast dtype, whether a model fits and what an out-of-memory error is, the run's
peak memory, torch.compile, and FSDP2's sharding.

The autocast dtype of a device: bf16, fp16 with a GradScaler, or fp32 (where autocast is off), and
whether a run compiles.

Memory: whether a model fits the device before anything is allocated, what an out-of-memory error
is and the one line that ends a run on it, and the most memory a run held (on the host: its own, apart
from the token shards' pages it maps).

The host's part: a process's RSS (and its peak, ru_maxrss / VmHWM) counts the pages of every file it maps:
a run that reads 10B tokens of memory-mapped shards shows ~20 GB of RSS that are the kernel's page cache,
shared with every other process and dropped under pressure, not memory the run needs. The run's own memory
is its anonymous (private) memory, RssAnon in /proc/self/status; the kernel keeps no peak of it alone, so
watch_peak() samples it every SAMPLE_EVERY_S on a daemon thread (a spike shorter than that can be missed)
and peak_report() adds a last sample. The mapped data pages (.bin / .npy files: shards, kept row tables)
are summed from /proc/self/smaps and reported apart. Where /proc is not there (macOS), the peak RSS.
Runs nothing at import.

torch.compile for training: whether it can run here, the GPT compiled one block at a time, and
the cause of a failed first compiled step (the Trainer then goes on eagerly).

FSDP2 (--fsdp): each rank holds 1/W of every parameter, gradient and AdamW state. shard_model builds it,
fsdp_no_sync is DDP's no_sync, local_part what a rank holds; checkpoints gather the full state.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import re
import sys
import threading

import torch
import torch.nn as nn

from trainkit import cli
from trainkit.cli import UserError, print0, reason_of

# --- precision ------------------------------------------------------------------------------------


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


# --- memory ---------------------------------------------------------------------------------------


def device_memory(device: str, device_type: str) -> tuple[int, str] | None:
    """(bytes, what they are) of the memory the model lives in, None where unknown (MPS)."""
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the {props.name}'s memory"
    if device_type == "cpu" and hasattr(os, "sysconf"):
        with contextlib.suppress(ValueError, OSError):
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
    return None


def check_model_fits(n_params: int, dist_state, fsdp: bool, training: bool):
    """Refuse a model of n_params parameters whose weights (evaluation) or weights, gradients and AdamW moments (training,
    16 bytes per parameter) exceed the device's memory before any of it is allocated: a huge
    allocation fails with a traceback, and many smaller ones end in the kernel's OOM killer."""
    memory = device_memory(dist_state.device, dist_state.device_type)
    if memory is None:
        return
    n, bytes_per_param = n_params, 16 if training else 4
    need = n * bytes_per_param / (dist_state.world_size if fsdp else 1)
    if dist_state.device_type == "cpu":  # the ranks of this node share its RAM
        need *= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if need > memory[0]:
        what = "weights, gradients and AdamW state" if training else "weights"
        raise UserError(
            f"the model has {n / 1e9:.3g}B parameters: its {what} ({bytes_per_param} bytes per parameter"
            f"{', sharded by --fsdp' if fsdp else ''}) need {need / 2**30:.3g} GiB, more than "
            f"{memory[1]} ({memory[0] / 2**30:.3g} GiB): choose a smaller --model or --n-layer, "
            "--n-embd, --vocab-size, --block-size" + ("" if fsdp or dist_state.world_size < 2 else ", or --fsdp")
        )


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
    )  # the CPU allocator's message


def out_of_memory_reason(e: BaseException) -> str:
    """'tried to allocate 2.00 GiB' out of an allocator's long message, else the message."""
    # CUDA: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ..."; CPU: "[enforce fail at
    # alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 411041792 bytes. ..."
    tried = re.search(r"tried to allocate [^.]*(\.\d+ \w+)?", reason_of(e), re.I)
    return tried[0] if tried else reason_of(e)


def out_of_memory_error(
    e: BaseException, device: str, last_ckpt: str | None, asked: int | str | None, ran_at: int | None = None
) -> cli.RankLocalError:
    """The line for an out-of-memory that ends the run. asked: --batch-size as the launch had it (rows, "auto", or
    None before it was resolved); ran_at: the rows per micro-step the steps ran at (None: no step was set up).
    At one row fewer rows cannot help, and under auto the user named no --batch-size: the advice names what else
    shrinks a step. A MemoryError raised by a library's import is no step's (cli.out_of_host_memory's line);
    under an address-space limit (ulimit -v) the line names it too."""
    if isinstance(e, MemoryError) and cli.raised_in_import(e):
        return cli.RankLocalError(cli.out_of_host_memory(e))
    auto = asked == "auto"
    micro_batch = ran_at if ran_at is not None else None if auto else asked  # (None: auto had chosen none)
    if auto and micro_batch is None:  # the search itself, before its first trial
        advice = (
            "--batch-size auto could not try even one row per micro-step: pass --activation-checkpointing, "
            "a shorter --seq-len or a smaller model"
        )
    elif micro_batch == 1:
        advice = (
            f"not even one row per micro-step fits{' (--batch-size auto chose 1)' * auto}: pass "
            "--activation-checkpointing, a shorter --seq-len or a smaller model"
        )
    elif auto:
        advice = (
            f"--batch-size auto chose {micro_batch} rows per micro-step, which fit its trial but not this step: "
            "pass a smaller --batch-size, --activation-checkpointing or a shorter --seq-len"
        )
    else:
        advice = (
            "lower --batch-size (--total-batch-size stays the same through more accumulation steps) or pass "
            "--activation-checkpointing"
        )
    limit = cli.memory_limit() if torch.device(device).type == "cpu" or isinstance(e, MemoryError) else None
    advice += f"; or raise the memory limit this process runs under ({limit})" if limit else ""
    return cli.RankLocalError(
        f"out of memory on {device} ({out_of_memory_reason(e)}): {advice}. Last good checkpoint: {last_ckpt or 'none'}"
    )


def peak_memory(device: str) -> str:
    """The most memory this process held: CUDA's allocated peak, else its own private peak (peak_report)."""
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB GPU"
    return peak_report()


# --- the host memory a run reports as its own ----------------------------------------------------

SAMPLE_EVERY_S = 0.05
DATA_SUFFIXES = (".bin", ".npy")


def _status_kib(key: str) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


class _PeakWatch:
    def __init__(self):
        self.peak_kib = 0
        self.thread = None

    def sample(self) -> bool:
        kib = _status_kib("RssAnon")
        if kib is None:
            return False
        self.peak_kib = max(self.peak_kib, kib)
        return True

    def start(self):
        # Under an address-space limit (ulimit -v, RLIMIT_AS) a thread's stack and malloc arena (some 72 MB of
        # address space) would be taken from what --batch-size auto's search measured: there the peak is
        # sampled where the steps end (sample_peak) and where it is reported
        import resource

        limited = resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY
        if self.thread is None and self.sample() and not limited:
            self.thread = threading.Thread(target=self._run, name="memory watch", daemon=True)
            self.thread.start()

    def _run(self):
        stop = threading.Event()  # never set: the thread ends with the process
        while not stop.wait(SAMPLE_EVERY_S):
            self.sample()


_watch = _PeakWatch()


def watch_peak():
    """Start sampling this process's private memory (once; a no-op where /proc is not there)."""
    _watch.start()


def sample_peak():
    """One sample of the private memory now (where no thread samples it: an address-space limit)."""
    if _watch.thread is None:
        _watch.sample()


def mapped_data_kib() -> int:
    """Resident pages of the mapped .bin / .npy files (token shards, kept row tables), in KiB."""
    total, counting = 0, False
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header: address range ... path
                counting = line.rstrip().endswith(DATA_SUFFIXES)
            elif counting and first == "Rss:":
                total += int(line.split()[1])
    return total


def peak_report() -> str:
    """ "X GiB private (+ Y GiB of mapped shard pages, shared)": the run's own peak, and the data pages
    it maps apart; the peak RSS where /proc is not there."""
    if not _watch.sample():
        import resource
        import sys

        scale = 2**30 if sys.platform == "darwin" else 2**20  # ru_maxrss: bytes on macOS, KiB on Linux
        return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale:.2f} GiB RSS"
    mapped = mapped_data_kib()
    shards = f" (+ {mapped / 2**20:.2f} GiB of mapped shard pages, shared page cache)" if mapped else ""
    return f"{_watch.peak_kib / 2**20:.2f} GiB private{shards}"


# --- compiling ------------------------------------------------------------------------------------


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


# --- FSDP2 ----------------------------------------------------------------------------------------


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
