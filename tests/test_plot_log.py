"""plot_log.py: a PNG from log.jsonl, figure contents equal the log, one-line errors."""

import json
import math
import os
import sys

import pytest

import plot_log
from conftest import RUN_SHARDS, assert_refused, assert_refused_quietly, run_main, tiny_run_args

SHARDS = RUN_SHARDS  # the shared finished run's data
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def mpl():
    """The test skipped without matplotlib; every figure it made closed after it (pyplot keeps each one alive)."""
    yield pytest.importorskip("matplotlib")
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")


def fake_records(n=60, every=20, hellaswag=True):
    records = []
    for s in range(n):
        loss, lr = 3 + 8 * math.exp(-s / 5) + 0.01 * (s % 3), 6e-4 * min(1, (s + 1) / 10)
        records.append(dict(step=s, loss=loss, lr=lr, grad_norm=1.0, tokens=4096, dt_ms=10.0, tok_per_s=4e5))
        if s % every == 0 or s == n - 1:
            records.append(dict(step=s, val_loss=3.1 + 8 * math.exp(-s / 5)))
            if hellaswag:
                records.append(dict(step=s, hellaswag_acc=0.25 + s / 1000, hellaswag_n=100))
    return records


def write_log(path, records, tail=""):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "log.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write(tail)
    return path / "log.jsonl"


def lines_by_label(ax):
    return {line.get_label(): line for line in ax.get_lines()}


