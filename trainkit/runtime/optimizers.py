"""--optimizer muon: torch.optim.Muon and AdamW on two parts of one model, looking like one torch optimizer
to the step, fp16's GradScaler, the update guard and checkpoints; and a resume's optimizer hyperparameters.
"""

from __future__ import annotations

import torch

from trainkit.cli import UserError


class MuonWithAdamW:
    """Muon on some parameters, AdamW on the rest; Muon's LR is AdamW's scheduled LR x --muon-lr / --max-lr."""

    def __init__(self, adamw: torch.optim.AdamW, matrices: list, muon_lr: float, muon_momentum: float, max_lr: float):
        if not hasattr(torch.optim, "Muon"):  # requirements.txt asks for 2.6, which AdamW runs need
            raise UserError(
                f"--optimizer muon needs torch 2.9 or newer (torch.optim.Muon); this is torch "
                f"{torch.__version__}: pip install -U torch, or use --optimizer adamw"
            )
        # Nesterov momentum, 5 Newton-Schulz steps, LR x sqrt(max(1, rows / cols)) (torch's defaults, Keller
        # Jordan's Muon); no weight decay, as in modded-nanogpt and nanochat (torch's 0.1 at LR 0.02 would
        # shrink every matrix by 0.2% a step, 30x AdamW's decay at GPT-2's LR)
        self.muon = torch.optim.Muon(matrices, lr=muon_lr, momentum=muon_momentum, nesterov=True, weight_decay=0.0)
        self.adamw, self.lr_ratio = adamw, muon_lr / max_lr

    @property
    def param_groups(self) -> list[dict]:
        return self.adamw.param_groups + self.muon.param_groups

    @property
    def state(self) -> dict:
        return {**self.adamw.state, **self.muon.state}

    def set_lr(self, lr: float):
        for group in self.adamw.param_groups:
            group["lr"] = lr
        for group in self.muon.param_groups:
            group["lr"] = lr * self.lr_ratio

    def step(self):
        self.adamw.step()
        self.muon.step()

    def zero_grad(self, set_to_none: bool = True):
        self.adamw.zero_grad(set_to_none=set_to_none)
        self.muon.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return dict(adamw=self.adamw.state_dict(), muon=self.muon.state_dict())

    def load_state_dict(self, state: dict):
        self.adamw.load_state_dict(state["adamw"])
        self.muon.load_state_dict(state["muon"])


# the flag setting each hyperparameter an optimizer keeps in its param_groups (betas, eps, ...: none, only code)
HYPERPARAMETER_FLAGS = {("AdamW", "weight_decay"): "--weight-decay", ("Muon", "momentum"): "--muon-momentum"}


def use_run_hyperparameters(optimizer, checkpoint_state) -> str | None:
    """Before a resume loads checkpoint_state: its hyperparameters but the LR set to this run's (torch would keep
    the checkpoint's); the note naming what changes, or None. A state of another kind is left to refuse."""
    changes = {}

    def adopt(part, ours: dict, theirs):
        groups = theirs.get("param_groups") if isinstance(theirs, dict) else None
        if not isinstance(groups, list) or len(groups) != len(ours["param_groups"]):
            return
        for mine, saved in zip(ours["param_groups"], groups):
            for key, value in mine.items() if isinstance(saved, dict) else ():
                if key in ("params", "lr"):
                    continue
                if key in saved and not same_value(saved[key], value):
                    name = type(part).__name__
                    flag = HYPERPARAMETER_FLAGS.get((name, key), f"{name}'s {key}")
                    changes.setdefault(flag, f"{flag} {saved[key]} -> {value}")
                saved[key] = value

    ours = optimizer.state_dict()
    parts = sorted(ours.keys() - {"state", "param_groups"})  # MuonWithAdamW: one state dict per part
    saved_parts = checkpoint_state if isinstance(checkpoint_state, dict) else {}
    for name in parts:
        adopt(getattr(optimizer, name), ours[name], saved_parts.get(name))
    if not parts:
        adopt(optimizer, ours, checkpoint_state)
    changed = ", ".join(changes.values())
    return f"note: the optimizer takes this run's values, not its checkpoint's: {changed}" if changes else None


def same_value(a, b) -> bool:
    """a == b, a tuple and a list holding the same items being the same (betas, as saved and as built)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b
