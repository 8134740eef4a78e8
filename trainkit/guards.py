"""What stops a run cleanly or keeps a bad step from doing harm, and the numbers that say how
well the hardware is used: stop signals (finish the step, checkpoint, exit 0), the non-finite
and spike guard on each update, the memory-fit check and the out-of-memory line, and the GPU
peak table behind MFU.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import signal

import torch

from trainkit import cli, memory
from trainkit.cli import UserError, reason_of
from trainkit.fsdp import local_part
from trainkit.launch import all_reduce_sum
from trainkit.progress import per_device_and_mfu

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
    """Peak FLOP/s of one device for MFU: --peak-tflops, else the table's figure for a CUDA GPU
    running bf16/fp16 (the table holds tensor-core figures), else None (no MFU shown)."""
    if peak_tflops:
        return peak_tflops * 1e12
    if torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return peak_flops(torch.cuda.get_device_name(device))
    return None


class Throughput:
    """Speed of steps that each process tokens_per_step tokens on all ranks (padding included):
    tok/s of all ranks, per GPU, and MFU per GPU = FLOPs of all ranks / (dt x W x peak of one GPU)."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak: float | None, world_size: int,
                 device_type: str):
        self.tokens_per_step, self.flops_per_token, self.peak, self.W = tokens_per_step, flops_per_token, peak, world_size
        self.device_type = device_type  # the per-device rate reads /gpu on CUDA, /rank elsewhere (trainkit/progress.py)

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
            speed = (f" | mean {tok_per_s:,.0f} tok/s" + per_device_and_mfu(tok_per_gpu, self.W, self.device_type, mfu)
                     + f" over {'steps after the first' if len(step_times) > 1 else 'the only step'}")
        return f"done: {len(step_times) * self.tokens_per_step:,} tokens in {elapsed:.1f}s{speed} | peak memory {peak_mem}"


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


def compile_failure_cause(e: BaseException) -> BaseException:
    """The root cause of a failed first compiled step (dynamo wraps the backend's error). An
    out-of-memory is no failure of the compiler: it is raised (fit_batch.retry_on_oom's business)."""
    while (inner := getattr(e, "inner_exception", None) or e.__cause__) is not None:
        e = inner
    if is_out_of_memory(e):
        raise e from None
    return e


def out_of_memory_reason(e: BaseException) -> str:
    """'tried to allocate 2.00 GiB' out of an allocator's long message, else the message."""
    # CUDA: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ..."; CPU: "[enforce fail at
    # alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 411041792 bytes. ..."
    tried = re.search(r"tried to allocate [^.]*(\.\d+ \w+)?", reason_of(e), re.I)
    return tried[0] if tried else reason_of(e)


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


# a stop as requested: preemption, Ctrl-C, and a closed terminal or ssh session (no SIGHUP on Windows)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))


