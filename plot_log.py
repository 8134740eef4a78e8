"""Plot a run's loss, bits per byte, HellaSwag accuracy and learning rate from its log.jsonl (docs/plotting.md)."""

from __future__ import annotations

from trainkit import cli  # the error contract shared by every script: first, so that it covers the imports

if __name__ == "__main__":
    cli.exit_on_ctrl_c_while_starting()

import math
import os
import sys

from trainkit import fileio
from trainkit.cli import UserError, print_line, reason_of

BASELINE_LABEL = "GPT-2 124M"
NUMERIC_KEYS = ("step", "loss", "val_loss", "val_bpb", "hellaswag_acc", "lr")  # what the plots read
DEFAULT_SMOOTH = 0.9  # EMA weight: about the last 10 steps
# beyond float32's range (the trainer's): a gap, like inf (an axis reaching 1e308 overflows matplotlib's ticks)
LARGEST_DRAWN = 3.4e38


def is_drawn(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= LARGEST_DRAWN


def check_numbers(record: dict, where: str) -> None:
    """A UserError unless the step and each plotted value is a number that a float holds."""
    for key in NUMERIC_KEYS:
        value = record.get(key)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise UserError(f"{where}: {key} is {value!r}, not a number")
        try:
            value = float(value)
        except OverflowError:  # a JSON integer of hundreds of digits
            raise UserError(f"{where}: {key} is too large a number to plot") from None
        if key == "step" and not is_drawn(value):
            raise UserError(f"{where}: step is {value}, not a step number")


def load_records(log: str) -> list[dict]:
    """log.jsonl's JSON records; lines not JSON are skipped with a warning, a value that is no number refused."""
    records, bad = [], 0
    with open(log, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = fileio.parse_json(line, "log")  # accepts the NaN/Infinity that json.dumps writes
            except fileio.JSONFileError:
                record = None
            if not isinstance(record, dict) or record.get("step") is None:
                bad += 1
                continue
            check_numbers(record, f"{log} line {line_no}")
            records.append(record)
    if not records and bad:  # e.g. a checkpoint passed for its log
        raise UserError(
            f"{log} is not a run's log: none of its {bad} line(s) is a JSON record; pass a run's --out-dir or its log.jsonl"
        )
    if not records:
        raise UserError(f"{log} has no records yet (is the run just starting?)")
    if bad:
        print_line(f"warning: skipped {bad} malformed line(s) in {log}", file=sys.stderr)
    return records


def series(records: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) of key, sorted by step; a step logged twice keeps its last value."""
    by_step = {}
    for r in records:
        if key in r and r[key] is not None:
            by_step[r["step"]] = float(r[key])
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def drawn(values: list[float]) -> list[float]:
    """values as a line draws them: those not drawn are nan, a gap."""
    return [v if is_drawn(v) else math.nan for v in values]


def ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average, debiased as TensorBoard's; values not drawn are left out (carried over)."""
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        if is_drawn(v):
            avg = weight * avg + (1 - weight) * v
            norm = weight * norm + (1 - weight)
        out.append(avg / norm if norm else math.nan)
    return out


def resume_steps(records: list[dict]) -> list:
    """Steps where the run was resumed: its {"event": "resume"} records, and each place the steps go back."""
    train = [r["step"] for r in records if "loss" in r]
    steps_back = {step for last, step in zip(train, train[1:]) if step <= last}
    return sorted({r["step"] for r in records if r.get("event") == "resume"} | steps_back)


def agreed(values: list):
    """The last of values where all agree to 0.1% (the log's rounding aside), else None."""
    if values and None not in values and max(values) - min(values) <= 1e-3 * min(values):
        return values[-1]
    return None


def loss_ylim(train: list[float], val: list[float], skip_frac: float = 0.05):
    """y-limits leaving out the first skip_frac of steps (the drop from ~11); None for a short run."""
    if len(train) < 20:
        return None
    rest = [v for v in train[max(1, int(len(train) * skip_frac)) :] + val[1:] if is_drawn(v)]
    finite = [v for v in train + val if is_drawn(v)]
    if not rest or not finite:
        return None
    lo, hi = min(finite), max(rest)
    pad = 0.05 * (hi - lo) or 0.05
    return lo - pad, hi + pad


def runs_of(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """(name, records) per run the log holds, in order; a branch stays its parent's curve where the log holds it."""
    runs, curve_of = [], {}
    for record in records:
        run = record.get("run") if isinstance(record.get("run"), str) else None
        if run not in curve_of:
            parent = record.get("parent") if record.get("event") == "resume" else None
            branch = isinstance(parent, str) and parent in curve_of
            curve_of[run] = curve_of[parent] if branch else len(runs)
            if not branch:
                runs.append((f"run {run[:8]}" if run else "records naming no run", []))
        runs[curve_of[run]][1].append(record)
    return runs


class Series:
    """A run's (steps, values) of each plotted key; factor: val_bpb / val_loss where the same at every evaluation."""

    def __init__(self, records: list[dict]):
        self.records = records
        keys = ("loss", "val_loss", "val_bpb", "hellaswag_acc", "lr")
        self.train, self.val, self.bpb, self.hs, self.lr = (series(records, key) for key in keys)
        bpb = dict(zip(*self.bpb))
        positive = lambda v: 0 < v <= LARGEST_DRAWN  # drawn and above 0
        self.factor = agreed([bpb[s] / v for s, v in zip(*self.val) if s in bpb and positive(v) and positive(bpb[s])])


def make_figure(
    records: list[dict],
    baseline: float | None = None,
    clip: bool = True,
    title: str | None = None,
    smooth=DEFAULT_SMOOTH,
):
    """A Figure of the loss, HellaSwag (where logged or a baseline) and learning-rate panels, one colour per run."""
    matplotlib = cli.optional_import("matplotlib", "matplotlib is not installed: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    named = runs_of(records)
    runs = [Series(run_records) for _, run_records in named]
    if not any(run.train[0] or run.val[0] or run.hs[0] for run in runs):
        raise UserError("the log has no loss, val_loss or hellaswag_acc records to plot")
    several = len(runs) > 1

    def look(k: int, colour: str, label: str) -> dict:
        """A line's colour and label: its quantity's own colour in a log of one run; else its run's."""
        return dict(color=f"C{k}", label=f"{label} ({named[k][0]})") if several else dict(color=colour, label=label)

    show_hs = any(run.hs[0] for run in runs) or baseline is not None
    n_panels = 3 if show_hs else 2
    fig, axes = plt.subplots(n_panels, 1, figsize=(9, 3.2 * n_panels), sharex=True, squeeze=False)
    axes = list(axes[:, 0])
    ax = axes[0]
    factor = agreed([run.factor for run in runs if run.bpb[0]])  # one factor for every run, or None
    for k, run in enumerate(runs):
        (train_steps, train_loss), (val_steps, val_loss) = run.train, run.val
        if train_steps:
            faint = dict(lw=0.6, alpha=0.3) if smooth else dict(lw=0.8, alpha=0.8)
            ax.plot(train_steps, drawn(train_loss), **look(k, "tab:blue", "train loss"), **faint)
            if smooth:
                ema_line = look(k, "tab:blue", f"train loss (EMA {smooth:g})")
                ax.plot(train_steps, ema(train_loss, smooth), lw=1.5, **ema_line)
        if val_steps:
            label = "val loss (right axis: bits per byte)" if factor else "val loss"
            ax.plot(val_steps, drawn(val_loss), marker="o", ms=3, **look(k, "tab:orange", label))
    ylims = [loss_ylim(run.train[1], run.val[1]) for run in runs] if clip else []
    if ylims and all(ylims):
        ax.set_ylim(min(lo for lo, _ in ylims), max(hi for _, hi in ylims))
    legend_lines = list(ax.get_lines())
    if factor:  # one curve per run, read on either axis
        bpb_axis = ax.secondary_yaxis("right", functions=(lambda y: y * factor, lambda y: y / factor))
        bpb_axis.set_ylabel("val bits per byte")
    elif any(run.bpb[0] for run in runs):  # not a multiple of the loss: a line of its own, on its own scale
        bpb_ax = ax.twinx()
        for k, run in enumerate(runs):
            if run.bpb[0]:
                style = dict(marker="s", ms=3, ls="--", **look(k, "tab:red", "val bits per byte"))
                legend_lines += bpb_ax.plot(run.bpb[0], drawn(run.bpb[1]), **style)
        bpb_ax.set_ylabel("val bits per byte")

    if show_hs:
        ax = axes[1]
        for k, run in enumerate(runs):
            if run.hs[0]:
                ax.plot(run.hs[0], drawn(run.hs[1]), marker="o", ms=3, **look(k, "tab:green", "HellaSwag acc"))
        if baseline is not None:
            ax.axhline(baseline, ls="--", color="tab:red", label=f"{BASELINE_LABEL} ({baseline:.4f})")
        ax.legend(loc="lower right")

    ax = axes[-1]
    for k, run in enumerate(runs):
        if run.lr[0]:
            ax.plot(run.lr[0], drawn(run.lr[1]), **look(k, "tab:purple", "learning rate"))
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    ax.set_xlabel("step")
    for ax, label in zip(axes, ["loss (nats/token)"] + ["HellaSwag acc_norm"] * show_hs + ["learning rate"]):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)

    for n, step in enumerate(sorted({step for run in runs for step in resume_steps(run.records)})):
        lines = [ax.axvline(step, ls=":", lw=1, color="gray", label="_nolegend_") for ax in axes]
        if n == 0:
            lines[0].set_label("resumed")
            legend_lines.append(lines[0])
    axes[0].legend(handles=legend_lines, loc="upper right")  # one legend for both of the panel's axes

    summaries = [summary(run) for run in runs]
    if several:
        summaries = [f"{name}: {text}" for (name, _), text in zip(named, summaries)]
    fig.suptitle((title + "\n" if title else "") + "\n".join(summaries), fontsize=10)
    fig.tight_layout()
    return fig


def summary(run: Series) -> str:
    """Each last value of a run with the step it was logged at (the last train step is one before an evaluation)."""
    parts = []
    (train_steps, train_loss), (val_steps, val_loss), (hs_steps, hs_acc) = run.train, run.val, run.hs
    if train_steps:
        parts.append(f"train loss {train_loss[-1]:.4f} (step {train_steps[-1]})")
    if val_steps:
        bpb = dict(zip(*run.bpb)).get(val_steps[-1])
        bits = f", {bpb:.4f} bits/byte" if bpb is not None else ""
        parts.append(f"val loss {val_loss[-1]:.4f}{bits} (step {val_steps[-1]})")
    if hs_steps:
        parts.append(f"HellaSwag {hs_acc[-1]:.4f} (step {hs_steps[-1]})")
    return " | ".join(parts)


def plot_log(
    path: str, out: str | None = None, baseline: float | None = None, clip: bool = True, smooth: float = DEFAULT_SMOOTH
) -> str:
    """Read path (out dir or log.jsonl) and write the image (default: loss.png beside the log)."""
    if not 0 <= smooth < 1:
        raise UserError(f"--smooth must be in [0, 1), got {smooth}")
    if baseline is not None and not is_drawn(baseline):
        raise UserError(f"--baseline-hellaswag must be a finite number, got {baseline}")
    log = os.path.join(path, "log.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(log):
        raise UserError(f"no log at {log}: pass a run's --out-dir or its log.jsonl")
    fig = make_figure(load_records(log), baseline=baseline, clip=clip, title=log, smooth=smooth)
    out = out or os.path.join(os.path.dirname(log), "loss.png")
    name = os.path.basename(out)
    # a folder, or an extension alone (`-o r2/`, `-o r2/.png`), which would write a hidden file such as r2/.png
    if os.path.isdir(out) or not name.strip(".") or (name.startswith(".") and "." not in name[1:]):
        folder = out if os.path.isdir(out) else os.path.dirname(out)
        raise UserError(
            f"-o {out} names a folder or an extension alone, not an image file: name the file to write (e.g. -o {os.path.join(folder, 'loss.png')})"
        )
    extension = os.path.splitext(out)[1].lower().lstrip(".")
    if not extension:  # a PNG, named as savefig would name it, so that we print the name it has
        out, extension = out.rstrip(".") + ".png", "png"
    try:
        formats = fig.canvas.get_supported_filetypes()
        if extension not in formats:
            known = ", ".join("." + f for f in sorted(formats))
            raise UserError(f"cannot write {out}: unknown image type .{extension} (use {known})")
        save = lambda f: fig.savefig(f, format=extension, dpi=120)
        # a new file renamed over out: a link or a file standing there is replaced, not written through
        fileio.write_atomically(out, save, fsync_file=False, fsync_folder=False, tmp=f"{out}.{os.getpid()}.tmp")
    except OSError as e:
        raise UserError(f"cannot write {out}: {reason_of(e)}") from None
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return out


def main(argv=None) -> int:
    p = cli.ArgumentParser(description="Plot loss, HellaSwag accuracy and learning rate from a run's log.jsonl.")
    p.add_argument("path", help="the run's --out-dir, or its log.jsonl")
    p.add_argument(
        "-o",
        "--out",
        help="image to write: its extension picks the type (.png, .svg, .pdf, ...), none "
        "adds .png (default: loss.png beside the log)",
    )
    p.add_argument(
        "--baseline-hellaswag",
        type=float,
        metavar="ACC",
        help=f"draw a horizontal line labelled '{BASELINE_LABEL}' at this accuracy (e.g. 0.2955)",
    )
    p.add_argument("--no-clip", action="store_true", help="show the whole loss range, first steps included")
    p.add_argument(
        "--smooth",
        type=float,
        default=DEFAULT_SMOOTH,
        metavar="W",
        help=f"EMA weight of the smoothed train-loss line, in [0, 1) (default {DEFAULT_SMOOTH}; 0: none)",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    args = p.parse_args(argv)

    def plot():
        out = plot_log(args.path, args.out, baseline=args.baseline_hellaswag, clip=not args.no_clip, smooth=args.smooth)
        print_line(f"wrote {out}")

    return cli.exit_code_of(plot, args.debug)


if __name__ == "__main__":
    sys.exit(main())
