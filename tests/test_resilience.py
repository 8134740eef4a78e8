"""Runs that survive: exact resume, preemption, bad numbers, bad files, multi-node."""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from trainkit.data.shards import ShardDigestCheck
from trainkit.runfiles import checkpoints
from trainkit.runfiles import resume
import train_gpt2 as tg
from conftest import child_pids, free_port, kill_group, kill_pids, log_records, losses, ranks_report, resume_copy
from conftest import start, start_on_ranks, tiny_run_args, torchrun, train_records, wait_for, wait_for_steps
from shards import write_manifest

SHARDS = dict(n_docs=500, seed=2)


def same_weights(a, b, step) -> bool:
    """Whether runs a and b saved bit-identical weights at step."""
    a, b = (checkpoints.load_checkpoint(os.path.join(d, f"ckpt_{step:07d}.pt"))["model"] for d in (a, b))
    return all(torch.equal(a[k], b[k]) for k in a)


def stop_after(monkeypatch, last_step, each_step=lambda trainer: None):
    """A trainer run in this process stops as on a signal during step last_step (it trains one more: a checkpoint at
    last_step + 2), calling each_step(trainer) after each logged step: the reference of a run a signal stopped."""
    log_step = tg.Trainer.log_step

    def log_step_then_stop(self, step, result, progress):
        log_step(self, step, result, progress)
        each_step(self)
        self.stop.requested |= step >= last_step

    monkeypatch.setattr(tg.Trainer, "log_step", log_step_then_stop)


# --- exact resume -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "align",
    [[], ["--align-docs"], ["--optimizer", "muon"], ["--doc-mask"]],
    ids=["plain", "align-docs", "muon", "doc-mask"],
)
def test_resume_is_bit_exact(data_dir, tmp_path, align):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert tg.main(tiny_run_args(data_dir, straight, *align)) == 0
    resume_copy(straight, resumed, 10)
    assert tg.main(tiny_run_args(data_dir, resumed, *align, "--resume")) == 0
    assert losses(resumed) == losses(straight) and same_weights(straight, resumed, 20)  # no step logged twice


def test_rows_are_shuffled_by_default_and_a_resume_keeps_its_order_unless_told(data_dir, tmp_path, capsys):
    runs = {"default": [], "shuffle": ["--shuffle"], "no-shuffle": ["--no-shuffle"]}
    for name, flags in runs.items():
        assert tg.main(tiny_run_args(data_dir, tmp_path / name, *flags, steps=1, ckpt_every=1)) == 0
    torch.manual_seed(1337)  # the trainer's init: --seed's default
    model = tg.GPT(tg.GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=32))
    for name, shuffle in (("default", True), ("shuffle", True), ("no-shuffle", False)):
        x, y = tg.TokenRows(data_dir, "train", 16, shuffle=shuffle, seed=1337).batch(0, 8)  # step 0's rows
        loss = model(torch.from_numpy(x), torch.from_numpy(y))[1].item()
        assert losses(tmp_path / name)[0][1] == pytest.approx(loss, rel=1e-6), name
        assert checkpoints.load_checkpoint(str(tmp_path / name))["launch"]["shuffle"] == shuffle
    assert losses(tmp_path / "default") != losses(tmp_path / "no-shuffle")
    # a resume that does not say goes on in its checkpoint's order; one that says otherwise is refused
    assert tg.main(tiny_run_args(data_dir, tmp_path / "no-shuffle", "--resume", steps=2, ckpt_every=1)) == 0
    assert checkpoints.load_checkpoint(str(tmp_path / "no-shuffle"))["launch"]["shuffle"] is False
    for name, flags, saved, now in (
        ("default", ["--no-shuffle"], True, False),
        ("no-shuffle", ["--shuffle"], False, True),
        ("default", ["--optimizer", "muon"], "adamw", "muon"),
        ("default", ["--n-embd", "32"], 16, 32),
    ):
        assert tg.main(tiny_run_args(data_dir, tmp_path / name, *flags, "--resume", steps=3)) == 2
        key = flags[0].strip("-").replace("no-", "").replace("-", "_")
        err = capsys.readouterr().err
        assert f"{key}: checkpoint {saved} vs now {now}. Use the same model, batch and optimizer flags" in err


