"""End to end through the command line: every split of a step logs the same loss, and bad input is one clear line
with a non-zero exit."""

import os
import re

import numpy as np
import pytest
import torch

from trainkit.runfiles import resume
import train_gpt2 as tg
from conftest import HELLASWAG_FILE, TEXT_FILE, assert_refused, log_records, run_main, tiny_run_args

T = 32
# a small alphabet, so that the loss has somewhere to go in 10 steps
SHARDS = dict(n_docs=600, seed=1, max_len=60, shard_size=6000)


def train_args(data_dir, out_dir, B, *extra, steps=10):
    """A tiny run: 8 rows of T tokens a step in micro-batches of B, max LR 3e-2, nothing evaluated or saved."""
    sizes = dict(n_embd=32, block_size=64, seq_len=T, warmup=2, ckpt_every=0)
    return tiny_run_args(data_dir, out_dir, "--max-lr", "3e-2", *extra, steps=steps, B=B, **sizes)


def read_log(out_dir, key="loss"):
    return [r[key] for r in log_records(out_dir) if key in r]


# Each variant runs FSDP in one of its two splits (4 rows x 1 step on each of 2 ranks, or 2 rows x
# 2 steps): together they cover both. The second also masks attention to each document of its rows
# (--doc-mask), as modded-nanogpt pairs them.
SPLITS = {"plain": ([], 4), "align-docs+doc-mask": (["--align-docs", "--doc-mask"], 2)}
# (variant, run, B) of each 2-rank run
RUNS = [(v, name, B) for v, (_, rows) in SPLITS.items() for name, B in (("ddp", 2), ("fsdp", rows))]


def rank_cases(folder, data_dir):
    """RUNS as cases of conftest's shared_rank_runs launch: DDP and FSDP in B rows x 2 ranks."""
    mode = {"ddp": [], "fsdp": ["--fsdp"]}
    runs = [train_args(data_dir, folder / v / name, B, *SPLITS[v][0], *mode[name]) for v, name, B in RUNS]
    return [dict(script="train_gpt2", argv=[args, args]) for args in runs]


@pytest.mark.parametrize("variant", SPLITS)
def test_every_split_logs_the_same_loss(data_dir, tmp_path, shared_rank_runs, variant):
    align, _ = SPLITS[variant]
    assert tg.main(train_args(data_dir, tmp_path / "b8", 8, *align)) == 0  # 8 rows x 1 step
    assert tg.main(train_args(data_dir, tmp_path / "b2", 2, *align)) == 0  # 2 rows x 4 steps
    folder, results = shared_rank_runs[__name__]
    for (v, name, B), ranks in zip(RUNS, results):
        if v == variant:  # rank 0's output, the one that prints
            assert f"{8 // (2 * B)} accumulation steps x 2 ranks" in ranks[0].stdout, name
    ddp_dir, fsdp_dir = folder / variant / "ddp", folder / variant / "fsdp"
    if align:  # the mask changes what is computed: step 0's loss is not --align-docs' alone
        assert tg.main(train_args(data_dir, tmp_path / "unmasked", 8, "--align-docs", steps=1)) == 0
        assert abs(read_log(tmp_path / "unmasked")[0] - read_log(tmp_path / "b8")[0]) > 1e-4  # 9.5e-4 at init
    one, accum = (read_log(tmp_path / d) for d in ("b8", "b2"))
    world, fsdp = read_log(ddp_dir), read_log(fsdp_dir)
    assert len(one) == 10
    for losses in (accum, world, fsdp):
        np.testing.assert_allclose(losses, one, rtol=2e-5)
    np.testing.assert_allclose(fsdp, world, rtol=2e-5)
    # the norm FSDP clips by is DDP's, up to fp32 rounding of the 1.6M-entry wte gradient's norm,
    # which sums differently in two shards (step 0: DDP's 5.4e-6, FSDP's 2.7e-6 below float64's)
    np.testing.assert_allclose(read_log(fsdp_dir, "grad_norm"), read_log(ddp_dir, "grad_norm"), rtol=1e-3)
    tokens = read_log(tmp_path / "b8", "tokens")
    if align:
        assert len(set(tokens)) > 1 and max(tokens) < 8 * T  # padding makes the counts vary
    else:
        assert tokens == [8 * T] * 10
    assert one[-1] < one[0] - 1.0  # it learns


