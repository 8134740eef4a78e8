"""What the scripts print, run as users run them: control characters in text the programs did not
write (the model's samples, a checkpoint's keys, a log's run id, a manifest's file names) are shown
escaped, and an output that goes away (a reader that left, a closed terminal, a full disk, an
encoding without the characters) never ends a training run: it trains on, saves, and exits 0; a
command whose only product is its output says so in its exit code."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_command, run_main, tiny_run_args, trained_steps
from trainkit.runfiles import checkpoints
from trainkit.cli import reason_of, shown

HOSTILE = "\x1b]0;owned\x07\x1b[2J"  # sets the terminal's title, then clears the screen
HOSTILE_SHOWN = "\\x1b]0;owned\\x07\\x1b[2J"

SHARDS = dict(n_docs=300, seed=5)


def command(script, *args):
    return [sys.executable, script, *map(str, args)]


def train_args(data_dir, out_dir, steps, *extra):
    """A tiny run of one layer (tiny_run_args) for steps steps, extra last."""
    return tiny_run_args(data_dir, out_dir, *extra, steps=steps, n_layer=1, warmup=2)


def saved_steps(out_dir) -> list:
    return [checkpoints.load_checkpoint(str(p))["step"] for p in sorted(out_dir.glob("ckpt_*.pt"))]


def run_with_dead_stdout(script, *args, stderr_too=False):
    """script with its stdout (and stderr_too) a pipe whose reader has left, as after `| head -1`
    (closed before the command writes, so that every write it makes fails): (exit code, stderr)."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        proc = subprocess.Popen(
            command(script, *args), cwd=REPO, stdout=writer, stderr=writer if stderr_too else subprocess.PIPE
        )
    finally:
        os.close(writer)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


# ---- what is shown -----------------------------------------------------------------------------


def test_shown_escapes_every_control_character_and_keeps_lines_only_when_asked():
    controls = "".join(map(chr, [*range(0x20), 0x7F, *range(0x80, 0xA0)]))
    assert shown(controls) == "".join(f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)])
    assert shown("a\tb\nc\r\x1b[2J", keep_newlines=True) == "a\tb\nc\\x0d\\x1b[2J"
    assert shown("a\tb\n") == "a\\x09b\\x0a"
    assert shown("café ☕ \\x1b 世界 \u00a0") == "café ☕ \\x1b 世界 \u00a0"  # printable text as it is


def test_sample_py_shows_the_control_characters_of_its_text_escaped(finished_run):
    """The prompt is echoed at the head of each sample (with no new tokens, it is the sample): its
    escape sequences come out as text, its tab and newline as they are."""
    result = run_main(
        "sample.py",
        "--checkpoint",
        finished_run,
        "--prompt",
        f"{HOSTILE}\tend\nnext",
        "--num-samples",
        "2",
        "--max-new-tokens",
        "0",
        "--device",
        "cpu",
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == "".join(f"--- sample {i}/2 ---\n{HOSTILE_SHOWN}\tend\nnext\n" for i in (1, 2))


def test_the_trainers_samples_show_control_characters_escaped(data_dir, tmp_path):
    result = run_main(
        "train_gpt2.py", *train_args(data_dir, tmp_path, 1, "--sample-every", "1", "--sample-prompt", HOSTILE)
    )
    assert result.returncode == 0, result.stderr[-2000:]
    stdout = result.stdout
    samples = [line for line in stdout.splitlines() if line.startswith("sample: ")]
    assert len(samples) == 4 and all(line.startswith(f"sample: {HOSTILE_SHOWN}") for line in samples)
    assert "\x1b" not in stdout and "\x07" not in stdout


@pytest.mark.parametrize("case", ["checkpoint keys", "log run id", "manifest file name", "flag value"])
def test_error_lines_show_control_characters_escaped(case, data_dir, tmp_path):
    """Names that come from files someone else may have written, or from the command line."""
    import shutil
    import torch
    from shards import write_manifest

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
        write_manifest(data)
        manifest = json.loads((data / "manifest.json").read_text())
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


@pytest.mark.parametrize("stderr_too", [False, True], ids=["stdout", "stdout-and-stderr"])
def test_training_goes_on_after_its_reader_left(data_dir, tmp_path, stderr_too):
    """`train_gpt2.py ... | head -1` (and `2>&1 | head -1`): every step trained and saved, exit 0."""
    code, err = run_with_dead_stdout(
        "train_gpt2.py", *train_args(data_dir, tmp_path, 4, "--ckpt-every", "2"), stderr_too=stderr_too
    )
    assert (code, err) == (0, None if stderr_too else b"")
    assert trained_steps(tmp_path) == [0, 1, 2, 3] and saved_steps(tmp_path) == [2, 4]


def test_training_goes_on_with_stdout_on_a_full_disk(data_dir, tmp_path):
    """`train_gpt2.py ... > /dev/full` trains and saves (exit 0); --eval-only, whose printed record is
    all it makes, says that it could not write it."""
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            command("train_gpt2.py", *train_args(data_dir, tmp_path, 3)),
            cwd=REPO,
            stdout=full,
            stderr=subprocess.PIPE,
            timeout=300,
        )
        assert (result.returncode, result.stderr) == (0, b"")
        assert trained_steps(tmp_path) == [0, 1, 2] and saved_steps(tmp_path) == [3]
        result = subprocess.run(
            command("train_gpt2.py", *train_args(data_dir, tmp_path, 3, "--eval-only", "--resume", "--val-every", "1")),
            cwd=REPO,
            stdout=full,
            stderr=subprocess.PIPE,
            timeout=300,
        )
    assert (result.returncode, result.stderr) == (
        2,
        b"error: cannot write the output to stdout: no space left on device\n",
    )