def test_keep_last_and_a_folder_of_checkpoints_refuses_a_fresh_run(data_dir, tmp_path, capsys):
    assert tg.main(tiny_run_args(data_dir, tmp_path, "--keep-last", "2", steps=8, ckpt_every=2)) == 0
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".pt")) == ["ckpt_0000006.pt", "ckpt_0000008.pt"]
    run_id = resume.read_run(str(tmp_path / "ckpt_0000008.pt"))["id"]
    capsys.readouterr()
    assert tg.main(tiny_run_args(data_dir, tmp_path, steps=2)) == 2
    expected = f"error: --out-dir {tmp_path} already holds checkpoints of run {run_id}: pass --resume to continue that run, or choose another --out-dir\n"
    assert capsys.readouterr().err == expected


# --- preemption -----------------------------------------------------------------------------
def test_under_nohup_sighup_changes_nothing_and_sigterm_checkpoints_a_run_that_resumes_as_if_never_stopped(
    data_dir, tmp_path, monkeypatch
):
    """nohup starts the run with SIGHUP ignored: a SIGHUP changes nothing. SIGTERM stops it after its step with one
    checkpoint and a line saying to --resume; resumed, it has the losses and weights of a run never stopped."""
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    proc = start(
        [sys.executable, "train_gpt2.py", *tiny_run_args(data_dir, preempted, steps=100000, ckpt_every=0)],
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),  # what nohup does
    )
    try:
        wait_for_steps(preempted, 3, proc)
        proc.send_signal(signal.SIGHUP)
        wait_for_steps(preempted, len(losses(preempted)) + 10, proc)  # still training, 10 steps later
        assert not list(preempted.glob("ckpt_*.pt"))
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, err) == (0, "")
    (stop_line,) = [line for line in out.splitlines() if line.startswith("stopped by signal")]
    stop_step = int(re.fullmatch(r"stopped by signal at step (\d+); .*--resume.*", stop_line)[1])
    assert stop_step >= 13 and sorted(os.listdir(preempted)) == [f"ckpt_{stop_step:07d}.pt", "log.jsonl"]
    stop_after(monkeypatch, stop_step + 3)
    for out_dir, flags in ((preempted, ["--resume"]), (straight, [])):
        assert tg.main(tiny_run_args(data_dir, out_dir, *flags, steps=100000, ckpt_every=0)) == 0
    assert losses(preempted) == losses(straight) and same_weights(straight, preempted, stop_step + 5)


# --- bad numbers ----------------------------------------------------------------------------
def inject(monkeypatch, at_call, how):
    """Make the accumulate_gradients call number at_call (0-based) produce bad numbers: NaNs, or a loss spike."""
    original, calls = tg.accumulate_gradients, []

    def patched(model, *args, **kwargs):
        loss = original(model, *args, **kwargs)
        calls.append(1)
        if len(calls) - 1 != at_call:
            return loss
        if how == "nan":
            next(model.parameters()).grad.fill_(float("nan"))
        return loss * (float("nan") if how == "nan" else 50)

    monkeypatch.setattr(tg, "accumulate_gradients", patched)


def all_finite(path):
    return all(torch.isfinite(t).all() for t in checkpoints.load_checkpoint(path)["model"].values())


def test_nan_stops_the_run_before_the_update(data_dir, tmp_path, monkeypatch, capsys):
    inject(monkeypatch, 5, "nan")
    assert tg.main(tiny_run_args(data_dir, tmp_path, steps=10, ckpt_every=4)) == 2
    err = capsys.readouterr().err
    assert "step 5: non-finite loss nan" in err and f"Last good checkpoint: {tmp_path / 'ckpt_0000004.pt'}" in err
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".pt")) == ["ckpt_0000004.pt"]
    assert all_finite(tmp_path / "ckpt_0000004.pt")


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize(
    "how,flag,at,steps", [("nan", "--skip-nonfinite 1", 5, 10), ("spike", "--skip-spikes 6", 30, 35)]
)
def test_skip_flags_skip_that_update(data_dir, tmp_path, monkeypatch, optimizer, how, flag, at, steps):
    """--skip-nonfinite skips the update of a non-finite step, --skip-spikes that of a loss spike: that step only."""
    inject(monkeypatch, at, how)
    args = tiny_run_args(data_dir, tmp_path, *flag.split(), "--optimizer", optimizer, steps=steps, ckpt_every=0)
    assert tg.main(args) == 0
    skipped = [(r["step"], r["skipped"]) for r in log_records(tmp_path) if r.get("skipped")]
    assert skipped == [(at, {"nan": "nonfinite", "spike": "spike"}[how])]
    assert all_finite(tmp_path / f"ckpt_{steps:07d}.pt")


