"""plot_log.py: a PNG from log.jsonl, figure contents equal the log, one-line errors."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import plot_log

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_records(n=60, every=20, hellaswag=True):
    records = []
    for s in range(n):
        records.append(dict(step=s, loss=3 + 8 * math.exp(-s / 5) + 0.01 * (s % 3), lr=6e-4 * min(1, (s + 1) / 10),
                            grad_norm=1.0, tokens=4096, dt_ms=10.0, tok_per_s=4e5))
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


def test_make_figure_panels_and_data_equal_the_log():
    pytest.importorskip("matplotlib")
    records = fake_records()
    fig = plot_log.make_figure(records, baseline=0.2955)
    try:
        loss_ax, hs_ax, lr_ax = fig.axes
        train = [r for r in records if "loss" in r]
        val = [r for r in records if "val_loss" in r]
        hs = [r for r in records if "hellaswag_acc" in r]
        lines = lines_by_label(loss_ax)
        assert set(lines) == {"train loss", "val loss"}
        assert list(lines["train loss"].get_xdata()) == [r["step"] for r in train]
        assert list(lines["train loss"].get_ydata()) == [r["loss"] for r in train]
        assert list(lines["val loss"].get_ydata()) == [r["val_loss"] for r in val]
        lo, hi = loss_ax.get_ylim()  # clipped: the first steps' ~11 is off the top
        assert hi < max(r["loss"] for r in train) and lo <= min(r["loss"] for r in train)
        lines = lines_by_label(hs_ax)
        assert list(lines["HellaSwag acc"].get_ydata()) == [r["hellaswag_acc"] for r in hs]
        baseline = lines["GPT-2 124M (0.2955)"]
        assert list(baseline.get_ydata()) == [0.2955, 0.2955]
        (lr_line,) = lr_ax.get_lines()
        assert list(lr_line.get_ydata()) == [r["lr"] for r in train]
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)


def test_make_figure_without_hellaswag_has_two_panels_and_no_clip():
    pytest.importorskip("matplotlib")
    records = fake_records(hellaswag=False)
    fig = plot_log.make_figure(records, clip=False)
    try:
        assert len(fig.axes) == 2
        assert fig.axes[0].get_ylim()[1] >= max(r["loss"] for r in records if "loss" in r)
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)


def test_resumed_step_keeps_last_value():
    steps, values = plot_log.series([dict(step=2, loss=5.0), dict(step=1, loss=6.0), dict(step=2, loss=4.0)], "loss")
    assert (steps, values) == ([1, 2], [6.0, 4.0])


def test_cli_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    log = write_log(tmp_path / "run", fake_records(), tail='{"step": 60, "loss": 3.')  # cut last line
    proc = subprocess.run([sys.executable, str(REPO / "plot_log.py"), str(log.parent),
                           "--baseline-hellaswag", "0.2955"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    png = log.parent / "loss.png"
    assert f"wrote {png}" in proc.stdout and "skipped 1 malformed line" in proc.stderr
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000


def test_main_output_path_and_log_file_argument(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log = write_log(tmp_path / "run", fake_records(n=5, every=2))
    out = tmp_path / "plot.png"
    assert plot_log.main([str(log), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert capsys.readouterr().out.strip() == f"wrote {out}"


@pytest.mark.parametrize("setup, message", [
    ("missing", "no log at"),
    ("empty", "has no records"),
    ("no_curves", "no loss, val_loss or hellaswag_acc"),
])
def test_bad_logs_are_one_line_errors(tmp_path, capsys, setup, message):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    if setup == "empty":
        write_log(run, [])
    elif setup == "no_curves":
        write_log(run, [dict(step=0, lr=1e-4)])
    assert plot_log.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (run / "loss.png").exists()


def test_missing_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    write_log(tmp_path, fake_records(n=3))
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert plot_log.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: matplotlib is not installed: pip install matplotlib\n"
