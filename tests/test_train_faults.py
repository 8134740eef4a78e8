"""train_gpt2.py where something around the run goes wrong: a log.jsonl it cannot open, non-finite numbers, a closed
terminal, signals during --eval-only, memory, a rank that alone sees bad data, changed shards, a failing run tracker;
a process only where only a process shows it."""

import json
import os
import pty
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from trainkit.runfiles import checkpoints
from trainkit.runtime.recovery import MARGIN_CPU
from trainkit.data.shards import shard_files
import train_gpt2 as tg
from conftest import RUN_SHARDS, assert_one_error_line, assert_refused, log_records, losses, run_cli
from conftest import run_as_programs, run_command, run_main, start, tiny_run_args, trained_steps, wait_for_steps
from shards import write_manifest

SHARDS = RUN_SHARDS  # the shared finished run's data


# --- log.jsonl ------------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["directory", "dangling symlink", "read-only"])
def test_log_that_cannot_be_opened_is_one_line(data_dir, tmp_path, what):
    log, fix = tmp_path / "log.jsonl", "make it a writable file, or choose another --out-dir"
    if what == "directory":
        log.mkdir()
        expected = f"cannot open {log}: is a directory; {fix}"
    elif what == "dangling symlink":  # opening it for appending would create the file it points to
        log.symlink_to(tmp_path / "gone" / "log.jsonl")
        expected = f"cannot open {log}: it is a symbolic link to {tmp_path}/gone/log.jsonl, which does not exist; remove the link or point it at a file"
    else:  # unwritable, for root too (chattr +i; root ignores file modes)
        log.write_bytes(b"")
        if os.geteuid():
            os.chmod(log, 0o444)
        elif subprocess.run(["chattr", "+i", str(log)], capture_output=True).returncode:
            pytest.skip("running as root, and chattr +i is not allowed here")
        expected = f"cannot open {log}: {'permission denied' if os.geteuid() else 'operation not permitted'}; {fix}"
    try:
        assert_refused(run_main("train_gpt2.py", *tiny_run_args(data_dir, tmp_path, steps=2)), expected)
    finally:
        if what == "read-only" and not os.geteuid():
            subprocess.run(["chattr", "-i", str(log)])
    assert not list(tmp_path.glob("ckpt_*")) and not (tmp_path / "gone").exists()


def test_log_stays_strict_json_when_the_numbers_are_not_finite(data_dir, tmp_path, capsys):
    # the first update overflows the weights: every later loss is NaN and its update skipped, until
    # the last step's checkpoint is refused (non-finite weights are never saved)
    flags = "--max-lr 1e38 --warmup-steps 0 --skip-nonfinite 5 --val-every 1 --val-steps 1".split()
    assert tg.main(tiny_run_args(data_dir, tmp_path, *flags, steps=3, ckpt_every=0)) == 2
    assert capsys.readouterr().err.startswith("error: step 3: not writing")
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert "NaN" not in "".join(lines) and "Infinity" not in "".join(lines)  # the constants JSON has not
    records = [json.loads(line) for line in lines]
    skipped = [(r["step"], r["loss"], r["grad_norm"], r["skipped"], r["nonfinite"]) for r in records if "skipped" in r]
    assert skipped == [(step, None, None, "nonfinite", {"loss": "nan", "grad_norm": "nan"}) for step in (1, 2)]
    assert [(r["step"], r["val_loss"], r["val_bpb"], r.get("nonfinite")) for r in records if "val_loss" in r][1:] == [
        (step, None, None, {"val_loss": "nan", "val_bpb": "nan"}) for step in (1, 2, 3)
    ]
    assert np.isfinite(records[1]["loss"]) and "nonfinite" not in records[1]  # step 0 trained normally


# --- signals --------------------------------------------------------------------------------
def test_sighup_from_a_closed_terminal_stops_with_a_checkpoint(data_dir, tmp_path):
    """ssh drops: the terminal the run writes to is gone (writes fail with EIO) and SIGHUP arrives."""
    master, terminal = pty.openpty()
    proc = start(
        [sys.executable, "train_gpt2.py", *tiny_run_args(data_dir, tmp_path, steps=100000, ckpt_every=0)],
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),  # as from a terminal (not under nohup)
    )
    os.close(terminal)
    try:
        wait_for_steps(tmp_path, 3, proc)
        while select.select([master], [], [], 0)[0]:  # what the terminal showed so far
            os.read(master, 65536)
        os.close(master)  # the terminal closes
        master = None
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=60) == 0
    finally:
        if master is not None:
            os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert len(ckpts := list(tmp_path.glob("ckpt_*.pt"))) == 1
    step = checkpoints.load_checkpoint(str(ckpts[0]))["step"]
    assert step >= 3 and trained_steps(tmp_path) == list(range(step))