# --- bad files --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,data,message",
    [
        ("truncated", None, "cannot read token shard (mmap length is greater than file size)"),
        ("garbage", b"not a numpy file at all", "not a .npy token shard (bad magic)"),
        ("int32", np.arange(1000, dtype=np.int32), "expected a 1-D uint16 token array, got int32"),
        ("short", np.arange(5, dtype=np.uint16), "5 tokens, fewer than one row of --seq-len 16 + 1"),
    ],
)
def test_bad_shard_is_one_line_naming_the_file(tmp_path, capsys, name, data, message):
    if data is None:  # a shard cut short while it was copied
        full = tmp_path / "full.npy"
        np.save(full, np.arange(1000, dtype=np.uint16))
        data = full.read_bytes()[:500]
    (tmp_path / name).mkdir()  # a good shard, then the bad one
    np.save(tmp_path / name / "good_train_000000.npy", np.arange(2000, dtype=np.uint16) % 64)
    bad = tmp_path / name / "bad_train_000001.npy"
    bad.write_bytes(data) if isinstance(data, bytes) else np.save(bad, data)
    assert tg.main(tiny_run_args(tmp_path / name, tmp_path / "out", steps=300, ckpt_every=0)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}") and message in err and err.count("\n") == 1


def test_unwritable_out_dir_and_corrupt_checkpoint(data_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert tg.main(tiny_run_args(data_dir, tmp_path / "file" / "out", steps=1)) == 2
    assert f"cannot write to --out-dir {tmp_path / 'file' / 'out'}" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt_0000005.pt").write_bytes(b"\x00" * 100)
    assert tg.main(tiny_run_args(data_dir, tmp_path / "run", "--resume", steps=10)) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'run' / 'ckpt_0000005.pt'}: cannot load checkpoint" in err and err.count("\n") == 1


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(data_dir, tmp_path, monkeypatch, capsys):
    real_save, saves = torch.save, []

    def failing_save(obj, file):
        saves.append(file)
        if len(saves) == 2:  # the second checkpoint: half written, then the disk fills up
            file.write(b"PK\x03\x04 partial")
            raise OSError(28, "No space left on device")
        real_save(obj, file)

    monkeypatch.setattr(tg.torch, "save", failing_save)
    assert tg.main(tiny_run_args(data_dir, tmp_path, steps=10, ckpt_every=4)) == 2
    err = capsys.readouterr().err
    assert (
        f"could not write checkpoint {tmp_path / 'ckpt_0000008.pt'}: no space left on device; the previous "
        f"checkpoint {tmp_path / 'ckpt_0000004.pt'} is intact" in err
    )
    assert sorted(os.listdir(tmp_path)) == ["ckpt_0000004.pt", "log.jsonl"]
    assert checkpoints.load_checkpoint(str(tmp_path / "ckpt_0000004.pt"))["step"] == 4


# --- multi-node -------------------------------------------------------------------------------
def test_two_nodes_on_loopback_train_as_one_process_and_a_dead_node_makes_the_other_exit(
    data_dir, tmp_path, monkeypatch
):
    """Two torchrun launches of one process each meet at a c10d rendezvous on 127.0.0.1: their losses are one
    process's. The second node's training process dies: the first exits, within its --dist-timeout (30 s)."""
    stop_after(monkeypatch, 4)
    assert tg.main(tiny_run_args(data_dir, tmp_path / "single", steps=100000, ckpt_every=0)) == 0
    args = tiny_run_args(data_dir, tmp_path / "nodes", "--dist-timeout", "30", steps=100000, ckpt_every=0)
    rdzv = f"--nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:{free_port()} --rdzv-id=t"
    nodes = [start([*torchrun(*rdzv.split(), "--max-restarts=0"), "train_gpt2.py", *args]) for _ in range(2)]
    try:
        wait_for_steps(tmp_path / "nodes", 6, nodes[0])
        kill_pids(child_pids(nodes[1].pid))  # the second node's training process dies
        began = time.time()
        nodes[0].communicate(timeout=300)
        assert nodes[0].returncode != 0
        assert time.time() - began < 200  # it does not hang (seconds on a quiet machine)
    finally:
        for p in nodes:
            kill_pids(child_pids(p.pid) + [p.pid])
            p.wait(timeout=120)
    (steps_a, loss_a), (steps_b, loss_b) = zip(*losses(tmp_path / "single")), zip(*losses(tmp_path / "nodes")[:6])
    assert steps_a == steps_b == tuple(range(6))
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-5)


