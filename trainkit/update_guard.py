"""What keeps a bad step from doing harm: the non-finite and spike guard on each update
(--skip-nonfinite, --skip-spikes), and the check that no checkpoint holds NaN or inf."""

from __future__ import annotations

import math

import torch

from trainkit.cli import UserError
from trainkit.fsdp import local_part
from trainkit.launch import all_reduce_sum


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
        self.values = (self.values + [value])[-self.window :]
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

    def __init__(self, skip_nonfinite: int, skip_spikes: float, fp16: bool, last_checkpoint=lambda: None):
        """last_checkpoint(): the run's last good checkpoint (None: none yet), named when the guard stops it."""
        self.skip_nonfinite, self.skip_spikes, self.fp16 = skip_nonfinite, skip_spikes, fp16
        self.last_checkpoint = last_checkpoint
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
        return dict(
            loss_window=self.loss_spikes.values,
            norm_window=self.norm_spikes.values,
            spikes_in_a_row=self.spikes_in_a_row,
            nonfinite_skipped=self.nonfinite_skipped,
        )

    def load_state_dict(self, state: dict):
        self.loss_spikes.values, self.norm_spikes.values = list(state["loss_window"]), list(state["norm_window"])
        self.spikes_in_a_row, self.nonfinite_skipped = state["spikes_in_a_row"], state["nonfinite_skipped"]


def guarded_update(optimizer, guard: UpdateGuard, scaler, step: int, loss: float, norm: float) -> str | None:
    """The optimizer's step unless the guard skips it (returns why; None: applied), the gradients zeroed either way;
    under fp16 through the GradScaler (no sync), which adjusts its scale either way."""
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
    """Which of the weights or optimizer state hold NaN or inf, in words (None: all finite). Every
    rank checks what it holds (its shards under FSDP); one all-reduce makes them agree."""
    params = dict(model.named_parameters())
    moments = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    finite = torch.stack([torch.isfinite(local_part(t)).all() for t in [*params.values(), *moments]])
    if not all_reduce_sum(torch.tensor(float(not finite.all()), device=device)).item():
        return None
    names = [n for n, ok in zip(params, finite.tolist()) if not ok]
    return f"model weights ({names[0]}, ...)" if names else "model weights or optimizer state"
