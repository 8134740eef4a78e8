"""A failure between optimizer steps (an evaluation on input that changed, a full disk) loses no training:
the steps trained since the last checkpoint are saved first, then the run stops with the failure's line.
"""

from __future__ import annotations

import torch.distributed as dist

from trainkit.cli import UserError
from trainkit.console import print0
from trainkit.launch import AgreedUserError


def save_first_on_failure(checkpointer, step: int, action):
    """action() (the evaluation due before step trains); where it raises a UserError after steps were trained,
    checkpointer.save(step) first, with a note. Under torchrun only an AgreedUserError saves (every rank
    meets in the save); a rank that failed alone names the last checkpoint instead."""
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
