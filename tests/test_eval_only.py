"""--eval-only: the validation loss and HellaSwag of a checkpoint without training, equal to
what training logged at that checkpoint's step; the run's folder is left as it was."""

import json
import os

import pytest

from conftest import GPT2_VOCAB_RUN, HELLASWAG_FILE, assert_refused, log_records, run_main, tiny_run_args

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


@pytest.mark.parametrize(
    "which, step, extra",
    [("ckpt_0000002.pt", 2, []), (None, 4, []), (None, 4, ["--max-steps", "100"]), (None, 4, None)],
    ids=["path", "latest", "longer-schedule", "the-checkpoints-flags"],
)
def test_eval_only_equals_what_training_logged(evaluated_run, which, step, extra):
    """Neither the checkpoints in --out-dir nor a changed --max-steps stop (or move) an evaluation; `--eval-only
    --resume PATH` alone (extra None) takes the model, batch, data and evaluation flags of the checkpoint's run."""
    flags, out = evaluated_run
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    resume = ["--resume", str(out / which)] if which else ["--resume"] if extra is not None else ["--resume", str(out)]
    result = run_main("train_gpt2.py", *(flags if extra is not None else []), "--eval-only", *resume, *(extra or []))
    assert result.returncode == 0, result.stderr
    assert "note:" not in result.stdout
    lines = result.stdout.strip().splitlines()
    assert f"evaluating {out / (which or 'ckpt_0000004.pt')} at step {step}" in lines
    evaluated = json.loads(lines[-1])
    assert evaluated == logged_at(out, step) and {"step", "val_loss"} <= set(evaluated)  # exact: the same weights
    assert f"step {step:5d} | val loss " in result.stdout and "| loss " not in result.stdout  # no training step
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # log and checkpoints untouched


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


def test_a_flag_the_command_gives_wins_over_the_checkpoints(evaluated_run):
    _, out = evaluated_run
    result = run_main("train_gpt2.py", "--eval-only", "--resume", str(out), "--hellaswag-every", "0")
    assert result.returncode == 0, result.stderr
    evaluated = json.loads(result.stdout.strip().splitlines()[-1])
    assert evaluated == {k: v for k, v in logged_at(out, 4).items() if not k.startswith("hellaswag")}