@pytest.fixture(scope="module")
def long_val_data(data_dir, tmp_path_factory):
    """data_dir with a val split of 200k rows: --eval-only --val-steps 100000 evaluates for minutes."""
    path = shutil.copytree(data_dir, tmp_path_factory.mktemp("long_val") / "data")
    tokens = np.random.default_rng(0).integers(0, 1000, 200_000 * 16 + 1).astype(np.uint16)
    np.save(os.path.join(path, "synth_val_000000.npy"), tokens)  # in place of the val shard
    return path


@pytest.mark.parametrize(
    "signum,code,line",
    [(signal.SIGINT, 130, "error: interrupted"), (signal.SIGTERM, 143, "error: stopped by SIGTERM")],
    ids=["ctrl-c", "sigterm"],
)
def test_eval_only_stops_at_once_on_a_signal(finished_run, long_val_data, signum, code, line):
    flags = "--eval-only --resume --val-every 1 --val-steps 100000".split()
    args = tiny_run_args(long_val_data, finished_run, *flags, B=1)
    before = sorted(os.listdir(finished_run))
    # as from a terminal: a shell running the tests in the background would leave SIGINT ignored
    proc = start(
        [sys.executable, "train_gpt2.py", *args],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout.readline().startswith("evaluating ")  # loaded; evaluating from now on
        time.sleep(1.0)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)  # (uninterrupted, the evaluation takes minutes)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, err) == (code, line + "\n")
    assert sorted(os.listdir(finished_run)) == before


# --- memory ---------------------------------------------------------------------------------
def test_out_of_memory_while_training_is_one_line(data_dir, tmp_path):
    """134M parameters fit this machine's RAM, but under a 2 GiB address space the weights, gradients and AdamW
    moments (4 x 0.54 GB) do not; 1 MiB thread stacks, so that the trainer's threads start and the step runs out."""

    def limit_address_space():
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))
        resource.setrlimit(resource.RLIMIT_STACK, (2**20, resource.getrlimit(resource.RLIMIT_STACK)[1]))

    args = tiny_run_args(data_dir, tmp_path, "--n-embd", "1536", "--n-head", "16", B=1, steps=2)
    # (MALLOC_ARENA_MAX: fewer address-space reservations)
    result = run_command("train_gpt2.py", *args, preexec_fn=limit_address_space, env={"MALLOC_ARENA_MAX": "2"})
    # at one row per micro-step, a lower --batch-size cannot help; the limit is named beside the model's size
    rest = " bytes): not even one row per micro-step fits: pass --activation-checkpointing, a shorter --seq-len or a smaller model; or raise the memory limit this process runs under (ulimit -v, 2097152 KiB). Last good checkpoint: none"
    assert_one_error_line(result, "out of memory on cpu (tried to allocate ", rest)


@pytest.mark.parametrize("shape", [(3, 4, 48, 40, 300), (1, 1, 8, 8, 50304)])
def test_param_count_counts_what_the_model_builds(shape):
    model = tg.GPT(tg.GPTConfig(**dict(zip(("n_layer", "n_head", "n_embd", "block_size", "vocab_size"), shape))))
    assert tg.param_count(model.config) == sum(p.numel() for p in model.parameters())


# --- the micro-batch that fits (trainkit/runtime/recovery.py), on a real allocation failure -----------------------
# Full logits (64 x 50304 fp32 per row): a trial or a step of B rows needs about 50 MiB per row above what the
# process holds (measured: 8 rows 397 MiB, 4 rows 200, 2 rows 101), plus fit_batch's 64 MiB margin
FULL_LOGITS = f"--block-size 64 --seq-len 64 --total-batch-size {8 * 64} --loss-chunk 0 --warmup-steps 3".split()
# glibc's adaptive mmap threshold keeps up to 64 MiB of freed heap mapped after a big free, and each thread's
# own malloc arena reserves 64 MiB, both of which an address-space limit counts as used: a fixed threshold and
# one arena make the limit track what is allocated
FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}
# squeeze_memory.py leaves that share of what a step took so far (the --batch-size auto trial of all of a rank's
# rows and its margin, or a step at them): half of the rows fit, all of them do not
SQUEEZED_TO = "65%"
# the line's addition where a process runs under an address-space limit, as a squeezed one does
LIMIT_NAMED = re.compile(r"; or raise the memory limit this process runs under \(ulimit -v, \d+ KiB\)")


