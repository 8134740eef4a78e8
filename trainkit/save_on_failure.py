"""A failure between optimizer steps loses no training. What runs between two steps (the validation
loss, HellaSwag, samples and the log records they write) may fail on input that changed since the
run started (a --hellaswag-file removed, a disk filled): the steps trained since the last checkpoint
are then saved first, and the run stops with the failure's own line. Where they cannot be saved, the
line says which checkpoint is the last.
"""

from __future__ import annotations

import torch.distributed as dist

from trainkit.cli import UserError
from trainkit.console import print0
from trainkit.launch import AgreedUserError


def save_first_on_failure(checkpointer, step: int, action):
    """action() (what is due before step `step` trains: the Trainer's evaluate), and where it raises a UserError
    once steps were trained since the last checkpoint (checkpointer.last; none and step 0: none was),
    checkpointer.save(step) before the error goes on, with one note line naming the checkpoint. Under torchrun
    the ranks save only where every rank raised alike (an AgreedUserError: they all meet in the save's
    collectives); a rank that failed alone says in its line which checkpoint is the last instead."""
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