def test_log_has_evals_and_checkpoints_have_clean_names(data_dir, tmp_path):
    """The logged HellaSwag accuracy is hellaswag.py's on the same weights."""
    from trainkit.evaluation import hellaswag_eval

    evals = ["--val-every", "2", "--val-steps", "2", "--ckpt-every", "2", "--hellaswag-every", "2"]
    evals += ["--hellaswag-limit", "8", "--hellaswag-file", str(HELLASWAG_FILE)]
    assert tg.main(train_args(data_dir, tmp_path, 4, *evals, steps=4)) == 0
    records = log_records(tmp_path)
    assert [r["step"] for r in records if "val_loss" in r] == [0, 2, 4]
    hellaswag = [r for r in records if "hellaswag_acc" in r]
    assert [(r["step"], r["hellaswag_n"]) for r in hellaswag] == [(0, 8), (2, 8), (4, 8)]
    train = [r for r in records if "loss" in r]
    assert set(train[0]) == set("step loss lr grad_norm tokens dt_ms tok_per_s tok_per_s_per_gpu run".split())
    assert sorted(os.listdir(tmp_path)) == ["ckpt_0000002.pt", "ckpt_0000004.pt", "log.jsonl"]
    # every record and checkpoint names the run: one random 128-bit id
    run = resume.read_run(str(tmp_path / "ckpt_0000004.pt"))
    assert {r["run"] for r in records} == {run["id"]} and re.fullmatch("[0-9a-f]{32}", run["id"])
    assert run == resume.read_run(str(tmp_path / "ckpt_0000002.pt")) and run["parent"] is None
    model = tg.GPT.from_checkpoint(str(tmp_path / "ckpt_0000004.pt"))
    assert model.config.n_embd == 32 and all(not k.startswith(("module.", "_orig_mod.")) for k in model.state_dict())
    expected = hellaswag_eval.evaluate(model, "cpu", limit=8, data_file=str(HELLASWAG_FILE))
    assert hellaswag[-1]["hellaswag_acc"] == expected["acc_norm"]


BAD_INPUT = [  # (flags after the tiny run's, the error line's message; {tmp}: the test's folder, {data}: data_dir)
    (
        "--total-batch-size 1000",
        "--total-batch-size 1000 is not divisible by batch_size x seq_len x world_size = 4 x 32 x 1 = 128",
    ),
    (
        "--batch-size auto --total-batch-size 1000",
        "--total-batch-size 1000 is not divisible by seq_len x world_size = 32 x 1 = 32",
    ),
    ("--seq-len 128", "--seq-len 128 is longer than the model's --block-size 64"),
    ("--n-head 3", "--n-embd 32 is not divisible by --n-head 3"),
    (
        "--vocab-size 100",
        "{data}/synth_train_000001.npy holds token id 50256, which the model has no output for (--vocab-size 100: ids "
        "0..99); wrong tokenizer or --vocab-size too small",
    ),
    ("--data-dir /nonexistent/shards", "--data-dir /nonexistent/shards does not exist; create shards with fineweb.py"),
    ("--optimizer muon --muon-momentum 1", "need --muon-lr > 0 and 0 <= --muon-momentum < 1 (got 0.02, 1.0)"),
    (  # on a torch without torch.optim.Muon (before 2.9)
        "--optimizer muon",
        "--optimizer muon needs torch 2.9 or newer (torch.optim.Muon); this is torch {torch}: pip install -U torch, or "
        "use --optimizer adamw",
    ),
    (
        "--data-dir {tmp}/empty",
        "no 'train' shards (*_train_*.npy or .bin) in --data-dir {tmp}/empty; create them with fineweb.py",
    ),
    (
        "--data-dir {tmp}/only_train --val-every 5",
        "no 'val' shards (*_val_*.npy or .bin) in --data-dir {tmp}/only_train; create them with fineweb.py (or pass "
        "--val-every 0)",
    ),
    # a UserError raised inside hellaswag.py is still the one exit_code_of catches, naming the trainer's own flag
    (
        "--hellaswag-every 1 --hellaswag-file {tmp}/no.jsonl",
        "--hellaswag-file {tmp}/no.jsonl does not exist, or pass --hellaswag-every 0 to train without HellaSwag",
    ),
    # --init-from refuses the shape flags the weights would silently override
    (
        "--init-from gpt2 --model gpt2-xl",
        "--init-from gpt2 takes the model's shape from its weights: drop --model, --n-layer, --n-head, --n-embd "
        "(--block-size and --vocab-size may still shrink or pad it)",
    ),
]


@pytest.mark.parametrize("flags, message", BAD_INPUT, ids=range(len(BAD_INPUT)))
def test_bad_input_is_one_line_and_exit_2(data_dir, tmp_path, monkeypatch, flags, message):
    if flags == "--optimizer muon":
        monkeypatch.delattr(torch.optim, "Muon")
    (tmp_path / "empty").mkdir()
    (tmp_path / "only_train").mkdir()
    np.save(tmp_path / "only_train" / "x_train_000000.npy", np.arange(500, dtype=np.uint16))
    args = train_args(data_dir, tmp_path / "o", 4, *flags.format(tmp=tmp_path).split(), steps=2)
    assert_refused(
        run_main("train_gpt2.py", *args), message.format(tmp=tmp_path, data=data_dir, torch=torch.__version__)
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("align", [[], ["--align-docs"]], ids=["plain", "align-docs"])
def test_trains_identically_from_fineweb_npy_and_llmc_bin_shards(tmp_path, align):
    import fineweb

    for fmt in ("npy", "bin"):  # the text's 31K tokens, cut to 3 shards
        flags = f"--shard-size 8K --max-tokens 20K --format {fmt} --workers 1".split()
        assert fineweb.main(["--files", str(TEXT_FILE), "--out-dir", str(tmp_path / fmt), *flags]) == 0
        assert tg.main(train_args(str(tmp_path / fmt), tmp_path / f"out_{fmt}", 4, *align, steps=3)) == 0
    assert sorted(os.listdir(tmp_path / "bin"))[:2] == ["data_train_000001.bin", "data_train_000002.bin"]
    assert read_log(tmp_path / "out_npy") == read_log(tmp_path / "out_bin")  # bit-identical