def limit_named(line: str) -> str:
    """line, which names the address-space limit its process ran under, without that addition."""
    assert LIMIT_NAMED.search(line), line
    return LIMIT_NAMED.sub("", line)


# one row's fp32 logits, 64 tokens x 50257 ids x 4 bytes: one allocation that the step of a row must make
ROW_LOGITS = 64 * 50257 * 4
# squeeze_memory.py as `python benchmarks/squeeze_memory.py` runs it, from the hard address-space limit (a program
# before it in the same interpreter may have lowered the soft one)
SQUEEZE_AFRESH = """
import resource, runpy, sys
resource.setrlimit(resource.RLIMIT_AS, (resource.getrlimit(resource.RLIMIT_AS)[1],) * 2)
sys.argv[0] = "benchmarks/squeeze_memory.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def squeezed_alone(data_dir, tmp_path_factory):
    """The three one-process runs under squeeze_memory.py's limits, as programs in one interpreter, the tightest
    first: {name: (CompletedProcess, out_dir)}. Each squeeze counts from what the process holds when applied, and a
    tensor's allocation is a mapping of its own (FIXED_MMAP): the memory a run before freed cannot serve it."""
    tmp = tmp_path_factory.mktemp("squeezed")
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    stack = 8 * 2**20 if stack == resource.RLIM_INFINITY else min(stack, 8 * 2**20)  # (glibc's 8 MiB at most)
    runs = {  # name: (squeeze, extra flags, steps); see each test for the amount
        "no_trial": (f"{(MARGIN_CPU + 2 * ROW_LOGITS + stack) // 2**20 - 1}MiB", [], 2),
        "one_row": (f"0:{ROW_LOGITS // 2**20}MiB", ["--total-batch-size", "64"], 4),
        "a_step": (f"2:{SQUEEZED_TO}", [], 4),
    }
    cases = []
    for name, (squeeze, extra, steps) in runs.items():
        flags = [*FULL_LOGITS, "--batch-size", "auto", *extra]
        args = tiny_run_args(data_dir, tmp / name, *flags, steps=steps, ckpt_every=0)
        cases.append(dict(argv=["-c", SQUEEZE_AFRESH, "--squeeze", squeeze, "--", *args]))
    with pytest.MonkeyPatch.context() as env:  # (read by glibc when the interpreter starts)
        for name, value in FIXED_MMAP.items():
            env.setenv(name, value)
        results = run_as_programs(cases)
    return {name: (result, tmp / name) for name, result in zip(runs, results)}


def test_auto_batch_size_and_a_step_out_of_memory_keep_the_loss_curve(data_dir, tmp_path, squeezed_alone):
    """--batch-size auto finds that all 8 rows fit; squeezed before step 2, the step runs out of memory at 8 rows and
    is redone at 4. The losses are --batch-size 8's resumed at step 2 with 4, bit for bit: nothing leaked."""
    result, out = squeezed_alone["a_step"]
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if "rows per micro-step" in line]
    chose = "--batch-size auto: 8 rows per micro-step fit cpu, 1 accumulation steps (tried 8: fits; 1 trials, "
    redone = r"step     2 \| out of memory at 8 rows per micro-step \(tried to allocate \d+ bytes\): the step again at 4 rows \(2 accumulation steps\), the same rows and numbers"
    assert lines[0].startswith(chose) and re.fullmatch(redone, lines[1]), lines
    assert len(lines) == 2 and "batch: 512 tokens/step = 8 rows x 64 tokens x 1 accumulation steps" in result.stdout
    records = log_records(out)
    assert len({r["run"] for r in records}) == 1  # one run throughout (the step redone is not a new one)
    events = [{k: v for k, v in r.items() if k not in ("search_s", "run")} for r in records if "event" in r]
    assert events == [
        dict(step=0, event="batch_size", batch_size=8, tried="8: fits"),
        dict(step=2, event="batch_size", batch_size=4, reason="out of memory"),
    ]
    ref = tmp_path / "hand_picked"
    assert tg.main(tiny_run_args(data_dir, ref, *FULL_LOGITS, steps=2, B=8, ckpt_every=2)) == 0
    assert tg.main(tiny_run_args(data_dir, ref, *FULL_LOGITS, "--resume", steps=4, B=4)) == 0
    assert losses(out) == losses(ref) and len(losses(out)) == 4


