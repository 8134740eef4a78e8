"""--wandb and --tensorboard: the run trackers that get every record RunLog writes to log.jsonl,
each imported only when its flag asks for it."""

from __future__ import annotations

import dataclasses

from trainkit import cli
from trainkit.cli import UserError, optional_import, reason_of


class TensorBoardSink:
    """--tensorboard: each record's numbers as scalars and strings as text at its step, in --out-dir; a
    resumed run hides what earlier attempts logged from its step on (purge_step), as log.jsonl is cut."""

    flag = "--tensorboard"

    def __init__(self, out_dir: str, purge_step: int | None):
        tensorboard = optional_import(
            "torch.utils.tensorboard", "--tensorboard needs the tensorboard package: pip install tensorboard"
        )
        self.writer = tensorboard.SummaryWriter(out_dir, purge_step=purge_step)

    def write(self, record: dict):
        for key, value in record.items():
            if key != "step":
                add = self.writer.add_text if isinstance(value, str) else self.writer.add_scalar
                add(key, value, record["step"])

    def close(self):
        self.writer.close()


class WandbSink:
    """--wandb PROJECT: each record as a wandb.log at its step; each launch, a resume too, is a new W&B run."""

    flag = "--wandb"

    def __init__(self, project: str, out_dir: str, config: dict):
        wandb = optional_import("wandb", "--wandb needs the wandb package: pip install wandb")
        try:
            self.run = wandb.init(project=project, dir=out_dir, config=config)
        except Exception as e:  # no API key, no network, a bad project name...
            raise UserError(
                f"--wandb: could not start a W&B run ({reason_of(e, typed=True)}); "
                "run `wandb login` or set WANDB_MODE=offline"
            ) from None
        if getattr(self.run, "disabled", False):
            cli.print_warning(
                "--wandb: W&B is disabled here (WANDB_MODE=disabled or WANDB_DISABLED), so the W&B "
                "run stays empty; log.jsonl gets every record"
            )

    def write(self, record: dict):
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self):
        self.run.finish()


def open_sinks(run, model_cfg, resumed_at: int | None) -> list:
    """The trackers the run asked for (a resumed one's from its step on: RunLog.resend_step)."""
    sinks = []
    if run.tensorboard:
        sinks.append(TensorBoardSink(run.out_dir, purge_step=resumed_at))
    if run.wandb:
        config = dict(run=dataclasses.asdict(run), model=dataclasses.asdict(model_cfg))
        sinks.append(WandbSink(run.wandb, run.out_dir, config))
    return sinks