def legend_labels(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_make_figure_panels_and_data_equal_the_log_and_without_hellaswag_two_panels(mpl):
    records = fake_records()
    fig = plot_log.make_figure(records, baseline=0.2955)
    loss_ax, hs_ax, lr_ax = fig.axes
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    hs = [r for r in records if "hellaswag_acc" in r]
    lines = lines_by_label(loss_ax)
    assert set(lines) == {"train loss", "train loss (EMA 0.9)", "val loss"}
    assert list(lines["train loss"].get_xdata()) == [r["step"] for r in train]
    assert list(lines["train loss"].get_ydata()) == [r["loss"] for r in train]
    assert lines["train loss"].get_alpha() == 0.3  # raw points faint under the EMA
    assert list(lines["train loss (EMA 0.9)"].get_ydata()) == plot_log.ema([r["loss"] for r in train], 0.9)
    assert list(lines["val loss"].get_ydata()) == [r["val_loss"] for r in val]
    lo, hi = loss_ax.get_ylim()  # clipped: the first steps' ~11 is off the top
    assert hi < max(r["loss"] for r in train) and lo <= min(r["loss"] for r in train)
    lines = lines_by_label(hs_ax)
    assert list(lines["HellaSwag acc"].get_ydata()) == [r["hellaswag_acc"] for r in hs]
    baseline = lines["GPT-2 124M (0.2955)"]
    assert list(baseline.get_ydata()) == [0.2955, 0.2955]
    (lr_line,) = lr_ax.get_lines()
    assert list(lr_line.get_ydata()) == [r["lr"] for r in train]
    # without HellaSwag two panels; --no-clip the whole range; smoothing 0 no EMA line
    records = [r for r in records if "hellaswag_acc" not in r]
    fig = plot_log.make_figure(records, clip=False)
    assert len(fig.axes) == 2 and fig.axes[0].get_ylim()[1] >= max(r["loss"] for r in train)
    assert set(lines_by_label(plot_log.make_figure(records, smooth=0).axes[0])) == {"train loss", "val loss"}


def test_ema_reference_values_and_a_resumed_step_keeps_its_last_value():
    steps, values = plot_log.series([dict(step=2, loss=5.0), dict(step=1, loss=6.0), dict(step=2, loss=4.0)], "loss")
    assert (steps, values) == ([1, 2], [6.0, 4.0])
    assert plot_log.ema([3.0, 3.0, 3.0], 0.9) == pytest.approx([3.0, 3.0, 3.0], abs=1e-12)  # no pull toward 0
    assert plot_log.ema([0.0, 10.0], 0.5) == pytest.approx([0.0, 5.0 / 0.75], abs=1e-12)
    smoothed = plot_log.ema([float("nan"), 2.0, float("inf"), 4.0], 0.5)
    assert math.isnan(smoothed[0])
    assert smoothed[1:] == pytest.approx([2.0, 2.0, (0.5 + 2.0) / 0.75], abs=1e-12)  # carried over inf


def test_resumes_the_trainer_logs_are_marked_on_every_panel(data_dir, finished_copy, mpl):
    import train_gpt2 as tg

    assert tg.main(tiny_run_args(data_dir, finished_copy, "--resume", steps=6, ckpt_every=2)) == 0  # from step 4
    records = plot_log.load_records(str(finished_copy / "log.jsonl"))
    assert [r for r in records if "event" in r] == [dict(event="resume", step=4, run=records[0]["run"])]
    assert ([r["step"] for r in records if "loss" in r], plot_log.resume_steps(records)) == ([0, 1, 2, 3, 4, 5], [4])

    records = fake_records(n=40, hellaswag=False)
    records.insert(25, dict(event="resume", step=12))  # the trainer's record
    records += [dict(step=s, loss=3.0, lr=1e-4) for s in range(30, 45)]  # an older log: steps go back to 30
    records.append(dict(step=44, event="something new", note="ignored"))
    assert plot_log.resume_steps(records) == [12, 30]
    fig = plot_log.make_figure(records)
    for ax in fig.axes:
        marks = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
        assert [list(line.get_xdata()) for line in marks] == [[12, 12], [30, 30]]
    assert legend_labels(fig.axes[0]).count("resumed") == 1


def test_output_paths_by_extension_and_bad_output_type_or_smoothing_are_one_line_errors(tmp_path, mpl):
    log = write_log(tmp_path / "run", fake_records(n=5, every=2))
    proc = run_main("plot_log.py", str(log.parent))  # by default loss.png beside the log
    assert (proc.returncode, proc.stdout) == (0, f"wrote {log.parent / 'loss.png'}\n"), proc.stderr
    data = (log.parent / "loss.png").read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    proc = run_main("plot_log.py", str(log), "-o", str(tmp_path / "plot.xyz"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: cannot write {tmp_path / 'plot.xyz'}: unknown image type .xyz (use ")
    assert ".png" in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "plot.xyz").exists()
    assert_refused(run_main("plot_log.py", str(log), "--smooth", "1"), "--smooth must be in [0, 1), got 1.0")
    assert plot_log.main([str(log), "-o", str(tmp_path / "plot.svg")]) == 0  # the extension picks the format
    assert (tmp_path / "plot.svg").read_text().lstrip().startswith("<?xml")


def test_numbers_no_axis_holds_are_gaps_and_odd_lines_are_skipped(tmp_path, mpl):
    records = fake_records(n=30, hellaswag=False)
    train = [r for r in records if "loss" in r]
    for step, value in [(10, 1e308), (11, 1.7e308), (12, math.inf), (13, math.nan)]:
        train[step]["loss"] = value  # json.dumps writes Infinity and NaN
    deep = "[" * 100_000 + "]" * 100_000
    # a record without a step, a line too deep for the JSON parser and a cut last line
    log = write_log(tmp_path / "run", records, tail=f'{{"step": null, "loss": 2.0}}\n{deep}\n{{"step": 60, "loss": 3.')
    proc = run_main(
        "plot_log.py", log, "-o", tmp_path / "curve", "--baseline-hellaswag", "0.2955"
    )  # no extension: a PNG
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        0,
        f"wrote {tmp_path / 'curve.png'}\n",
        f"warning: skipped 3 malformed line(s) in {log}\n",
    )
    assert (tmp_path / "curve.png").read_bytes()[:8] == PNG_MAGIC
    assert sorted(os.listdir(tmp_path)) == ["curve.png", "run"]
    fig = plot_log.make_figure(plot_log.load_records(str(log)))
    lines = lines_by_label(fig.axes[0])
    drawn = list(lines["train loss"].get_ydata())
    assert [math.isnan(v) for v in drawn[10:14]] == [True] * 4 and drawn[14] == train[14]["loss"]
    assert fig.axes[0].get_ylim()[1] < 12  # the axis holds the finite curve
    assert lines["train loss (EMA 0.9)"].get_ydata()[14] < 12  # the EMA carries over the gap


TWO_RECORDS = b'{"step": 0, "loss": 5.0}\n{"step": 0, "val_loss": 5.1}\n'


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("log.jsonl", None, "no log at {log}: pass a run's --out-dir or its log.jsonl"),
        ("log.jsonl", b"", "{log} has no records yet (is the run just starting?)"),
        ("log.jsonl", b'{"step": 0, "lr": 1e-4}\n', "the log has no loss, val_loss or hellaswag_acc records to plot"),
        ("log.jsonl", TWO_RECORDS + b'{"step": 2, "loss": "abc"}\n', "{log} line 3: loss is 'abc', not a number"),
        ("log.jsonl", TWO_RECORDS + b'{"step": 2, "loss": 3.5, "lr": [1]}\n', "{log} line 3: lr is [1], not a number"),
        ("log.jsonl", TWO_RECORDS + b'{"step": true, "loss": 3.5}\n', "{log} line 3: step is True, not a number"),
        (
            "ckpt_0000004.pt",
            b"PK\x03\x04\x80\x81\xfe\xff binary\n\x00\x9c\n",
            "{log} is not a run's log: none of its 2 line(s) is a JSON record; pass a run's --out-dir or its log.jsonl",
        ),
        (
            "log.jsonl",
            b'{"step": 0, "loss": 1' + b"0" * 400 + b"}\n",
            "{log} line 1: loss is too large a number to plot",
        ),
        ("log.jsonl", b'{"step": Infinity, "loss": 3.0}\n', "{log} line 1: step is inf, not a step number"),
        ("log.jsonl", TWO_RECORDS, "matplotlib is not installed: pip install matplotlib"),
    ],
    ids="missing empty no-curves str list bool-step checkpoint huge-integer infinite-step no-matplotlib".split(),
)
def test_bad_logs_are_one_line_errors(tmp_path, monkeypatch, name, content, message, mpl):
    if message.startswith("matplotlib"):  # import matplotlib -> ImportError
        for module in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
            monkeypatch.delitem(sys.modules, module)
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    log = tmp_path / name
    if content is not None:
        log.write_bytes(content)
    assert_refused_quietly(run_main("plot_log.py", str(log)), message.format(log=log))
    assert os.listdir(tmp_path) == ([] if content is None else [name])