class StopSignal:
    """SIGTERM, SIGINT and SIGHUP ask the run to finish its step, checkpoint and exit 0; a second
    SIGINT aborts. at_once (an evaluation, which has nothing to save): every one ends it there,
    as cli.Interrupted (exit code 128 + signum)."""

    def __init__(self, at_once: bool = False):
        self.requested, self.at_once = False, at_once
        self.terminal_fds = [fd for fd in (1, 2) if os.isatty(fd)]  # a hung-up terminal no longer says it is one
        self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def _handle(self, signum, frame):
        if signum == getattr(signal, "SIGHUP", None):
            self.leave_terminal()
        if self.at_once or (self.requested and signum == signal.SIGINT):
            raise cli.Interrupted(signum)
        self.requested = True

    def leave_terminal(self):
        """After SIGHUP the terminal is gone and writing to it fails (EIO), which would end the run
        before its checkpoint: what went to the terminal goes to /dev/null (files and pipes still get theirs)."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in self.terminal_fds:
            os.dup2(devnull, fd)
        os.close(devnull)

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def ignore_sigterm_from_now(self):
        """After another rank died torchrun SIGTERMs the survivors: this one still prints its line."""
        self.previous[signal.SIGTERM] = signal.SIG_IGN


class SpikeDetector:
    """Flags a value more than z standard deviations above the mean of a recent window.

    Every value enters the window, flagged or not: after a lasting shift (new data) the window
    moves to the new level within a few steps, instead of flagging every later value."""

    def __init__(self, z: float, window: int = 50, warmup: int = 20):
        self.z, self.window, self.warmup, self.values = z, window, warmup, []

    def is_spike(self, value: float) -> bool:
        spike = False
        if self.z and len(self.values) >= self.warmup:
            mean = sum(self.values) / len(self.values)
            std = (sum((v - mean) ** 2 for v in self.values) / len(self.values)) ** 0.5
            spike = value > mean + self.z * max(std, 1e-8)
        self.values = (self.values + [value])[-self.window:]
        return spike


# A level shift leaves the window flagging fewer than window/2 values in a row for any Z >= 1
# (the new values soon dominate its mean and std); more in a row is a trend no skip can fix.
MAX_SPIKES_IN_A_ROW = 25


class UpdateGuard:
    """--skip-nonfinite N and --skip-spikes Z: whether a step's update is applied. A step whose
    loss or grad norm is NaN or inf is skipped up to N times, then the run stops; one whose loss or
    grad norm is a spike (SpikeDetector) is skipped, until too many in a row say the level moved.
    An fp16 overflow is the GradScaler's business: skipped, never counted. Its state goes into
    checkpoints, so a resumed run skips exactly what an uninterrupted one would."""

    def __init__(self, skip_nonfinite: int, skip_spikes: float, fp16: bool):
        self.skip_nonfinite, self.skip_spikes, self.fp16 = skip_nonfinite, skip_spikes, fp16
        self.loss_spikes, self.norm_spikes = SpikeDetector(skip_spikes), SpikeDetector(skip_spikes)
        self.nonfinite_skipped = self.spikes_in_a_row = 0

    def skip_reason(self, step: int, loss: float, norm: float, last_ckpt: str | None) -> str | None:
        """Why this step's update must not be applied (None: apply it); raises when out of skips."""
        if self.fp16 and math.isfinite(loss) and not math.isfinite(norm):
            return "overflow"  # fp16 gradients overflowed at this loss scale: the scaler lowers it, no failure
        if not (math.isfinite(loss) and math.isfinite(norm)):
            if self.nonfinite_skipped >= self.skip_nonfinite:
                raise UserError(f"step {step}: non-finite loss {loss} or grad norm {norm}; stopped "
                                f"before the update. Last good checkpoint: {last_ckpt or 'none'}")
            self.nonfinite_skipped += 1
            return "nonfinite"
        if any([self.loss_spikes.is_spike(loss), self.norm_spikes.is_spike(norm)]):  # both windows see the step
            self.spikes_in_a_row += 1
            if self.spikes_in_a_row > MAX_SPIKES_IN_A_ROW:
                raise UserError(f"step {step}: {self.spikes_in_a_row} updates in a row flagged by --skip-spikes "
                                f"{self.skip_spikes}: the loss or grad norm has moved for good (or Z is too low) "
                                "and skipping cannot fix that; stopped before the update. Last good checkpoint: "
                                f"{last_ckpt or 'none'}")
            return "spike"
        self.spikes_in_a_row = 0
        return None

    def state_dict(self) -> dict:
        return dict(loss_window=self.loss_spikes.values, norm_window=self.norm_spikes.values,
                    spikes_in_a_row=self.spikes_in_a_row, nonfinite_skipped=self.nonfinite_skipped)

    def load_state_dict(self, state: dict):
        self.loss_spikes.values, self.norm_spikes.values = list(state["loss_window"]), list(state["norm_window"])
        self.spikes_in_a_row, self.nonfinite_skipped = state["spikes_in_a_row"], state["nonfinite_skipped"]


def nonfinite_state(model, optimizer, device) -> str | None:
    """Which of the weights or optimizer state hold NaN or inf, in words (None: all finite). Every
    rank checks what it holds (its shards under FSDP); one all-reduce makes them agree."""
    params = dict(model.named_parameters())
    moments = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    finite = torch.stack([torch.isfinite(local_part(t)).all() for t in [*params.values(), *moments]])
    if not all_reduce_sum(torch.tensor(float(not finite.all()), device=device)).item():
        return None
    names = [n for n, ok in zip(params, finite.tolist()) if not ok]
    return f"model weights ({names[0]}, ...)" if names else "model weights or optimizer state"


def peak_memory(device: str) -> str:
    """The most memory this process held: CUDA's allocated peak, else its own (private) host memory's."""
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB GPU"
    return memory.peak_report()  # not RSS: that counts the mapped shards' shared pages
