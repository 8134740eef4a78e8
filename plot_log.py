"""Plot a training run from its log.jsonl.

    python plot_log.py out                                   # writes out/loss.png
    python plot_log.py out/log.jsonl -o run.png --baseline-hellaswag 0.2955

Panels: train and validation loss, with a right-hand axis that reads the validation curve in bits
per byte when the log has them (val_bpb: the same validation tokens each time make it the loss times
one factor; where the factor changed, e.g. a resume with other --val-steps, val_bpb gets its own
line and axis instead); HellaSwag accuracy (when the log has any or a baseline
is given; the baseline is a horizontal line labelled "GPT-2 124M"); learning rate. The train
loss is drawn faint, step by step, under its exponential moving average (--smooth). A dotted
vertical line marks each step where the run was resumed. The loss axis is linear
and, by default, its top is set from the run after its first steps so that the initial
loss (about 11 for GPT-2) does not flatten the rest of the curve (--no-clip shows it all).
Records of other kinds in the log are ignored. A log of several runs (logs concatenated; every
record names its run) draws each run's curves in a colour of its own (runs_of).

matplotlib is optional: it is imported only when plotting, with the Agg backend (no display).
"""

from __future__ import annotations

from trainkit import cli  # the error contract shared by every script: first, so that it covers the imports

if __name__ == "__main__":
    cli.exit_on_ctrl_c_while_starting()

import math
import os
import sys

from trainkit import fileio
from trainkit.fileio import write_atomically
from trainkit.cli import UserError, print_line, reason_of

BASELINE_LABEL = "GPT-2 124M"
NUMERIC_KEYS = ("step", "loss", "val_loss", "val_bpb", "hellaswag_acc", "lr")  # what the plots read
DEFAULT_SMOOTH = 0.9  # EMA weight: about the last 10 steps
# the trainer computes in float32 (or narrower): a value beyond its range is drawn as a gap, like inf,
# since an axis reaching float64's 1e308 overflows matplotlib's tick arithmetic
LARGEST_DRAWN = 3.4e38


