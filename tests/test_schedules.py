"""LR schedules (cosine, linear, wsd), the notice when a resume moves the LR, and a finished WSD run extended from
a checkpoint before its cooldown."""

import math
import os

import pytest

from trainkit import cli, train_flags
import train_gpt2 as tg
from conftest import GPT2_VOCAB_RUN, assert_one_error_line, run_main, tiny_run_args, train_records

SHARDS = dict(n_docs=400, seed=3, max_len=60)


def tiny(data_dir, out, *extra, steps, ckpt_every=0):
    return tiny_run_args(data_dir, out, *extra, steps=steps, ckpt_every=ckpt_every, **GPT2_VOCAB_RUN)


def schedule(**kw):
    return tg.RunConfig(**{"max_lr": 1.0, "min_lr": 0.5, **kw})


def test_linear_and_wsd_values_at_key_steps():
    # linear: 8 warmup steps, then 1.0 -> 0.5 over 128 steps
    run = schedule(lr_schedule="linear", max_steps=136, warmup_steps=8)
    assert [tg.get_lr(s, run) for s in (0, 3, 7, 8, 72, 104, 136, 500)] == [0.125, 0.5, 1.0, 1.0, 0.75, 0.625, 0.5, 0.5]
    # wsd: warmup 8, constant to step 96, then 1.0 -> 0.5 over the last 32 steps (a quarter of 128)
    run = schedule(lr_schedule="wsd", max_steps=128, warmup_steps=8, cooldown_frac=0.25)
    assert run.cooldown_start == 96
    lrs = [tg.get_lr(s, run) for s in (0, 7, 8, 50, 95, 96, 104, 112, 120, 127, 128)]
    assert lrs == [0.125, 1.0, 1.0, 1.0, 1.0, 1.0, 0.875, 0.75, 0.625, 1.0 - 31 / 32 * 0.5, 0.5]
    # cooldown_frac 0: constant to the end; 1: the decay starts right after warmup (that is linear)
    assert tg.get_lr(127, schedule(lr_schedule="wsd", max_steps=128, warmup_steps=0, cooldown_frac=0.0)) == 1.0
    wsd_all = schedule(lr_schedule="wsd", max_steps=128, warmup_steps=0, cooldown_frac=1.0)
    linear = schedule(lr_schedule="linear", max_steps=128, warmup_steps=0)
    assert [tg.get_lr(s, wsd_all) for s in range(130)] == [tg.get_lr(s, linear) for s in range(130)]


def test_cosine_is_the_default_and_an_unknown_schedule_is_named():
    run = tg.RunConfig(max_steps=100, warmup_steps=10, max_lr=3e-3)  # the README's quickstart
    assert run.lr_schedule == "cosine" and run.min_lr is None
    min_lr = 3e-3 * 0.1
    assert tg.get_lr(0, run) == 3e-3 / 10 and tg.get_lr(9, run) == 3e-3 and tg.get_lr(10, run) == 3e-3
    assert tg.get_lr(55, run) == min_lr + 0.5 * (1.0 + math.cos(math.pi * 0.5)) * (3e-3 - min_lr)
    assert tg.get_lr(99, run) == min_lr + 0.5 * (1.0 + math.cos(math.pi * 89 / 90)) * (3e-3 - min_lr)
    assert tg.get_lr(100, run) == tg.get_lr(1000, run) == min_lr
    with pytest.raises(cli.UserError, match="--lr-schedule must be one of cosine, wsd, linear, got 'step'"):
        train_flags.check_flags(tg.RunConfig(lr_schedule="step", seq_len=64))  # (argparse's choices stop it first)


BAD_FLAGS = {
    "--cooldown-frac 1.5": "--cooldown-frac must be in [0, 1], got 1.5",
    "--lr-schedule wsd --warmup-steps 9 --cooldown-frac 0.2": "--warmup-steps 9 runs into the cooldown, which starts at step 8",
}


@pytest.mark.parametrize("args", BAD_FLAGS)
def test_bad_schedule_flags_are_one_line(data_dir, tmp_path, args):
    result = run_main("train_gpt2.py", *tiny(data_dir, tmp_path, *args.split(), steps=10))
    assert_one_error_line(result, BAD_FLAGS[args])
    assert os.listdir(tmp_path) == []


def test_resume_with_more_steps_says_the_lr_moves(data_dir, tmp_path):
    first = run_main("train_gpt2.py", *tiny(data_dir, tmp_path, steps=4))
    assert (first.returncode, "note:" in first.stdout) == (0, False), first.stderr
    resumed = run_main("train_gpt2.py", *tiny(data_dir, tmp_path, "--resume", steps=8))
    new = tg.get_lr(4, tg.RunConfig(max_steps=8, warmup_steps=2, max_lr=1e-2))  # 3/4 of the way up the cosine
    assert new == pytest.approx(1e-3 + 0.75 * 9e-3, rel=1e-12)
    notices = [line for line in resumed.stdout.splitlines() if line.startswith("note:")]
    notice = "note: the LR at step 4 moves from 1.0000e-03 to 7.7500e-03 (--max-steps 4 -> 8)"
    assert (resumed.returncode, notices) == (0, [notice]), resumed.stderr
    assert train_records(tmp_path)[4]["lr"] == new


def test_wsd_run_extended_from_before_its_cooldown_equals_a_longer_run(data_dir, tmp_path):
    """README: continue from the last checkpoint before the cooldown (step 8 of 10), into a new --out-dir."""
    short, extended, longer = (tmp_path / name for name in ("short", "extended", "longer"))
    wsd, resume = ["--lr-schedule", "wsd", "--cooldown-frac", "0.2"], ["--resume", short / "ckpt_0000008.pt"]
    for out, steps, extra in ((short, 10, []), (longer, 20, []), (extended, 20, resume)):
        result = run_main("train_gpt2.py", *tiny(data_dir, out, *wsd, *extra, steps=steps, ckpt_every=4))
        assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout and "note:" not in result.stdout  # the LR does not move
    short_log, extended_log, longer_log = (train_records(d) for d in (short, extended, longer))
    assert [r["lr"] for r in short_log[6:]] == [1e-2, 1e-2, 1e-2, 1e-2 - 0.5 * (1e-2 - 1e-2 * 0.1)]  # then cooldown
    assert [r["step"] for r in extended_log] == list(range(8, 20))
    # the same updates as a run planned for 20 steps from the start, bit for bit on CPU
    assert [(r["loss"], r["lr"]) for r in short_log[:8] + extended_log] == [(r["loss"], r["lr"]) for r in longer_log]
