"""The device: autocast dtype and compile, whether a model fits, the out-of-memory line, the run's peak memory
(docs/output.md), torch.compile one block at a time (docs/performance.md) and FSDP2's sharding (docs/fsdp.md)."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import re
import sys
import threading
import time
import types

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
    triton = importlib.util.find_spec("triton") is not None
    compiled, why_not = compile_decision(run.compile, dist_state.device_type, capability, sys.platform, triton)
    if why_not:
        print0(f"compile off: {why_not}")
    if dist_state.device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls
    return dtype, compiled


# --- memory ---------------------------------------------------------------------------------------


def check_model_fits(n_params: int, dist_state, fsdp: bool, training: bool):
    """Refuse, before allocating, a model whose weights (evaluation) or weights, gradients and AdamW moments
    (training: 16 bytes per parameter) exceed the device's memory (else a traceback, or the OOM killer)."""
    memory = None  # (bytes, what they are): unknown on MPS
    if dist_state.device_type == "cuda":
        props = torch.cuda.get_device_properties(dist_state.device)
        memory = props.total_memory, f"the {props.name}'s memory"
    elif dist_state.device_type == "cpu" and hasattr(os, "sysconf"):
        with contextlib.suppress(ValueError, OSError):
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
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
    cpu_allocator = isinstance(e, RuntimeError) and "can't allocate memory" in str(e)  # (its message)
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or cpu_allocator


def out_of_memory_reason(e: BaseException) -> str:
    """'tried to allocate 2.00 GiB' out of an allocator's long message, else the message."""
    # CUDA: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ..."; CPU: "[enforce fail at
    # alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 411041792 bytes. ..."
    tried = re.search(r"tried to allocate [^.]*(\.\d+ \w+)?", reason_of(e), re.I)
    return tried[0] if tried else reason_of(e)


def out_of_memory_error(
    e: BaseException, device: str, last_ckpt: str | None, asked: int | str | None, ran_at: int | None = None
) -> cli.RankLocalError:
    """The line for an out-of-memory that ends the run; asked: --batch-size as launched (rows, "auto", None before
    it was resolved), ran_at: the rows the steps ran at (None: none set up). The advice names what else can shrink."""
    if isinstance(e, MemoryError) and cli.raised_in_import(e):
        return cli.RankLocalError(cli.out_of_host_memory(e))
    auto = asked == "auto"
    micro_batch = ran_at if ran_at is not None else None if auto else asked  # (None: auto had chosen none)
    smaller = "--activation-checkpointing, a shorter --seq-len or a smaller model"
    if auto and micro_batch is None:  # the search itself, before its first trial
        advice = f"--batch-size auto could not try even one row per micro-step: pass {smaller}"
    elif micro_batch == 1:
        advice = f"not even one row per micro-step fits{' (--batch-size auto chose 1)' * auto}: pass {smaller}"
    elif auto:
        advice = (
            f"--batch-size auto chose {micro_batch} rows per micro-step, which fit its trial but not this step: "
            "pass a smaller --batch-size, --activation-checkpointing or a shorter --seq-len"
        )
    else:
        advice = "lower --batch-size (--total-batch-size stays the same through more accumulation steps) or pass --activation-checkpointing"
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
_watch = types.SimpleNamespace(peak=0, thread=None)  # the private memory's peak (bytes) and its sampler


def proc_kib(path: str, key: str) -> int | None:
    """A `key:  N kB` line of a /proc file, in bytes (None where there is none)."""
    with contextlib.suppress(OSError, ValueError, IndexError, StopIteration), open(path) as f:
        return 1024 * int(next(line.split()[1] for line in f if line.startswith(key + ":")))
    return None


def _sample() -> bool:
    """One sample of the private memory (RssAnon) into the peak; False where /proc is not there."""
    now = proc_kib("/proc/self/status", "RssAnon")
    _watch.peak = max(_watch.peak, now or 0)
    return now is not None


def sample_peak():
    """One sample where no thread takes them (under an address-space limit)."""
    if _watch.thread is None:
        _sample()


def watch_peak():
    """Sample the private memory every SAMPLE_EVERY_S on a daemon thread (once); not under ulimit -v, where its
    stack and arena (~72 MB of address space) would shrink what --batch-size auto measured (sample_peak then)."""
    import resource

    limited = resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY
    if _watch.thread is None and _sample() and not limited:
        _watch.thread = threading.Thread(target=_sample_forever, name="memory watch", daemon=True)
        _watch.thread.start()


def _sample_forever():
    while True:  # (a daemon thread: it ends with the process)
        time.sleep(SAMPLE_EVERY_S)
        _sample()


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
    """ "X GiB private (+ Y GiB of mapped shard pages, shared)"; the peak RSS where /proc is not there."""
    if not _sample():
        import resource

        scale = 2**30 if sys.platform == "darwin" else 2**20  # ru_maxrss: bytes on macOS, KiB on Linux
        return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale:.2f} GiB RSS"
    mapped = mapped_data_kib()
    shards = f" (+ {mapped / 2**20:.2f} GiB of mapped shard pages, shared page cache)" if mapped else ""
    return f"{_watch.peak / 2**30:.2f} GiB private{shards}"


# --- compiling ------------------------------------------------------------------------------------


def compile_decision(
    requested: bool | None, device_type: str, capability: tuple[int, int] | None, platform: str, has_triton: bool
) -> tuple[bool, str | None]:
    """Whether to torch.compile (default: on CUDA only) and, when CUDA cannot (Triton: 7.0+, installed), why not."""
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
    """The GPT the step runs: a shallow copy of model (which stays eager) with each block and full_loss compiled;
    the embeddings and chunked loss stay eager (traced, 64 chunks took 105 s to compile on CPU)."""
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
    """FSDP2 in place on a GPT: each block, then the root, sharded onto the device (never whole on it); a low
    precision computes in dtype, reduces in fp32. compile_block wraps each block first (as torchtitan)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(dist_state.device_type, (dist_state.world_size,))
    low_precision = {} if dtype == torch.float32 else dict(param_dtype=dtype, reduce_dtype=torch.float32)
    policy = MixedPrecisionPolicy(**low_precision)
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
