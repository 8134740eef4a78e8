"""Plot a training run from its log.jsonl.

    python plot_log.py out                                   # writes out/loss.png
    python plot_log.py out/log.jsonl -o run.png --baseline-hellaswag 0.2955

Panels: train and validation loss; HellaSwag accuracy (when the log has any or a baseline
is given; the baseline is a horizontal line labelled "GPT-2 124M"); learning rate. The loss axis is linear
and, by default, its top is set from the run after its first steps so that the initial
loss (about 11 for GPT-2) does not flatten the rest of the curve (--no-clip shows it all).

matplotlib is optional: it is imported only when plotting, with the Agg backend (no display).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

BASELINE_LABEL = "GPT-2 124M"


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""


def find_log(path: str) -> str:
    """path is a run's out dir or its log.jsonl."""
    log = os.path.join(path, "log.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(log):
        raise UserError(f"no log at {log}: pass a run's --out-dir or its log.jsonl")
    return log


def load_records(log: str) -> list[dict]:
    """The JSON objects of log.jsonl, in file order. Malformed lines (a write cut by a crash)
    are skipped with a warning on stderr."""
    records, bad = [], 0
    with open(log) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)  # accepts the NaN/Infinity that json.dumps writes
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
                records.append(record)
            else:
                bad += 1
    if bad:
        print(f"warning: skipped {bad} malformed line(s) in {log}", file=sys.stderr)
    if not records:
        raise UserError(f"{log} has no records yet (is the run just starting?)")
    return records


def series(records: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) of key, sorted by step; a step logged twice keeps its last value."""
    by_step = {}
    for r in records:
        if key in r and r[key] is not None:
            by_step[r["step"]] = float(r[key])
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def loss_ylim(train: list[float], val: list[float], skip_frac: float = 0.05):
    """y-limits that ignore the first skip_frac of training steps (the initial drop from ~11),
    or None when the run is too short for that to matter."""
    if len(train) < 20:
        return None
    rest = [v for v in train[max(1, int(len(train) * skip_frac)):] + val[1:] if math.isfinite(v)]
    finite = [v for v in train + val if math.isfinite(v)]
    if not rest or not finite:
        return None
    lo, hi = min(finite), max(rest)
    pad = 0.05 * (hi - lo) or 0.05
    return lo - pad, hi + pad


def make_figure(records: list[dict], baseline: float | None = None, clip: bool = True, title: str | None = None):
    """A matplotlib Figure with a loss panel, a HellaSwag panel when records have any
    hellaswag_acc, and a learning-rate panel. Axes are in that order; lines carry labels."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("matplotlib is not installed: pip install matplotlib") from None

    train_steps, train_loss = series(records, "loss")
    val_steps, val_loss = series(records, "val_loss")
    hs_steps, hs_acc = series(records, "hellaswag_acc")
    lr_steps, lr = series(records, "lr")
    if not (train_steps or val_steps or hs_steps):
        raise UserError("the log has no loss, val_loss or hellaswag_acc records to plot")

    show_hs = bool(hs_steps) or baseline is not None
    n_panels = 3 if show_hs else 2
    fig, axes = plt.subplots(n_panels, 1, figsize=(9, 3.2 * n_panels), sharex=True, squeeze=False)
    axes = list(axes[:, 0])
    ax = axes[0]
    if train_steps:
        ax.plot(train_steps, train_loss, lw=0.8, alpha=0.8, color="tab:blue", label="train loss")
    if val_steps:
        ax.plot(val_steps, val_loss, marker="o", ms=3, color="tab:orange", label="val loss")
    ylim = loss_ylim(train_loss, val_loss) if clip else None
    if ylim:
        ax.set_ylim(*ylim)
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")

    if show_hs:
        ax = axes[1]
        if hs_steps:
            ax.plot(hs_steps, hs_acc, marker="o", ms=3, color="tab:green", label="HellaSwag acc")
        if baseline is not None:
            ax.axhline(baseline, ls="--", color="tab:red", label=f"{BASELINE_LABEL} ({baseline:.4f})")
        ax.set_ylabel("HellaSwag acc_norm")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")

    ax = axes[-1]
    if lr_steps:
        ax.plot(lr_steps, lr, color="tab:purple", label="learning rate")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    ax.set_ylabel("learning rate")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)

    summary = []
    if train_steps:
        summary.append(f"step {train_steps[-1]}: loss {train_loss[-1]:.4f}")
    if val_steps:
        summary.append(f"val {val_loss[-1]:.4f}")
    if hs_steps:
        summary.append(f"HellaSwag {hs_acc[-1]:.4f}")
    fig.suptitle((title + "\n" if title else "") + " | ".join(summary), fontsize=10)
    fig.tight_layout()
    return fig


def plot_log(path: str, out: str | None = None, baseline: float | None = None, clip: bool = True) -> str:
    """Read path (out dir or log.jsonl), write the PNG (default: loss.png beside the log)."""
    log = find_log(path)
    records = load_records(log)
    fig = make_figure(records, baseline=baseline, clip=clip, title=log)
    out = out or os.path.join(os.path.dirname(log), "loss.png")
    try:
        fig.savefig(out, dpi=120)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Plot loss, HellaSwag accuracy and learning rate from a run's log.jsonl.")
    p.add_argument("path", help="the run's --out-dir, or its log.jsonl")
    p.add_argument("-o", "--out", help="PNG to write (default: loss.png beside the log)")
    p.add_argument("--baseline-hellaswag", type=float, metavar="ACC",
                   help=f"draw a horizontal line labelled '{BASELINE_LABEL}' at this accuracy (e.g. 0.2955)")
    p.add_argument("--no-clip", action="store_true", help="show the whole loss range, first steps included")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    args = p.parse_args(argv)
    try:
        out = plot_log(args.path, args.out, baseline=args.baseline_hellaswag, clip=not args.no_clip)
    except UserError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