def find_log(path: str) -> str:
    """path is a run's out dir or its log.jsonl."""
    log = os.path.join(path, "log.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(log):
        raise UserError(f"no log at {log}: pass a run's --out-dir or its log.jsonl")
    return log


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_drawn(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= LARGEST_DRAWN


def parse_record(line: bytes):
    """A line's JSON value, or None where it is not JSON text: a write cut by a crash, bytes that
    are not UTF-8, nesting deeper than any record (fileio.MAX_DEPTH)."""
    try:
        return fileio.parse_json(line, "log")  # accepts the NaN/Infinity that json.dumps writes
    except fileio.JSONFileError:
        return None


def check_numbers(record: dict, where: str) -> None:
    """A UserError unless the step and each plotted value is a number that a float holds."""
    for key in NUMERIC_KEYS:
        value = record.get(key)
        if value is None:
            continue
        if not is_number(value):
            raise UserError(f"{where}: {key} is {value!r}, not a number")
        try:
            value = float(value)
        except OverflowError:  # a JSON integer of hundreds of digits
            raise UserError(f"{where}: {key} is too large a number to plot") from None
        if key == "step" and not is_drawn(value):
            raise UserError(f"{where}: step is {value}, not a step number")


def load_records(log: str) -> list[dict]:
    """The JSON objects of log.jsonl, in file order. Malformed lines (a write cut by a crash)
    are skipped with a warning on stderr; a record whose step or plotted value is not a
    number is an error naming its line."""
    records, bad = [], 0
    with open(log, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = parse_record(line)
            if not isinstance(record, dict) or record.get("step") is None:
                bad += 1
                continue
            check_numbers(record, f"{log} line {line_no}")
            records.append(record)
    if not records and bad:  # e.g. a checkpoint passed for its log
        raise UserError(
            f"{log} is not a run's log: none of its {bad} line(s) is a JSON record; "
            "pass a run's --out-dir or its log.jsonl"
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
    """Exponential moving average, debiased so that the first points are not pulled toward 0
    (as TensorBoard smooths); a value not drawn (inf, nan, beyond LARGEST_DRAWN) is left out and
    the average carries over it."""
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        if is_drawn(v):
            avg = weight * avg + (1 - weight) * v
            norm = weight * norm + (1 - weight)
        out.append(avg / norm if norm else math.nan)
    return out


def resume_steps(records: list[dict]) -> list:
    """Steps where the run was resumed: the trainer's {"event": "resume", "step": S} records,
    and, in a log without them, each place where the training steps go back."""
    steps = {r["step"] for r in records if r.get("event") == "resume"}
    last = None
    for r in records:
        if "loss" in r:
            if last is not None and r["step"] <= last:
                steps.add(r["step"])
            last = r["step"]
    return sorted(steps)


def bits_per_byte_factor(val_steps: list, val_loss: list[float], bpb_steps: list, val_bpb: list[float]):
    """val_bpb / val_loss when every evaluation logged the same ratio (to 0.1%, the log's rounding
    aside), else None. The ratio is bytes per token's inverse (over ln 2), fixed by the validation
    tokens, which are the same at every evaluation of a run."""
    bpb = dict(zip(bpb_steps, val_bpb))
    ratios = [
        bpb[s] / v
        for s, v in zip(val_steps, val_loss)
        if s in bpb and is_drawn(v) and is_drawn(bpb[s]) and v > 0 and bpb[s] > 0
    ]
    if ratios and max(ratios) - min(ratios) <= 1e-3 * min(ratios):
        return ratios[-1]
    return None


def loss_ylim(train: list[float], val: list[float], skip_frac: float = 0.05):
    """y-limits that ignore the first skip_frac of training steps (the initial drop from ~11),
    or None when the run is too short for that to matter."""
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
    """(name, records) of each run the log holds, in the order they first appear. Every record names the run
    that wrote it ("run"); a branch (a resume from an earlier checkpoint) is a new run whose first record is
    its resume, naming the run it branched from ("parent"): where that run's records came before, it stays
    that run's curve. Any other new run (two runs' logs concatenated, a branch of a run this log does not
    hold) is a curve of its own. Records that name no run (a log of an older trainer) are one run."""
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
    """The values a run's curves draw: (steps, values) of each plotted key, sorted by step."""

    def __init__(self, records: list[dict]):
        self.records = records
        self.train = series(records, "loss")
        self.val = series(records, "val_loss")
        self.bpb = series(records, "val_bpb")
        self.hs = series(records, "hellaswag_acc")
        self.lr = series(records, "lr")
        self.factor = bits_per_byte_factor(*self.val, *self.bpb) if self.bpb[0] else None


def shared_factor(runs: list[Series]):
    """The one val_bpb / val_loss factor of every run that logs val_bpb (None where they differ)."""
    factors = [run.factor for run in runs if run.bpb[0]]
    if not factors or None in factors or max(factors) - min(factors) > 1e-3 * min(factors):
        return None
    return factors[-1]


def make_figure(
    records: list[dict],
    baseline: float | None = None,
    clip: bool = True,
    title: str | None = None,
    smooth: float = DEFAULT_SMOOTH,
):
    """A matplotlib Figure with a loss panel, a HellaSwag panel when records have any
    hellaswag_acc, and a learning-rate panel. Axes are in that order; lines carry labels.
    smooth: the EMA weight of the train-loss line (0: no EMA line). A log of several runs
    (runs_of) draws each run's curves in a colour of its own, labelled with its run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("matplotlib is not installed: pip install matplotlib") from None

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
    factor = shared_factor(runs)
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
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    legend_lines = list(ax.get_lines())
    if factor:  # one curve per run, read on either axis
        bpb_axis = ax.secondary_yaxis("right", functions=(lambda y: y * factor, lambda y: y / factor))
        bpb_axis.set_ylabel("val bits per byte")
    elif any(run.bpb[0] for run in runs):  # not a multiple of the loss: a line of its own, on its own scale
        bpb_ax = ax.twinx()
        for k, run in enumerate(runs):
            if run.bpb[0]:
                bpb_line = look(k, "tab:red", "val bits per byte")
                legend_lines += bpb_ax.plot(run.bpb[0], drawn(run.bpb[1]), marker="s", ms=3, ls="--", **bpb_line)
        bpb_ax.set_ylabel("val bits per byte")

    if show_hs:
        ax = axes[1]
        for k, run in enumerate(runs):
            if run.hs[0]:
                ax.plot(run.hs[0], drawn(run.hs[1]), marker="o", ms=3, **look(k, "tab:green", "HellaSwag acc"))
        if baseline is not None:
            ax.axhline(baseline, ls="--", color="tab:red", label=f"{BASELINE_LABEL} ({baseline:.4f})")
        ax.set_ylabel("HellaSwag acc_norm")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")

    ax = axes[-1]
    for k, run in enumerate(runs):
        if run.lr[0]:
            ax.plot(run.lr[0], drawn(run.lr[1]), **look(k, "tab:purple", "learning rate"))
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    ax.set_ylabel("learning rate")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)

    for n, step in enumerate(sorted({step for run in runs for step in resume_steps(run.records)})):
        for ax in axes:
            line = ax.axvline(
                step, ls=":", lw=1, color="gray", label="resumed" if n == 0 and ax is axes[0] else "_nolegend_"
            )
            if line.get_label() == "resumed":
                legend_lines.append(line)
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
        parts.append(
            f"val loss {val_loss[-1]:.4f}"
            + (f", {bpb:.4f} bits/byte" if bpb is not None else "")
            + f" (step {val_steps[-1]})"
        )
    if hs_steps:
        parts.append(f"HellaSwag {hs_acc[-1]:.4f} (step {hs_steps[-1]})")
    return " | ".join(parts)


def plot_log(
    path: str, out: str | None = None, baseline: float | None = None, clip: bool = True, smooth: float = DEFAULT_SMOOTH
) -> str:
    """Read path (out dir or log.jsonl), write the image (default: loss.png beside the log; the
    format follows the extension)."""
    if not 0 <= smooth < 1:
        raise UserError(f"--smooth must be in [0, 1), got {smooth}")
    if baseline is not None and not is_drawn(baseline):
        raise UserError(f"--baseline-hellaswag must be a finite number, got {baseline}")
    log = find_log(path)
    records = load_records(log)
    fig = make_figure(records, baseline=baseline, clip=clip, title=log, smooth=smooth)
    out = out or os.path.join(os.path.dirname(log), "loss.png")
    check_image_name(out)
    extension = os.path.splitext(out)[1].lower().lstrip(".")
    if not extension:  # a PNG, named as savefig would name it, so that we print the name it has
        out, extension = out.rstrip(".") + ".png", "png"
    try:
        formats = fig.canvas.get_supported_filetypes()
        if extension not in formats:
            raise UserError(
                f"cannot write {out}: unknown image type .{extension} "
                f"(use {', '.join('.' + f for f in sorted(formats))})"
            )
        write_atomically(  # a new file renamed over out: a link or a file standing there is replaced, not written through
            out,
            lambda f: fig.savefig(f, format=extension, dpi=120),
            fsync_file=False,
            fsync_folder=False,
            tmp=f"{out}.{os.getpid()}.tmp",
        )
    except OSError as e:
        raise UserError(f"cannot write {out}: {reason_of(e)}") from None
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return out


def check_image_name(out: str):
    """A UserError for an -o that names no image file: a folder, a name ending in a separator, or an
    extension alone (`-o r2/`, `-o r2/.png`), which would write a hidden file such as r2/.png."""
    name = os.path.basename(out)
    if os.path.isdir(out) or not name.strip(".") or (name.startswith(".") and "." not in name[1:]):
        folder = out if os.path.isdir(out) else os.path.dirname(out)
        raise UserError(
            f"-o {out} names a folder or an extension alone, not an image file: name the file to write "
            f"(e.g. -o {os.path.join(folder, 'loss.png')})"
        )


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
