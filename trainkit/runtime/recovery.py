"""What keeps an out-of-memory (docs/gpus.md), a bad update, a stop signal or a failed evaluation from costing
training (docs/resume-and-failures.md)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time

import torch
import torch.distributed as dist

from trainkit import cli
from trainkit.cli import UserError, print0
from trainkit.runtime.device import is_out_of_memory, local_part, proc_kib
from trainkit.runtime.launch import AgreedUserError, all_reduce_sum

# --- the micro-batch that fits --------------------------------------------------------------------

CPU_SEARCH_SHARE = 0.8  # on CPU a trial may take this much of the RAM the machine has available
# What a trial leaves free for what a real step adds to it: the prefetcher's thread (8 MiB of stack on
# Linux), the all-reduce's buffers (a trial under DDP runs without sync), the CUDA allocator's
# fragmentation. Measured on CPU: the first steps peak 10 MiB above the trial of their micro-batch.
MARGIN_CPU = 64 * 2**20
MARGIN_CUDA_SHARE = 0.03  # of the GPU's memory: 2.4 GB of an 80 GB H100, 0.7 GB of a 24 GB card


def divisors(n: int) -> list[int]:
    """The micro-batches that split n rows per rank exactly, ascending."""
    small = [b for b in range(1, int(n**0.5) + 1) if n % b == 0]
    return sorted(set(small + [n // b for b in small]))


@contextlib.contextmanager
def cpu_search_limit(device_type: str):
    """On CPU a trial too big for the RAM would call the OOM killer: while the search runs, the address space
    may grow by CPU_SEARCH_SHARE of the available memory (shared by the node's ranks), so it fails as an error."""
    if device_type != "cpu" or not os.path.exists("/proc/meminfo"):  # (Linux: /proc and RLIMIT_AS)
        yield
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    share = CPU_SEARCH_SHARE / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the ranks of this node search at once
    cap = proc_kib("/proc/self/status", "VmSize") + int(share * proc_kib("/proc/meminfo", "MemAvailable"))
    resource.setrlimit(resource.RLIMIT_AS, (cap if soft == resource.RLIM_INFINITY else min(cap, soft), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def release_cached(device: str):
    """A failed try's cached CUDA blocks go back to the device: the next try gets unfragmented memory."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def fits_everywhere(forward_backward, B: int, T: int, model, optimizer, device: str) -> bool:
    """B rows of T zeros ran through forward_backward with no out-of-memory on any rank; the gradients dropped."""
    x, failed = torch.zeros(B, T, dtype=torch.long), False
    # under DDP without gradient sync: no collective inside, which a rank that fails would leave half-done
    with model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext():
        try:
            forward_backward([(x, x)], B * T)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            failed = True
    optimizer.zero_grad(set_to_none=True)  # (out of the except block: the failed trial's tensors are gone)
    release_cached(device)
    return not all_reduce_sum(torch.tensor([float(failed)], device=device)).item()


def choose_micro_batch(run, plan, forward_backward, model, optimizer, val_rows, dist_state, log) -> int:
    """--batch-size auto: the largest divisor of plan.rows_per_rank that fits (and lets --val-steps batches fit
    val_rows): the largest first, then a binary search, AdamW's moments and a margin held. Printed, logged."""
    rows_per_rank, T, device = plan.rows_per_rank, plan.seq_len, dist_state.device
    t0, tried, device_type = time.perf_counter(), [], torch.device(device).type
    most = val_rows.rows_per_epoch // (run.val_steps * dist_state.world_size) if val_rows else rows_per_rank
    choices = [b for b in divisors(rows_per_rank) if b <= most]

    def fits(i):
        tried.append((choices[i], fits_everywhere(forward_backward, choices[i], T, model, optimizer, device)))
        return tried[-1][1]

    # each trial compiles for its own B, as a run with that --batch-size would (else dynamo goes dynamic)
    static_shapes = torch._dynamo.config.patch(automatic_dynamic_shapes=False) if plan.compile else None
    with (
        torch.random.fork_rng(devices=[device] if device_type == "cuda" else []),
        cpu_search_limit(device_type),
        static_shapes or contextlib.nullcontext(),
    ):
        # AdamW's moments as the first update allocates them (--eval-only updates nothing), and the margin
        moments = [p for g in optimizer.param_groups for p in g["params"] if p not in optimizer.state]
        held = [torch.empty_like(local_part(p)) for p in moments * 2 if not run.eval_only]
        cuda_margin = (
            device_type == "cuda" and MARGIN_CUDA_SHARE * torch.cuda.get_device_properties(device).total_memory
        )
        held.append(torch.empty(int(cuda_margin or MARGIN_CPU), dtype=torch.uint8, device=device))
        best, fail = (len(choices) - 1, None) if fits(len(choices) - 1) else (-1, len(choices) - 1)
        while fail is not None and fail - best > 1:  # choices[best] fits (-1: none yet), choices[fail] does not
            mid = (best + fail) // 2
            best, fail = (mid, fail) if fits(mid) else (best, mid)
        del held
    seconds = time.perf_counter() - t0
    summary = ", ".join(f"{b}: {'fits' if ok else 'out of memory'}" for b, ok in tried)
    if best < 0:
        raise UserError(
            f"--batch-size auto: not even one row of --seq-len {T} fits {device} with the model's weights, "
            "gradients and AdamW state: pass --activation-checkpointing, a shorter --seq-len or a smaller "
            f"model (tried {summary})"
        )
    B = choices[best]
    print0(
        f"--batch-size auto: {B} rows per micro-step fit {device}, {rows_per_rank // B} accumulation steps "
        f"(tried {summary}; {len(tried)} trials, {seconds:.1f}s)"
    )
    log.write(step=plan.start_step, event="batch_size", batch_size=B, tried=summary, search_s=round(seconds, 3))
    return B


def size_after_failure(e: BaseException, micro_batches: list, rows_per_rank: int, world_size: int) -> int | None:
    """The micro-batch to redo a step at after an out-of-memory on one process: half of the failed one (or the
    largest divisor below); None (raise e) for any other error, under torchrun, or below one row."""
    if not is_out_of_memory(e) or world_size > 1:
        return None
    return max((b for b in divisors(rows_per_rank) if b <= len(micro_batches[0][0]) // 2), default=None)


def redo_smaller(step, micro_batches: list, smaller: int, reason: str, rows_per_rank: int, optimizer, device, log):
    """The step's micro-batches re-split at smaller rows (the same rows in order), gradients dropped; said, logged."""
    optimizer.zero_grad(set_to_none=True)
    release_cached(device)
    print0(
        f"step {step:5d} | out of memory at {len(micro_batches[0][0])} rows per micro-step ({reason}): the step "
        f"again at {smaller} rows ({rows_per_rank // smaller} accumulation steps), the same rows and numbers"
    )
    log.write(step=step, event="batch_size", batch_size=smaller, reason="out of memory")
    x, y = (torch.cat([torch.as_tensor(batch[i]) for batch in micro_batches]) for i in (0, 1))
    return list(zip(x.split(smaller), y.split(smaller)))


# --- the update guard -----------------------------------------------------------------------------


class SpikeDetector:
    """Flags a value more than z standard deviations above the mean of a recent window; every value enters
    the window, flagged or not, so a lasting shift becomes the new level within a few steps."""

    def __init__(self, z: float, window: int = 50, warmup: int = 20):
        self.z, self.window, self.warmup, self.values = z, window, warmup, []

    def is_spike(self, value: float) -> bool:
        spike = False
        if self.z and len(self.values) >= self.warmup:
            mean = sum(self.values) / len(self.values)
            std = (sum((v - mean) ** 2 for v in self.values) / len(self.values)) ** 0.5
            spike = value > mean + self.z * max(std, 1e-8)
        self.values = (self.values + [value])[-self.window :]
        return spike


# A level shift leaves the window flagging fewer than window/2 values in a row for any Z >= 1
# (the new values soon dominate its mean and std); more in a row is a trend no skip can fix.
MAX_SPIKES_IN_A_ROW = 25


class UpdateGuard:
    """--skip-nonfinite N and --skip-spikes Z: a NaN/inf loss or grad norm is skipped up to N times, a spike
    until too many in a row; an fp16 overflow is the GradScaler's. Checkpointed, so a resume skips alike."""

    def __init__(self, skip_nonfinite: int, skip_spikes: float, fp16: bool, last_checkpoint=lambda: None):
        self.skip_nonfinite, self.skip_spikes, self.fp16 = skip_nonfinite, skip_spikes, fp16
        self.last_checkpoint = last_checkpoint  # () -> the last good checkpoint, named when the guard stops
        self.loss_spikes, self.norm_spikes = SpikeDetector(skip_spikes), SpikeDetector(skip_spikes)
        self.nonfinite_skipped = self.spikes_in_a_row = 0

    def skip_reason(self, step: int, loss: float, norm: float) -> str | None:
        """Why this step's update must not be applied (None: apply it); raises when out of skips."""
        if self.fp16 and math.isfinite(loss) and not math.isfinite(norm):
            return "overflow"  # fp16 gradients overflowed at this loss scale: the scaler lowers it, no failure
        if not (math.isfinite(loss) and math.isfinite(norm)):
            if self.nonfinite_skipped >= self.skip_nonfinite:
                raise UserError(
                    f"step {step}: non-finite loss {loss} or grad norm {norm}; stopped "
                    f"before the update. Last good checkpoint: {self.last_checkpoint() or 'none'}"
                )
            self.nonfinite_skipped += 1
            return "nonfinite"
        if any([self.loss_spikes.is_spike(loss), self.norm_spikes.is_spike(norm)]):  # both windows see the step
            self.spikes_in_a_row += 1
            if self.spikes_in_a_row > MAX_SPIKES_IN_A_ROW:
                raise UserError(
                    f"step {step}: {self.spikes_in_a_row} updates in a row flagged by --skip-spikes "
                    f"{self.skip_spikes}: the loss or grad norm has moved for good (or Z is too low) "
                    "and skipping cannot fix that; stopped before the update. Last good checkpoint: "
                    f"{self.last_checkpoint() or 'none'}"
                )
            return "spike"
        self.spikes_in_a_row = 0
        return None

    def state_dict(self) -> dict:
        windows = dict(loss_window=self.loss_spikes.values, norm_window=self.norm_spikes.values)
        return dict(windows, spikes_in_a_row=self.spikes_in_a_row, nonfinite_skipped=self.nonfinite_skipped)

    def load_state_dict(self, state: dict):
        self.loss_spikes.values, self.norm_spikes.values = list(state["loss_window"]), list(state["norm_window"])
        self.spikes_in_a_row, self.nonfinite_skipped = state["spikes_in_a_row"], state["nonfinite_skipped"]


def guarded_update(optimizer, guard: UpdateGuard, scaler, step: int, loss: float, norm: float) -> str | None:
    """The optimizer's step unless the guard skips it (fp16: through the scaler), gradients zeroed; why skipped."""
    skipped = guard.skip_reason(step, loss, norm)
    if scaler:
        if not skipped:
            scaler.step(optimizer)
        scaler.update()
    elif not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return skipped


def nonfinite_state(model, optimizer, device) -> str | None:
    """Which of the weights or optimizer state hold NaN or inf (None: all finite); every rank calls it."""
    params = dict(model.named_parameters())
    moments = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    finite = torch.stack([torch.isfinite(local_part(t)).all() for t in [*params.values(), *moments]])
    if not all_reduce_sum(torch.tensor(float(not finite.all()), device=device)).item():
        return None
    names = [n for n, ok in zip(params, finite.tolist()) if not ok]
    return f"model weights ({names[0]}, ...)" if names else "model weights or optimizer state"


# --- stop signals ---------------------------------------------------------------------------------

# a stop as requested: preemption, Ctrl-C, and a closed terminal or ssh session (no SIGHUP on Windows)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))
SIGHUP = getattr(signal, "SIGHUP", None)


class StopSignal:
    """SIGTERM, SIGINT and SIGHUP ask the run to finish its step, checkpoint and exit 0; a second SIGINT
    aborts; at_once (nothing to save): each ends it as cli.Interrupted. A SIGHUP ignored (nohup) stays so."""

    def __init__(self, at_once: bool = False):
        self.requested, self.at_once = False, at_once
        self.terminal_fds = [fd for fd in (1, 2) if os.isatty(fd)]  # a hung-up terminal no longer says it is one
        nohup = [s for s in STOP_SIGNALS if s == SIGHUP and signal.getsignal(s) == signal.SIG_IGN]
        self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS if s not in nohup}

    def _handle(self, signum, frame):
        if signum == SIGHUP:  # writing to the gone terminal would fail (EIO): what went there goes to /dev/null
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in self.terminal_fds:
                os.dup2(devnull, fd)
            os.close(devnull)
        if self.at_once or (self.requested and signum == signal.SIGINT):
            raise cli.Interrupted(signum)
        self.requested = True

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def ignore_sigterm_from_now(self):
        """After another rank died torchrun SIGTERMs the survivors: this one still prints its line."""
        self.previous[signal.SIGTERM] = signal.SIG_IGN


def stopped_line(path: str, step: int) -> str:
    """What a run stopped by a signal prints last: its checkpoint, how to go on (torchrun's traceback: harmless)."""
    line = f"stopped by signal at step {step}; checkpoint {path} is complete and safe. Resume with the same command plus --resume"
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # set by torchrun in every process it starts
        line += " (torchrun's SignalException traceback, if one follows, only reports the signal it passed on)"
    return line


# --- a failure between steps ----------------------------------------------------------------------


def save_first_on_failure(checkpointer, step: int, action):
    """action() (the evaluation due at step); where it raises a UserError after steps trained, they are saved first,
    with a note. Under torchrun only an AgreedUserError saves (every rank meets there); else the line names the last."""
    try:
        return action()
    except UserError as e:
        last = checkpointer.last
        if last is None and step == 0:  # nothing trained yet
            raise
        if dist.is_initialized() and not isinstance(e, AgreedUserError):  # the other ranks may wait elsewhere
            raise UserError(
                f"{e} (the steps trained since {last or 'step 0'} are not saved; last checkpoint: {last or 'none'})"
            ) from None
        try:
            checkpointer.save(step)
        except UserError as failed:
            print0(
                f"note: step {step}'s evaluation failed (the error below), and saving the steps trained before "
                f"it failed too ({failed}); last checkpoint: {last or 'none'}"
            )
            raise e from None
        print0(
            f"note: step {step}'s evaluation failed (the error below); the steps trained before it are saved "
            f"first in {checkpointer.last}: once fixed, resume with the same command plus --resume"
        )
        raise
