"""What the scripts print: control characters in text they did not write shown escaped; an output that goes away (a
reader that left, a closed terminal, a full disk, an encoding without the characters) never ends a training run, and
a command whose only product is its output says so in its exit code."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from conftest import HELLASWAG_FILE, run_as_programs, run_main, start, tiny_run_args, trained_steps, wait_for_steps
from trainkit.runfiles import checkpoints
from trainkit.cli import reason_of, shown
from shards import write_manifest

HOSTILE = "\x1b]0;owned\x07\x1b[2J"  # sets the terminal's title, then clears the screen
HOSTILE_SHOWN = "\\x1b]0;owned\\x07\\x1b[2J"
FULL = "error: cannot write the output to stdout: no space left on device\n"

SHARDS = dict(n_docs=300, seed=5)


def train_args(data_dir, out_dir, steps, *extra):
    """A tiny run of one layer (tiny_run_args) for steps steps, extra last."""
    return tiny_run_args(data_dir, out_dir, *extra, steps=steps, n_layer=1, warmup=2)


saved_steps = lambda out_dir: [checkpoints.load_checkpoint(str(p))["step"] for p in sorted(out_dir.glob("ckpt_*.pt"))]


# ---- what is shown -----------------------------------------------------------------------------
def test_shown_escapes_every_control_character_and_keeps_lines_only_when_asked():
    controls = "".join(map(chr, [*range(0x20), 0x7F, *range(0x80, 0xA0)]))
    assert shown(controls) == "".join(f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)])
    assert shown("a\tb\nc\r\x1b[2J", keep_newlines=True) == "a\tb\nc\\x0d\\x1b[2J"
    assert shown("a\tb\n") == "a\\x09b\\x0a"
    assert shown("café ☕ \\x1b 世界 \u00a0") == "café ☕ \\x1b 世界 \u00a0"  # printable text as it is


def test_samples_show_their_control_characters_escaped(finished_run):
    """sample.py's prompt (with no new tokens, the whole sample): escape sequences as text, tab and newline as they
    are. (The trainer's samples: test_training_goes_on_when_its_output_goes_away[ascii].)"""
    flags = "--num-samples 2 --max-new-tokens 0 --device cpu".split()
    result = run_main("sample.py", "--checkpoint", finished_run, "--prompt", f"{HOSTILE}\tend\nnext", *flags)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == "".join(f"--- sample {i}/2 ---\n{HOSTILE_SHOWN}\tend\nnext\n" for i in (1, 2))


@pytest.mark.parametrize("case", ["checkpoint keys", "log run id", "manifest file name", "flag value"])
def test_error_lines_show_control_characters_escaped(case, data_dir, tmp_path):
    """Names that come from files someone else may have written, or from the command line."""
    if case == "checkpoint keys":
        torch.save({HOSTILE: 1, "model\x9b2J": 2}, tmp_path / "ckpt_0000001.pt")
        result = run_main("sample.py", "--checkpoint", tmp_path / "ckpt_0000001.pt")
        line = (
            f"error: {tmp_path}/ckpt_0000001.pt: not a train_gpt2.py checkpoint (no model, model_config, "
            f"checksum; its keys: {HOSTILE_SHOWN}, model\\x9b2J)"
        )
    elif case == "log run id":
        (tmp_path / "log.jsonl").write_text(json.dumps({"step": 0, "loss": 5.0, "run": HOSTILE}) + "\n")
        result = run_main("train_gpt2.py", *train_args(data_dir, tmp_path, 2))  # (set aside in a note: not an error)
        said = result.stdout
        assert result.returncode == 0 and f"holds 1 trained step of run {HOSTILE_SHOWN} but no checkpoint" in said
        assert "\x1b" not in said and "\x07" not in said
        return
    elif case == "manifest file name":
        data = tmp_path / "data"
        shutil.copytree(data_dir, data)
        manifest = write_manifest(data)
        manifest["shards"].append({"file": f"{HOSTILE}_train_000009.npy", "bytes": 8})
        (data / "manifest.json").write_text(json.dumps(manifest))
        result = run_main("train_gpt2.py", *train_args(data, tmp_path / "out", 2))
        line = (
            f"error: {data}/{HOSTILE_SHOWN}_train_000009.npy is missing, yet {data}/manifest.json lists it; "
            "restore it, or re-create the data set with fineweb.py"
        )
    else:
        result = run_main("sample.py", "--checkpoint", "x", "--device", HOSTILE)
        line = f"error: --device {HOSTILE_SHOWN}: expected auto, cpu, cuda, cuda:N or mps"
    assert (result.returncode, result.stdout, result.stderr) == (2, "", line + "\n")


# ---- an output that goes away ------------------------------------------------------------------
@pytest.fixture(scope="module")
def gone(data_dir, finished_run, tmp_path_factory):
    """The scripts as programs in one interpreter, with a stdout that fails (run_as_programs' "left" and "full", or
    an encoding without the characters): ({name: CompletedProcess}, the folder of their runs)."""
    tmp = tmp_path_factory.mktemp("gone")
    sample = ["sample.py", "--checkpoint", finished_run, "--num-samples", 3, "--max-new-tokens", 2, "--device", "cpu"]
    hellaswag = ["hellaswag.py", "--checkpoint", finished_run, "--data-file", HELLASWAG_FILE, "--limit", 2]
    shutil.copytree(finished_run, tmp / "plot")  # (plot_log.py writes its loss.png there)
    train = lambda out, steps, *extra: ["train_gpt2.py", *train_args(data_dir, tmp / out, steps, *extra)]
    cases = {  # (a training run's out_dir: tmp / the case's first word)
        "train left": (train("train", 4, "--ckpt-every", 2), "left", None),
        "both left 2>&1": (train("both", 4, "--ckpt-every", 2), "left", "stdout"),
        "full train": (train("full", 3), "full", None),
        "eval-only full": (train("full", 3, "--eval-only", "--resume", "--val-every", 1), "full", None),
        "ascii": (train("ascii", 3, "--sample-every", 1, "--sample-prompt", HOSTILE + "café ☕"), None, None),
        "sample left": (sample, "left", None),
        "sample full": (sample, "full", None),
        "sample full 2>&1": (sample, "full", "full"),
        "hellaswag full": (hellaswag, "full", None),
        "hellaswag left": (hellaswag, "left", None),
        "plot full": (["plot_log.py", tmp / "plot"], "full", None),
    }
    runs = [dict(argv=[str(a) for a in argv], stdout=stdout, stderr=stderr) for argv, stdout, stderr in cases.values()]
    runs[list(cases).index("ascii")]["encoding"] = "ascii"
    return dict(zip(cases, run_as_programs(runs))), tmp


@pytest.mark.parametrize("case", ["train left", "both left 2>&1", "full train", "ascii"])
def test_training_goes_on_when_its_output_goes_away(gone, case):
    """`| head -1` (and `2>&1 | head -1`), `> /dev/full`, PYTHONIOENCODING=ascii (what it lacks written
    backslash-escaped; the prompt's control characters shown escaped): every step trained and saved, exit 0."""
    results, tmp = gone
    out, steps = tmp / case.split()[0], 4 if "left" in case else 3
    assert (results[case].returncode, results[case].stderr) == (0, "")
    assert trained_steps(out) == list(range(steps)) and saved_steps(out) == ([2, 4] if steps == 4 else [3])
    if case == "ascii":
        stdout = results[case].stdout
        samples = [line for line in stdout.splitlines() if line.startswith("sample: ")]
        assert (stdout.isascii(), "\x1b" in stdout or "\x07" in stdout, len(samples)) == (True, False, 12)
        assert all(line.startswith(f"sample: {HOSTILE_SHOWN}caf\\xe9 \\u2615") for line in samples)


def test_a_command_whose_output_is_its_product_says_when_stdout_failed(gone):
    """--eval-only, sample.py, hellaswag.py: a reader that left, 141 (128 + SIGPIPE, as a shell says); a full disk,
    one line and 2 (the code alone when stderr is on that disk too). plot_log.py's product is its plot: exit 0."""
    results, tmp = gone
    outcome = {name: (r.returncode, r.stderr) for name, r in results.items()}
    assert outcome["eval-only full"] == outcome["sample full"] == (2, FULL)
    assert outcome["sample left"] == (141, "") and outcome["sample full 2>&1"] == (2, "")
    # (before it, hellaswag.py's progress bar, which ends each of its updates with \r)
    code, err = outcome["hellaswag full"]
    assert (code, err.endswith("\n" + FULL), err.count("error:")) == (2, True, 1)
    assert outcome["hellaswag left"][0] == 141
    assert outcome["plot full"] == (0, "") and (tmp / "plot" / "loss.png").stat().st_size > 0


def test_sighup_to_a_run_piped_through_tee_checkpoints_and_exits_0(data_dir, tmp_path):
    """`train_gpt2.py ... | tee run.txt` in a terminal that closes: SIGHUP to the process group ends
    tee, and the trainer stops as a signal stops it, writing nothing more to the pipe tee left."""
    out = tmp_path / "out"
    hup = lambda group: lambda: (signal.signal(signal.SIGHUP, signal.SIG_DFL), os.setpgid(0, group))
    # a process group of its own, as a shell's job (in a terminal: not under nohup)
    tee = start(["tee", str(tmp_path / "run.txt")], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, preexec_fn=hup(0))
    command = [sys.executable, "train_gpt2.py", *train_args(data_dir, out, 100000, "--ckpt-every", "0")]
    trainer = start(command, stdout=tee.stdin, preexec_fn=hup(tee.pid))
    tee.stdin.close()
    try:
        wait_for_steps(out, 3, trainer)
        os.killpg(tee.pid, signal.SIGHUP)
        _, err = trainer.communicate(timeout=120)
        assert (trainer.returncode, err, tee.wait(timeout=60)) == (0, "", -signal.SIGHUP)
    finally:
        for proc in (trainer, tee):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    [step] = saved_steps(out)
    assert step >= 3 and trained_steps(out) == list(range(step))
    assert (tmp_path / "run.txt").read_text().startswith("model: ")


# ---- a library's exception in one of our lines -------------------------------------------------
def test_reason_of_a_library_error_is_its_gist_on_one_line():
    assert reason_of(OSError(28, "No space left on device")) == "no space left on device"
    assert reason_of(PermissionError(13, "Permission denied", "/x"), typed=True) == "PermissionError: permission denied"
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer\nadvice")
    assert reason_of(gloo) == "Connection closed by peer"
    torch_advice = ValueError("  bad   value \n\t(1) retry with weights_only=False")
    assert reason_of(torch_advice, typed=True) == "ValueError: bad value"
    assert reason_of(MemoryError(), typed=True) == "MemoryError" and reason_of(KeyError()) == "KeyError"
    assert reason_of(ValueError("x" * 400)) == "x" * 297 + "..."
