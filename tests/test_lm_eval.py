"""lm-evaluation-harness on our export (hf_interop.py eval, evals/hellaswag_local.yaml), offline: its HellaSwag acc
and acc_norm equal hellaswag.py's lm_eval_acc and lm_eval_acc_norm, example by example. Two `python hf_interop.py
eval` command lines run as programs in one interpreter (an evaluation, the Hub unreachable); the refusals in-process."""

import json
import os
import sys

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

import datasets  # noqa: E402
import hf_interop  # noqa: E402
from lm_eval.tasks.hellaswag.utils import process_docs  # noqa: E402
from conftest import HELLASWAG_FILE, assert_refused, run_as_programs, run_main  # noqa: E402
from trainkit.evaluation import hellaswag_eval, hellaswag_examples  # noqa: E402
from train_gpt2 import GPTConfig  # noqa: E402

# 128 positions: every one of the first 200 examples fits whole (at most 96 tokens in lm-eval's rendering), so
# lm-eval and we cut nothing; vocabulary unpadded: the export keeps every row
CONFIG = GPTConfig(block_size=128, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)
SPREAD_SEED = 7  # conftest's model: spread_gpt(CONFIG, SPREAD_SEED)
N = 40
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """The first N validation records: lm-eval maps its process_docs over the whole file more than once."""
    path = tmp_path_factory.mktemp("hellaswag") / "hellaswag_val.jsonl"
    with open(HELLASWAG_FILE) as f:
        path.write_text("".join(next(f) for _ in range(N)))
    return str(path)


@pytest.fixture(scope="module")
def evals(checkpoint, data_file, tmp_path_factory):
    """`python hf_interop.py eval` offline, as a user runs it: on data_file (its samples in the folder returned), and
    with no --hellaswag-file (the Hub unreachable); both as programs in one interpreter (run_as_programs)."""
    samples = tmp_path_factory.mktemp("samples")
    local = ["--hellaswag-file", data_file, "--samples-dir", str(samples)]
    cases = [["eval", checkpoint, "--tasks", "hellaswag", "--device", "cpu", *extra] for extra in (local, [])]
    return samples, *run_as_programs([dict(argv=["hf_interop.py", *argv], env=OFFLINE) for argv in cases])


def test_our_text_is_lm_evals():
    """Our rendering equals lm-eval's process_docs on every shipped record (WikiHow's bracketed tags removed too)."""
    with open(HELLASWAG_FILE) as f:
        records = [json.loads(line) for line in f]
    theirs = process_docs(datasets.Dataset.from_list(records))
    assert len(records) == len(theirs) == 446
    assert sum("[title]" in record["ctx"] for record in records) > 0  # WikiHow's tags are covered
    ours = [hellaswag_examples.lm_eval_text(record) for record in records]
    assert ours == [(doc["query"], doc["choices"], doc["gold"]) for doc in theirs]


def test_lm_eval_scores_equal_ours_example_by_example(model, data_file, evals):
    samples_dir, proc, _ = evals
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])["hellaswag_local"]
    with open(samples_dir / "hellaswag_local.jsonl") as f:
        samples = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(N)) and result["n"] == N
    examples = hellaswag_examples.load_examples(data_file, style="lm_eval")
    loss_sum, _ = hellaswag_eval.score_examples(model, examples, "cpu")
    per_char = loss_sum / torch.tensor([ex.ending_chars for ex in examples], dtype=torch.float32)
    theirs = torch.tensor([s["loglikelihoods"] for s in samples])
    torch.testing.assert_close(theirs, -loss_sum, rtol=0, atol=1e-3)
    labels = [ex.label for ex in examples]
    assert [s["target"] for s in samples] == labels
    assert [s["acc"] for s in samples] == [float(p == y) for p, y in zip(loss_sum.argmin(1).tolist(), labels)]
    assert [s["acc_norm"] for s in samples] == [float(p == y) for p, y in zip(per_char.argmin(1).tolist(), labels)]
    ours = hellaswag_eval.evaluate(model, "cpu", data_file=data_file, lm_eval=True)
    assert (ours["lm_eval_acc"], ours["lm_eval_acc_norm"]) == (result["acc"], result["acc_norm"])
    assert ours["acc_norm"] != ours["lm_eval_acc_norm"]  # two metrics, on this tiny set too


def test_eval_errors_are_one_line(evals, checkpoint, tmp_path, monkeypatch):
    """The Hub unreachable as a program (its line names the flag to set, no traceback); the refusals in-process."""
    proc = evals[2]
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --tasks hellaswag: cannot load its data (")
    assert "pass --hellaswag-file PATH" in proc.stderr and "Traceback" not in proc.stderr
    missing, samples, file = tmp_path / "missing.jsonl", tmp_path / "a_file" / "samples", "--hellaswag-file"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("GARBAGE\n")
    (tmp_path / "a_file").write_text("")
    for args, message in [
        ([file, missing], f"{file} {missing} does not exist"),
        # named as hellaswag.py names it, not blamed on the network (nothing written beside it: below)
        ([file, bad], f"{file} {bad} line 1: not a HellaSwag example (not JSON (Expecting value at column 1))"),
        ([file, tmp_path], f"{file} {tmp_path} is a folder: pass the file, e.g. {tmp_path / 'hellaswag_val.jsonl'}"),
        (["--tasks", " , "], "--tasks names no task"),
        (["--samples-dir", samples], f"--samples-dir {samples}: not a directory"),
    ]:
        assert_refused(run_main("hf_interop.py", "eval", checkpoint, "--tasks", "hellaswag", *args), message)
    assert sorted(os.listdir(tmp_path)) == ["a_file", "bad.jsonl"]
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    assert_refused(run_main("hf_interop.py", "eval", checkpoint, "--tasks", "hellaswag"), hf_interop.LM_EVAL_HINT)
