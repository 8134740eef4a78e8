"""--eval-only: the validation loss and HellaSwag of a checkpoint without training, equal to
what training logged at that checkpoint's step; the run's folder is left as it was."""

import json
import os

import pytest

from conftest import GPT2_VOCAB_RUN, HELLASWAG_FILE, assert_refused, log_records, run_main, tiny_run_args, tree_hashes

SHARDS = dict(n_docs=400, seed=5, max_len=60)


@pytest.fixture(scope="module")
def evaluated_run(data_dir, tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4: (command flags, out dir)."""
    evaluations = ["--val-steps", "3", "--hellaswag-limit", "6", "--hellaswag-file", str(HELLASWAG_FILE)]
    sizes = dict(steps=4, ckpt_every=2, val_every=2, hellaswag_every=2, **GPT2_VOCAB_RUN)
    out = tmp_path_factory.mktemp("run")
    flags = tiny_run_args(data_dir, out, *evaluations, **sizes)
    result = run_main("train_gpt2.py", *flags)
    assert result.returncode == 0, result.stderr
    return flags, out


def logged_at(out, step):
    """The evaluations logged at step, without the log's run id (an evaluation writes none)."""
    records = [r for r in log_records(out) if r["step"] == step and "loss" not in r]
    return {k: v for r in records for k, v in r.items() if k != "run"}


EVALUATIONS = {  # train_gpt2.py --eval-only and these (FLAGS: the run's own, {out}: its folder): the step evaluated
    "FLAGS --resume {out}/ckpt_0000002.pt": 2,
    "FLAGS --resume": 4,
    "FLAGS --resume --max-steps 100": 4,  # a longer schedule neither stops nor moves it
    "--resume {out}": 4,  # alone: the model, batch, data and evaluation flags of the checkpoint's run
    "--resume {out} --hellaswag-every 0": 4,  # a flag the command gives still wins
}


@pytest.mark.parametrize("command", EVALUATIONS)
def test_eval_only_equals_what_training_logged(evaluated_run, command):
    flags, out = evaluated_run
    step, before, words = EVALUATIONS[command], tree_hashes(out), command.format(out=out).split()
    result = run_main("train_gpt2.py", "--eval-only", *([*flags, *words[1:]] if words[0] == "FLAGS" else words))
    assert result.returncode == 0, result.stderr
    assert "note:" not in result.stdout
    lines = result.stdout.strip().splitlines()
    assert f"evaluating {out / f'ckpt_{step:07d}.pt'} at step {step}" in lines
    evaluated, logged = json.loads(lines[-1]), logged_at(out, step)
    dropped = "hellaswag" if "--hellaswag-every 0" in command else None  # (what the command turned off)
    assert evaluated == {k: v for k, v in logged.items() if not (dropped and k.startswith(dropped))}  # exact
    assert {"step", "val_loss"} <= set(evaluated)
    assert f"step {step:5d} | val loss " in result.stdout and "| loss " not in result.stdout  # no training step
    assert tree_hashes(out) == before  # log and checkpoints untouched


REFUSALS = {  # the flags after --eval-only: the error ({empty}: an empty folder)
    "": "--eval-only needs weights to evaluate: --resume [PATH] or --init-from NAME_OR_DIR",
    "--resume --out-dir {empty}": "--eval-only --resume: no checkpoint (ckpt_*.pt) in --out-dir {empty}",
    "--resume --val-every 0 --hellaswag-every 0": "--eval-only with --val-every 0, --hellaswag-every 0 and "
    "--sample-every 0 has nothing to do",
}


@pytest.mark.parametrize("extra", REFUSALS)
def test_eval_only_errors_are_one_line(evaluated_run, tmp_path, extra):
    flags, _ = evaluated_run
    extra, message = (text.replace("{empty}", str(tmp_path)) for text in (extra, REFUSALS[extra]))
    assert_refused(run_main("train_gpt2.py", *flags, "--eval-only", *extra.split()), message)
    assert os.listdir(tmp_path) == []