def test_sighup_to_a_run_piped_through_tee_checkpoints_and_exits_0(data_dir, tmp_path):
    """`train_gpt2.py ... | tee run.txt` in a terminal that closes: SIGHUP to the process group ends
    tee, and the trainer stops as a signal stops it, writing nothing more to the pipe tee left."""
    out = tmp_path / "out"
    tee = subprocess.Popen(
        ["tee", str(tmp_path / "run.txt")],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        preexec_fn=lambda: (signal.signal(signal.SIGHUP, signal.SIG_DFL), os.setpgid(0, 0)),
    )  # a process group of its own, as a shell's job (in a terminal: not under nohup)
    trainer = subprocess.Popen(
        command("train_gpt2.py", *train_args(data_dir, out, 100000, "--ckpt-every", "0")),
        cwd=REPO,
        stdout=tee.stdin,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: (signal.signal(signal.SIGHUP, signal.SIG_DFL), os.setpgid(0, tee.pid)),
    )
    tee.stdin.close()
    try:
        deadline = time.time() + 120
        while not (out / "log.jsonl").exists() or len(trained_steps(out)) < 3:
            assert trainer.poll() is None and time.time() < deadline, trainer.communicate()
            time.sleep(0.05)
        os.killpg(tee.pid, signal.SIGHUP)
        _, err = trainer.communicate(timeout=120)
        assert (trainer.returncode, err, tee.wait(timeout=60)) == (0, b"", -signal.SIGHUP)
    finally:
        for proc in (trainer, tee):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    [step] = saved_steps(out)
    assert step >= 3 and trained_steps(out) == list(range(step))
    assert (tmp_path / "run.txt").read_text().startswith("model: ")


def test_training_with_samples_on_a_terminal_without_their_characters(data_dir, tmp_path):
    """PYTHONIOENCODING=ascii: what the encoding lacks is written backslash-escaped."""
    result = run_command(
        "train_gpt2.py",
        *train_args(data_dir, tmp_path, 3, "--sample-every", "1", "--sample-prompt", "café ☕"),
        env={"PYTHONIOENCODING": "ascii"},
    )
    assert (result.returncode, result.stderr, result.stdout.isascii()) == (0, "", True)
    samples = [line for line in result.stdout.splitlines() if line.startswith("sample: ")]
    assert len(samples) == 12 and all(line.startswith("sample: caf\\xe9 \\u2615") for line in samples)
    assert trained_steps(tmp_path) == [0, 1, 2] and saved_steps(tmp_path) == [3]


def test_a_command_whose_output_is_its_product_says_when_stdout_failed(finished_run):
    """sample.py and hellaswag.py: a reader that left ends them quietly with 141 (128 + SIGPIPE, as
    a shell reports it); a full disk is one line and exit code 2, or the code alone when stderr
    is on that disk too."""
    sample = ["--checkpoint", finished_run, "--num-samples", "3", "--max-new-tokens", "2", "--device", "cpu"]
    hellaswag = [
        "--checkpoint",
        finished_run,
        "--data-file",
        REPO / "fixtures" / "hellaswag_val_subset.jsonl",
        "--limit",
        "2",
        "--device",
        "cpu",
    ]
    line = b"error: cannot write the output to stdout: no space left on device\n"
    assert run_with_dead_stdout("sample.py", *sample) == (141, b"")
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            command("sample.py", *sample), cwd=REPO, stdout=full, stderr=subprocess.PIPE, timeout=300
        )
        assert (result.returncode, result.stderr) == (2, line)
        assert (
            subprocess.run(command("sample.py", *sample), cwd=REPO, stdout=full, stderr=full, timeout=300).returncode
            == 2
        )
        result = subprocess.run(
            command("hellaswag.py", *hellaswag), cwd=REPO, stdout=full, stderr=subprocess.PIPE, timeout=300
        )
    # (before it, hellaswag.py's progress bar, which ends each of its updates with \r)
    assert (result.returncode, result.stderr.endswith(b"\n" + line), result.stderr.count(b"error:")) == (2, True, 1)
    assert run_with_dead_stdout("hellaswag.py", *hellaswag)[0] == 141


def test_plot_log_with_stdout_on_a_full_disk_writes_its_plot(tmp_path):
    (tmp_path / "log.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in range(3)))
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            command("plot_log.py", tmp_path), cwd=REPO, stdout=full, stderr=subprocess.PIPE, timeout=300
        )
    assert (result.returncode, result.stderr) == (0, b"")
    assert (tmp_path / "loss.png").stat().st_size > 0


# ---- a library's exception in one of our lines -------------------------------------------------


def test_reason_of_a_library_error_is_its_gist_on_one_line():
    assert reason_of(OSError(28, "No space left on device")) == "no space left on device"
    assert reason_of(PermissionError(13, "Permission denied", "/x"), typed=True) == "PermissionError: permission denied"
    assert (
        reason_of(RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer\nadvice"))
        == "Connection closed by peer"
    )
    assert (
        reason_of(ValueError("  bad   value \n\t(1) retry with weights_only=False"), typed=True)
        == "ValueError: bad value"
    )
    assert reason_of(MemoryError(), typed=True) == "MemoryError" and reason_of(KeyError()) == "KeyError"
    assert reason_of(ValueError("x" * 400)) == "x" * 297 + "..."