def test_bits_per_byte_a_multiple_of_the_loss_on_its_right_hand_axis_else_a_line_of_their_own(mpl):
    records = fake_records(hellaswag=False)
    for r in records:
        if "val_loss" in r:
            r["val_bpb"] = round(r["val_loss"] / (4 * math.log(2)), 4)  # the same tokens each time, as logged
    records.append(dict(step=60, val_loss=3.1, val_bpb=round(3.1 / (4 * math.log(2)), 4)))  # after train step 59
    fig = plot_log.make_figure(records)
    loss_ax, lr_ax = fig.axes  # no twin axis: a secondary axis of the loss panel
    val_line = "val loss (right axis: bits per byte)"
    assert (set(lines_by_label(loss_ax)), legend_labels(loss_ax)) == (
        {"train loss", "train loss (EMA 0.9)", val_line},
        ["train loss", "train loss (EMA 0.9)", val_line],
    )
    (bpb_axis,) = loss_ax.child_axes
    assert bpb_axis.get_ylabel() == "val bits per byte"
    factor = 1 / (4 * math.log(2))
    assert bpb_axis.get_ylim() == pytest.approx(tuple(v * factor for v in loss_ax.get_ylim()), rel=1e-3)
    assert len([a for a in fig.axes + loss_ax.child_axes if a.get_legend()]) == 1  # one legend on the panel
    assert fig._suptitle.get_text().endswith(  # each number with its own step
        f"train loss {records[-3]['loss']:.4f} (step 59) | val loss 3.1000, {records[-1]['val_bpb']:.4f} bits/byte "
        "(step 60)"
    )

    val = [r for r in records[:-1] if "val_bpb" in r]
    for r in val:
        r["val_bpb"] += 0.01 * r["step"]  # bytes per token drifting: not a multiple of the loss
    loss_ax, lr_ax, bpb_ax = plot_log.make_figure(records[:-1]).axes  # the twin axis comes last
    assert "val loss" in lines_by_label(loss_ax) and not loss_ax.child_axes
    (line,) = bpb_ax.get_lines()
    assert (line.get_label(), list(line.get_ydata())) == ("val bits per byte", [r["val_bpb"] for r in val])
    assert (bpb_ax.get_ylabel(), bpb_ax.get_legend()) == ("val bits per byte", None)
    lo, hi = bpb_ax.get_ylim()  # its own scale, around its own values
    assert lo <= min(r["val_bpb"] for r in val) and hi >= max(r["val_bpb"] for r in val)
    assert legend_labels(loss_ax) == ["train loss", "train loss (EMA 0.9)", "val loss", "val bits per byte"]