def test_a_stop_ends_the_shard_check_still_running(data_dir, tmp_path, monkeypatch, capsys):
    """Stopped while the full sha256 check of its shards still reads them, the check ends with the run (its thread
    joined), not left hashing while the interpreter shuts down."""
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    np.save(data / "synth_train_000099.npy", np.random.default_rng(0).integers(0, 64, 2_000_000).astype(np.uint16))
    write_manifest(data)
    monkeypatch.setattr(ShardDigestCheck, "CHUNK", 16)  # 4 MB in 16-byte reads: seconds, not milliseconds
    hashing_at_stop = []  # a SIGTERM during the first step (the next one stops)
    stop_after(monkeypatch, 0, lambda trainer: hashing_at_stop.append(trainer.shard_check.thread.is_alive()))
    assert tg.main(tiny_run_args(str(data), tmp_path / "out", steps=100000, ckpt_every=0)) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("stopped by signal at step 2; ")
    assert hashing_at_stop[-1] is True  # still hashing when the run stopped
    assert not [t for t in threading.enumerate() if t.name == "shard sha256"]


def test_on_two_ranks_a_signal_stops_every_rank_at_one_step_and_a_resume_trains_on_the_same_rows(
    data_dir, tmp_path, monkeypatch
):
    """One launch of three cases (start_on_ranks). DDP, then FSDP, a checkpoint every step: SIGTERM to rank 1 alone
    stops both ranks at the step just saved, each exiting 0. Then a one-process checkpoint (step 10; 4 rows x 2
    micro-steps) resumed on 2 ranks (2 rows x 2 each): the same rows, so the same losses; Ctrl-C (SIGINT to the
    group) ends it, rank 0's last line naming the checkpoint and torchrun's SignalException (exit 1) as harmless."""
    one, two = tmp_path / "one", tmp_path / "two"
    stop_after(monkeypatch, 18)
    assert tg.main(tiny_run_args(data_dir, one, "--align-docs", steps=100000, B=4)) == 0
    resume_copy(one, two, 10)
    stopped = {mode: tmp_path / mode for mode in ("ddp", "fsdp")}
    cases = [
        tiny_run_args(data_dir, stopped["ddp"], "--keep-last", "1", steps=100000, ckpt_every=1, B=2),
        tiny_run_args(data_dir, stopped["fsdp"], "--keep-last", "1", "--fsdp", steps=100000, ckpt_every=1, B=2),
        tiny_run_args(data_dir, two, "--align-docs", "--resume", steps=100000, ckpt_every=0, B=2),
    ]
    proc = start_on_ranks(
        [dict(script="train_gpt2", argv=[args, args]) for args in cases],
        tmp_path / "report",
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        for out in stopped.values():
            wait_for_steps(out, 3, proc)
            workers = child_pids(proc.pid)
            assert len(workers) == 2
            os.kill(workers[1], signal.SIGTERM)
        # the steps from the checkpoint on, as the reference's: step 19 logged by this launch, not the copied one
        copied = train_records(one)[19]
        wait_for(lambda: len(records := train_records(two)) >= 20 and records[19] != copied, proc, what="step 19")
        kill_group(proc, signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        kill_group(proc)
    traceback = "torch.distributed.elastic.multiprocessing.api.SignalException: Process "
    assert proc.returncode == 1 and err.splitlines()[-1].startswith(traceback)  # torchrun's, not ours
    assert "Sending process" in err and "forcefully" not in err  # the ranks ended themselves (no SIGKILL)
    results = ranks_report(tmp_path / "report")
    for out, ranks in zip([*stopped.values(), two], results):
        assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-3000:] for r in ranks]
        step = int(ranks[0].stdout.split("stopped by signal at step ")[1].split(";")[0])
        path = out / f"ckpt_{step:07d}.pt"
        assert checkpoints.load_checkpoint(str(path))["step"] == step
        assert [s for s, _ in losses(out)] == list(range(step))
        resumed = ["ckpt_0000010.pt"] if out == two else []  # (--keep-last 1 in the others)
        assert sorted(os.listdir(out)) == [*resumed, path.name, "log.jsonl"]
    out = results[2][0].stdout
    assert "batch: 128 tokens/step = 2 rows x 16 tokens x 2 accumulation steps x 2 ranks" in out
    (steps_a, loss_a), (steps_b, loss_b) = zip(*losses(one)), zip(*losses(two)[:20])
    assert steps_a == steps_b == tuple(range(20))
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-5)
    expected = f"stopped by signal at step {step}; checkpoint {path} is complete and safe. Resume with the same command plus --resume (torchrun's SignalException traceback, if one follows, only reports the signal it passed on)"
    assert out.splitlines()[-1] == expected