def test_auto_batch_size_of_one_row_out_of_memory_names_what_else_shrinks_a_step(data_dir, squeezed_alone):
    """A step of one row: the trial of it fits; before step 0 less than ROW_LOGITS is left free, and the step runs out
    of memory. The folder (no checkpoint, a log of one batch-size record) does not refuse the next attempt."""
    result, out = squeezed_alone["one_row"]  # ROW_LOGITS in whole MiB left free before step 0
    assert_one_error_line(result)
    line, head = limit_named(result.stderr.strip()), "error: out of memory on cpu (tried to allocate "
    expected = "not even one row per micro-step fits (--batch-size auto chose 1): pass --activation-checkpointing, a shorter --seq-len or a smaller model. Last good checkpoint: none"
    assert line.startswith(head) and line.endswith(expected), line
    left = out.joinpath("log.jsonl").read_text()
    assert [r["event"] for r in log_records(out)] == ["batch_size"]
    for extra in [(), ("--resume",)]:  # a rerun, and a resume, of the run that never wrote a checkpoint
        out.joinpath("log.jsonl").write_text(left)
        for path in out.glob("ckpt_*.pt"):
            os.remove(path)
        result = run_main("train_gpt2.py", *tiny_run_args(data_dir, out, *extra, steps=2, ckpt_every=2))
        note = f"note: {out}/log.jsonl holds no trained step (of run {json.loads(left)['run']}, which stopped before its first step): this run starts it afresh"
        assert (result.returncode, note in result.stdout, trained_steps(out)) == (0, True, [0, 1]), result.stderr


def test_auto_batch_size_that_cannot_try_one_row_says_so(squeezed_alone):
    """Free from the start: the room of the first thread's stack (ulimit -s) and of the trial of one row (MARGIN_CPU,
    beside 6 MiB of AdamW moments, and two ROW_LOGITS buffers: logits and softmax), 1 MiB short."""
    result = squeezed_alone["no_trial"][0]
    assert_one_error_line(result)
    line = limit_named(result.stderr.strip())
    expected = "): --batch-size auto could not try even one row per micro-step: pass --activation-checkpointing, a shorter --seq-len or a smaller model. Last good checkpoint: none"
    assert line.startswith("error: out of memory on cpu (") and line.endswith(expected), line


def test_under_torchrun_the_ranks_agree_and_a_step_out_of_memory_is_one_line(data_dir, tmp_path):
    """Both ranks' --batch-size auto agree on 4 rows; rank 1 is squeezed before step 2. A step cannot be redone
    under torchrun (rank 0 waits in the all-reduce): rank 1 names --batch-size in one line, rank 0 a lost peer."""
    out = tmp_path / "ddp"
    args = tiny_run_args(data_dir, out, *FULL_LOGITS, "--batch-size", "auto", steps=4, ckpt_every=0)
    squeeze = ["--rank", "1", "--squeeze", f"2:{SQUEEZED_TO}", "--", *args]
    result = run_cli(squeeze, 2, "benchmarks/squeeze_memory.py", env=FIXED_MMAP)
    assert result.returncode != 0
    chose = "--batch-size auto: 4 rows per micro-step fit cpu, 1 accumulation steps (tried 4: fits; 1 trials"
    assert chose in result.stdout, result.stdout + result.stderr[-3000:]
    assert "batch: 512 tokens/step = 4 rows x 64 tokens x 1 accumulation steps x 2 ranks" in result.stdout
    errors = sorted(line for line in result.stderr.splitlines() if line.startswith("error: "))
    assert errors[0].startswith("error: rank 0: another rank of this launch died or stopped answering (")
    assert errors[1].startswith("error: rank 1: out of memory on cpu (tried to allocate ")
    expected = " bytes): --batch-size auto chose 4 rows per micro-step, which fit its trial but not this step: pass a smaller --batch-size, --activation-checkpointing or a shorter --seq-len. Last good checkpoint: none"
    assert limit_named(errors[1]).endswith(expected)
    ref = tmp_path / "one_process"
    assert tg.main(tiny_run_args(data_dir, ref, *FULL_LOGITS, steps=2, B=4, ckpt_every=0)) == 0
    np.testing.assert_allclose([loss for _, loss in losses(out)], [loss for _, loss in losses(ref)], rtol=2e-5)


# --- ranks ----------------------------------------------------------------------------------
def test_bad_data_seen_by_one_rank_is_printed_by_that_rank(tmp_path):
    """Rank 1 reads a token beyond --vocab-size at step 0 (a manifest's max_id of 63, as for a shard changed since,
    hides it from the start-up check): only rank 1 knows why it stops and prints its line; rank 0 names the lost rank."""
    (data := tmp_path / "data").mkdir()
    train, val = np.random.default_rng(0).integers(0, 64, (2, 4000)).astype(np.uint16)
    train[20] = 600  # in row 1 of the train shard (tokens 16..32), not row 0's
    np.save(data / "synth_train_000000.npy", train)
    np.save(data / "synth_val_000000.npy", val)
    write_manifest(data, **{name: {"max_id": 63, "sha256": None} for name in os.listdir(data)})
    flags = "--vocab-size 512 --batch-size 1 --total-batch-size 32 --no-shuffle".split()  # row 1 is rank 1's
    result = run_cli(tiny_run_args(str(data), tmp_path / "out", *flags, steps=4), nproc=2)
    errors = sorted(line for line in result.stderr.splitlines() if line.startswith("error: "))
    assert len(errors) == 2, result.stderr[-3000:]
    lost = "error: rank 0: another rank of this launch died or stopped answering ("
    assert errors[0].startswith(lost) and errors[0].endswith(". Last good checkpoint: none"), errors[0]
    bad_id = "holds token id 600, which the model has no output for (--vocab-size 512: ids 0..511); wrong tokenizer or --vocab-size too small"
    assert (errors[1], result.returncode != 0) == (f"error: rank 1: {data}/synth_train_000000.npy {bad_id}", True)


# --- warnings ---
WARNINGS = {
    "warmup": "warning: --warmup-steps 10 is longer than --max-steps 4: the learning rate only rises, to 0.004 at the last step, and never reaches --max-lr 0.01\n",
    "W&B fails mid-run": "warning: --wandb failed at step 2 (ConnectionError: wandb service process exited) and gets no more records; {out}/log.jsonl has them all\n",
    "W&B disabled": "warning: --wandb: W&B is disabled here (WANDB_MODE=disabled or WANDB_DISABLED), so the W&B run stays empty; log.jsonl gets every record\n",
    "W&B cannot start": None,
}


@pytest.mark.parametrize("case", WARNINGS)
def test_a_warning_is_one_line_and_the_run_trains_on(data_dir, tmp_path, request, case):
    """A warmup longer than the run; a W&B whose service fails the way a network or a crash would (a stand-in:
    fake_wandb), or that is disabled (the real one); one that cannot start is refused before log.jsonl exists."""
    if case == "W&B disabled":
        pytest.importorskip("wandb")
    elif case != "warmup":
        request.getfixturevalue("fake_wandb")
    flags = {"warmup": ["--warmup-steps", "10"], "W&B cannot start": ["--wandb", "no-such-entity"]}
    args = tiny_run_args(data_dir, tmp_path, *flags.get(case, ["--wandb", "p"]), steps=4, ckpt_every=0)
    result = run_main("train_gpt2.py", *args, env={"WANDB_MODE": "disabled"} if case == "W&B disabled" else None)
    if case == "W&B cannot start":
        assert_one_error_line(result, "--wandb: could not start a W&B run (RuntimeError: permission denied")
        assert not (tmp_path / "log.jsonl").exists()
        return
    warning = WARNINGS[case].format(out=tmp_path)
    assert (result.returncode, result.stderr, trained_steps(tmp_path)) == (0, warning, [0, 1, 2, 3])


def test_resume_after_the_shards_changed_is_a_warning(finished_run, finished_copy, data_dir, tmp_path):
    data, out = tmp_path / "data", finished_copy  # (checkpoints at steps 2 and 4)
    shutil.copytree(data_dir, data)
    train = sorted(data.glob("*_train_*.npy"))
    np.save(train[-1], np.load(train[-1])[::-1])  # the last shard re-made with other tokens, of the same size
    size = train[-1].stat().st_size
    result = run_main("train_gpt2.py", *tiny_run_args(str(data), out, "--resume", steps=6, ckpt_every=2))
    saved = checkpoints.load_checkpoint(str(finished_run / "ckpt_0000004.pt"))["data_files"]["train"]
    was = {name: content for name, _, content, _ in saved}[train[-1].name][:12]
    now = shard_files([str(train[-1])])[0][2][:12]
    changed = f"(train shard {train[-1].name}: {size} bytes of sampled content {was} then, {size} bytes of sampled content {now} now)"
    warning = f"warning: --data-dir {data} changed since {out}/ckpt_0000004.pt was written {changed}: from step 4 on this run reads other rows than the run it continues would have\n"
    assert (result.returncode, result.stderr, trained_steps(out)) == (0, warning, [0, 1, 2, 3, 4, 5])
