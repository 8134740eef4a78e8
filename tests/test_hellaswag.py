"""hellaswag.py: rendering, batched = one-at-a-time scoring, 2-process totals, HF parity, errors."""

import dataclasses
import hashlib
import io
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

import hellaswag as hs
from conftest import HELLASWAG_FILE, assert_refused, assert_refused_quietly, run_main, run_on_ranks, tiny_hf
from conftest import tiny_run_args
from trainkit.evaluation import hellaswag_eval, hellaswag_examples
from trainkit.cli import UserError
from trainkit.data.tokenizer import EOT
from train_gpt2 import GPTConfig

BLOCK = 64  # short enough that some of the first 100 examples have rows to truncate
CONFIG = GPTConfig(block_size=BLOCK, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)
SPREAD_SEED = 1234  # conftest's model: spread_gpt(CONFIG, SPREAD_SEED)
DATA_FILE = str(HELLASWAG_FILE)  # the shipped subset, as --data-file takes it
SHARDS = dict(n_docs=50, seed=0, vocab=100, shard_size=1000)  # the trainer's data, for its checks at start

# The first two records of hellaswag_val.jsonl (and of its subset in fixtures/), tokenized once with tiktoken's GPT-2 BPE
# and checked by decoding: 'A man is sitting on a roof. he' -> 'A', ' man', ... ' he';
# every ending starts with a space token (' is', ' starts', ' swings', ' pulls', ' stands').
CTX0 = [32, 582, 318, 5586, 319, 257, 9753, 13, 339]
ENDINGS0 = [
    [318, 1262, 14441, 284, 14441, 257, 5166, 286, 1341, 271, 13],  # ' is using wrap to wrap a pair of sk is .'
    [318, 34759, 1241, 19867, 572, 13],  # ' is ripping level tiles off .'
    [318, 4769, 257, 6437, 1134, 338, 23441, 13],  # " is holding a rub ik 's cube ."
    [4940, 10427, 510, 9753, 278, 319, 257, 9753, 13],
]  # ' starts pulling up roof ing on a roof .'
# 'A lady walks to a barbell. She bends down and grabs the pole. the lady'
CTX1 = [32, 10846, 11114, 284, 257, 2318, 7923, 13, 1375, 44370, 866, 290, 22378, 262, 16825, 13, 262, 10846]
ENDINGS1 = [
    [26728, 290, 8604, 287, 607, 5101, 13],  # ' swings and lands in her arms.'
    [16194, 262, 2318, 7923, 2651, 13],  # ' pulls the barbell forward.'
    [16194, 257, 17182, 7223, 284, 262, 2318, 7923, 13],  # ' pulls a rope attached to the barbell.'
    [6296, 290, 27103, 262, 3463, 625, 607, 1182, 13],
]  # ' stands and lifts the weight over her head.'


SUBSET_NAMED = " (the subset the repository ships, not the full 10042-example set); chance is 0.25"


def result_line(proc, model_line, data_line):
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[:-1] == [model_line, data_line], proc.stdout  # only rank 0 prints: what it scores, then the result
    return json.loads(lines[-1])


# ---- rendering ----
def test_render_first_two_examples():
    ex0, ex1 = hellaswag_examples.load_examples(DATA_FILE, 2)
    again = hellaswag_examples.load_examples(DATA_FILE, 5)  # the rendered examples are cached
    assert len(again) == 5 and again[0] is ex0 and again[1] is ex1
    assert ex0 == hellaswag_examples.Example(CTX0, ENDINGS0, 3)
    assert ex1 == hellaswag_examples.Example(CTX1, ENDINGS1, 3)
    tokens, mask, labels = hellaswag_eval.collate([ex0, ex1])
    T = len(CTX1) + 9  # the longest row: 18 context + 9 ending tokens
    assert tokens.shape == mask.shape == (8, T) and tokens.dtype == torch.int64
    rows = [(CTX0, e) for e in ENDINGS0] + [(CTX1, e) for e in ENDINGS1]
    for i, (ctx, end) in enumerate(rows):
        pad = T - len(ctx) - len(end)
        assert tokens[i].tolist() == ctx + end + [EOT] * pad
        assert mask[i].tolist() == [False] * len(ctx) + [True] * len(end) + [False] * pad
    assert labels.tolist() == [3, 3]
    tokens, mask, _ = hellaswag_eval.collate([ex1], block_size=12)  # the context truncated from the left
    assert tokens.shape == (4, 12)
    # the longest endings (9 tokens) leave 3 context tokens, the same 3 for every ending
    for i, end in enumerate(ENDINGS1):
        pad = 12 - 3 - len(end)
        assert tokens[i].tolist() == [13, 262, 10846] + end + [EOT] * pad
        assert mask[i].tolist() == [False] * 3 + [True] * len(end) + [False] * pad
    # endings longer than the block keep one context token and are cut at the block
    tokens, mask, _ = hellaswag_eval.collate([ex1], block_size=5)
    assert tokens[3].tolist() == [10846, 6296, 290, 27103, 262]
    assert mask[3].tolist() == [False, True, True, True, True]


def test_pack_runs_the_context_once_and_each_ending_in_its_own_segment():
    ex = hellaswag_examples.Example([1, 2, 3], [[4, 5], [6], [7, 8, 9], [10]], 0)
    short = hellaswag_examples.Example([11], [[12], [13], [14], [15]], 1)
    p = hellaswag_eval.pack([ex, short])
    # the context, then every ending but its last token; positions restart after the context
    assert p.tokens.tolist() == [[1, 2, 3, 4, 7, 8], [11, EOT, EOT, EOT, EOT, EOT]]
    assert p.positions.tolist() == [[0, 1, 2, 3, 3, 4], [0, 0, 0, 0, 0, 0]]
    allowed = [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 2, 4, 5]]
    assert [row.nonzero().flatten().tolist() for row in p.attn_mask[0, 0]] == allowed
    assert p.attn_mask.shape == (2, 1, 6, 6)
    # each ending token is predicted from the context's last token or its own previous token
    assert p.sources.tolist() == [2, 3, 2, 2, 4, 5, 2] + [6, 6, 6, 6]
    assert p.targets.tolist() == [4, 5, 6, 7, 8, 9, 10] + [12, 13, 14, 15]
    assert p.rows.tolist() == [0, 0, 1, 2, 2, 2, 3] + [4, 5, 6, 7]
    assert p.lengths.tolist() == [2, 1, 3, 1] + [1, 1, 1, 1]


# ---- scoring ----
def test_batched_scores_equal_one_row_at_a_time(model, monkeypatch):
    """Also in logits chunks of 7 rows; a block longer than the model's is refused."""
    examples = hellaswag_examples.load_examples(DATA_FILE, 100)
    assert sum(len(ex.ctx) + max(map(len, ex.endings)) > BLOCK for ex in examples) == 6  # truncation is exercised
    sums, means = [], []  # the summed and mean loss of each ending, one unpadded row per forward pass
    for ex in examples:  # a row too long: every ending keeps the newest context tokens the longest ending leaves
        longest = max(len(end) for end in ex.endings)
        keep = len(ex.ctx) if len(ex.ctx) + longest <= BLOCK else max(1, BLOCK - longest)
        ctx = ex.ctx[len(ex.ctx) - keep :]
        for end in (end[: BLOCK - keep] for end in ex.endings):
            with torch.no_grad():
                logits = model(torch.tensor([ctx + end]))[0]
            nll = F.cross_entropy(logits[0, len(ctx) - 1 : -1], torch.tensor(end), reduction="none")
            sums.append(nll.sum().item())
            means.append(nll.mean().item())
    ref_sum, ref_mean = torch.tensor(sums).view(-1, 4), torch.tensor(means).view(-1, 4)
    assert (ref_mean.sort(1).values[:, 1] - ref_mean.min(1).values).min() > 1e-4  # no near-tie rounding could flip
    loss_sum, loss_mean = hellaswag_eval.score_examples(model, examples, "cpu", batch_size=6)
    assert torch.equal(loss_mean.argmin(1), ref_mean.argmin(1)) and torch.equal(loss_sum.argmin(1), ref_sum.argmin(1))
    # fp32 rounding differs by CPU kernel: 1.1e-5 (3.4e-7 relative) seen at loss ~34
    torch.testing.assert_close(loss_mean, ref_mean, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(loss_sum, ref_sum, rtol=1e-6, atol=1e-5)
    labels = torch.tensor([ex.label for ex in examples])
    right = lambda ref: (ref.argmin(1) == labels).sum().item() / 100
    expected = {"acc": right(ref_sum), "acc_norm": right(ref_mean), "n": 100}
    assert hellaswag_eval.evaluate(model, "cpu", limit=100, batch_size=3, data_file=DATA_FILE) == expected
    assert not model.training

    class BareLogits(torch.nn.Module):  # a model without a config (so block_size given) returning bare logits
        def __init__(self, gpt):
            super().__init__()
            self.gpt = gpt

        def forward(self, idx):
            return self.gpt(idx)[0]

    wrapped = BareLogits(model).train()  # evaluate puts it back in train mode
    try:
        assert hellaswag_eval.evaluate(wrapped, "cpu", limit=100, data_file=DATA_FILE, block_size=BLOCK) == expected
        assert wrapped.training and model.training
    finally:
        model.eval()
    whole = hellaswag_eval.score_examples(model, examples[:12], "cpu", batch_size=12)
    monkeypatch.setattr(hellaswag_eval, "LOGIT_ROWS", 7)  # chunk edges fall inside endings and on shared positions
    chunked = hellaswag_eval.score_examples(model, examples[:12], "cpu", batch_size=12)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=f"block_size {BLOCK + 1} is longer than the model's {BLOCK}"):
        hellaswag_eval.score_examples(model, examples, "cpu", block_size=BLOCK + 1)


# ---- command line, one process and two ----
def test_cli_two_processes_match_one(model, checkpoint, tmp_path):
    """31 examples split over 2 ranks, and --limit 1 on 2 ranks, where rank 1 scores no example and the all-reduce
    still agrees (one torchrun launch, run_on_ranks): the totals are one process's; only rank 0 prints."""
    one = write_records(tmp_path / "one.jsonl", {**GOOD, "label": 0})
    commands = [[DATA_FILE, "--limit", "31", "--batch-size", "4"], [one, "--limit", "1"]]
    argvs = [["--checkpoint", checkpoint, "--device", "cpu", "--data-file", *c] for c in commands]
    ranks = run_on_ranks([dict(script="hellaswag", argv=[argv, argv]) for argv in argvs])
    descriptions = [
        f"the first 31 of 446 examples in {DATA_FILE}{SUBSET_NAMED}",
        f"the first 1 of 2 examples in {one}; chance is 0.25",
    ]
    for (path, _, limit, *_), (rank0, rank1), described in zip(commands, ranks, descriptions):
        expected = hellaswag_eval.evaluate(model, "cpu", limit=int(limit), data_file=path, lm_eval=True)
        assert expected["n"] == int(limit) and (rank1.returncode, rank1.stdout) == (0, "")
        model_line = f"hellaswag: scoring {checkpoint} (it records no step)"
        assert result_line(rank0, model_line, f"hellaswag: {described}") == expected


def test_download_checks_the_file_and_the_data_scored_is_named(monkeypatch, tmp_path):
    good = b"".join(HELLASWAG_FILE.read_bytes().splitlines(keepends=True)[:3])
    served = []

    def fake_urlopen(url, timeout):
        served.append((url, timeout))
        return io.BytesIO(served_bytes)

    monkeypatch.setattr(hellaswag_examples.urllib.request, "urlopen", fake_urlopen)
    monkeypatch.setattr(hellaswag_examples, "DATA_SHA256", hashlib.sha256(good).hexdigest())
    served_bytes = good[:-10]  # truncated: refused, nothing left behind
    with pytest.raises(UserError, match="sha256 mismatch.*--data-file"):
        hellaswag_examples.resolve_data_file(data_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []
    served_bytes = good
    path = hellaswag_examples.resolve_data_file(data_dir=str(tmp_path))
    assert path == str(tmp_path / "hellaswag_val.jsonl")
    assert os.listdir(tmp_path) == ["hellaswag_val.jsonl"] and open(path, "rb").read() == good
    assert hellaswag_examples.resolve_data_file(data_dir=str(tmp_path)) == path  # cached: no second download
    assert served == [(hellaswag_examples.DATA_URL, hellaswag_examples.DOWNLOAD_TIMEOUT_S)] * 2
    first3 = hellaswag_examples.load_examples(DATA_FILE, 3)
    assert [ex.ctx for ex in hellaswag_examples.load_examples(path)] == [ex.ctx for ex in first3]
    for limit, said in [*((n, "all 3 examples") for n in (0, 3, 50)), (2, "the first 2 of 3 examples")]:
        assert hellaswag_examples.describe_data(path, limit) == f"hellaswag: {said} in {path}; chance is 0.25"
    said = f"hellaswag: all 446 examples in {DATA_FILE}{SUBSET_NAMED}"  # the subset, named as such
    assert hellaswag_examples.describe_data(DATA_FILE, 0) == said


# ---- hostile input: one line naming the flag, the file and the line ----
GOOD = dict(ctx="A man is sitting on a roof. he", endings=["a", "b", "c", "d"], label=3, ctx_b="he")
GOOD.update(activity_label="Roof shingle removal", ctx_a="A man is sitting on a roof.")  # (for lm-eval's rendering)


def write_records(path, *records, raw=b""):
    """A jsonl file: a good record, then the given ones (dicts, or raw bytes after them)."""
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in (GOOD, *records)) + raw)
    return str(path)


ENDINGS = "'endings' must be a list of 4 non-empty strings, not "
BAD_RECORDS = [  # (the record on line 2, why it is refused)
    ({**GOOD, "label": 1.9}, "'label' must be 0, 1, 2 or 3, not 1.9"),
    ({**GOOD, "endings": "abcd"}, ENDINGS + "'abcd'"),
    ({"ctx": "x", "endings": GOOD["endings"]}, "no 'label' field"),
    ({**GOOD, "label": True}, "'label' must be 0, 1, 2 or 3, not True"),
    ({**GOOD, "label": "1.9"}, "'label' must be 0, 1, 2 or 3, not '1.9'"),
    ({**GOOD, "label": 4}, "'label' must be 0, 1, 2 or 3, not 4"),
    ({**GOOD, "endings": ["a", "b", "c"]}, ENDINGS + "['a', 'b', 'c']"),
    ({**GOOD, "endings": ["a", "b", "c", ""]}, ENDINGS + "['a', 'b', 'c', '']"),
    ({**GOOD, "ctx": ["x"]}, "'ctx' must be non-empty text, not ['x']"),
    ({"endings": GOOD["endings"], "label": 0}, "no 'ctx' field"),
    ([GOOD], "a JSON object is expected, not list"),
]


@pytest.mark.parametrize("record, reason", BAD_RECORDS)
def test_records_that_would_score_the_wrong_thing_are_refused(checkpoint, data_dir, tmp_path, record, reason):
    """Each named by file and line, before the model loads; the first through the trainer's --hellaswag-file too,
    at its start (no run folder made)."""
    path = write_records(tmp_path / "bad.jsonl", record)
    proc = run_main("hellaswag.py", "--checkpoint", checkpoint, "--data-file", path, "--device", "cpu")
    assert_refused_quietly(proc, f"--data-file {path} line 2: not a HellaSwag example ({reason})")
    if record == BAD_RECORDS[0][0]:  # (another file: the rendered-examples cache keeps the flag of its first reader)
        path = write_records(tmp_path / "bad_for_the_trainer.jsonl", record)
        run = tiny_run_args(data_dir, tmp_path / "out", steps=1, B=2, rows=2, hellaswag_every=1)
        proc = run_main("train_gpt2.py", *run, "--hellaswag-file", path)
        assert_refused(proc, f"--hellaswag-file {path} line 2: not a HellaSwag example ({reason})")
        assert not (tmp_path / "out").exists()  # refused at start, before the run's folder is made


def test_lm_eval_rendering_needs_its_fields(tmp_path):
    """lm-eval's text is built from activity_label, ctx_a and ctx_b: a record without one is refused for that
    rendering (the other still reads it, and a label as a digit string)."""
    path = write_records(tmp_path / "bad.jsonl", {**GOOD, "ctx_b": None, "label": "2"})
    assert [ex.label for ex in hellaswag_examples.load_examples(path)] == [3, 2]
    line = (
        f"--data-file {path} line 2: not a HellaSwag example ('ctx_b' must be text for lm-eval's rendering, not None)"
    )
    with pytest.raises(UserError, match=f"^{re.escape(line)}$"):
        hellaswag_examples.load_examples(path, style="lm_eval")


@pytest.mark.parametrize("case", ["missing", "unreadable", "not UTF-8"])
def test_a_data_file_it_cannot_read_is_one_line(checkpoint, tmp_path, case):
    """(--debug: the traceback instead.) A folder: test_lm_eval's test_eval_errors_are_one_line, the same check."""
    data = write_records(tmp_path / "ok.jsonl")
    if case == "missing":
        data, message = tmp_path / "nope.jsonl", f"--data-file {tmp_path / 'nope.jsonl'} does not exist"
        with pytest.raises(UserError):
            hs.main(["--checkpoint", checkpoint, "--data-file", str(data), "--debug"])
    elif case == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads any file")
        os.chmod(data, 0)
        message = f"--data-file {data}: cannot read it (Permission denied)"
    else:
        latin1 = json.dumps(GOOD).replace("roof", "r\u00f4of").encode("latin-1")
        data = write_records(tmp_path / "latin1.jsonl", raw=b"\n" + latin1)
        message = f"--data-file {data} line 3: not UTF-8 text (byte 0xf4), so not hellaswag_val.jsonl"
    proc = run_main("hellaswag.py", "--checkpoint", checkpoint, "--data-file", data, "--device", "cpu")
    assert_refused_quietly(proc, message)


# ---- Hugging Face GPT2LMHeadModel parity ----
def test_hf_model_matches_ours(model, tmp_path):
    pytest.importorskip("transformers")
    hf = tiny_hf(n_positions=BLOCK)  # our export's config (CONFIG's sizes, GELU and LayerNorm eps); ours its weights
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    ours = {
        k: v.t() if k.endswith(conv1d) else v[:50257] if k.endswith("wte.weight") or k == "lm_head.weight" else v
        for k, v in model.state_dict().items()
    }  # GPT-2's ids: our padded ones carry no probability
    missing, unexpected = hf.load_state_dict(ours, strict=False)
    assert missing == [] and unexpected == []
    wrapped = hs.HFLogits(hf)
    examples = hellaswag_examples.load_examples(DATA_FILE, 20)
    ours_sum, ours_mean = hellaswag_eval.score_examples(model, examples, "cpu", batch_size=8)
    hf_sum, hf_mean = hellaswag_eval.score_examples(wrapped, examples, "cpu", batch_size=8)
    assert torch.equal(hf_mean.argmin(1), ours_mean.argmin(1))
    assert torch.equal(hf_sum.argmin(1), ours_sum.argmin(1))
    torch.testing.assert_close(hf_mean, ours_mean, rtol=0, atol=1e-4)
    hf.save_pretrained(tmp_path / "hf")
    proc = run_main("hellaswag.py", "--hf-model", tmp_path / "hf", "--data-file", DATA_FILE, "--limit", 20)
    model_line = f"hellaswag: scoring the Hugging Face GPT-2 in {tmp_path / 'hf'}"
    got = result_line(proc, model_line, f"hellaswag: the first 20 of 446 examples in {DATA_FILE}{SUBSET_NAMED}")
    assert got == hellaswag_eval.evaluate(model, "cpu", limit=20, data_file=DATA_FILE, lm_eval=True)
    assert list(got) == ["acc", "acc_norm", "lm_eval_acc", "lm_eval_acc_norm", "n"]


@pytest.mark.parametrize("script", ["hellaswag.py", "train_gpt2.py"])
def test_offline_without_data_is_one_line_naming_the_ways_past(checkpoint, data_dir, tmp_path, script):
    """Offline without a local copy, hellaswag.py names --data-file; the trainer (default --hellaswag-every) names
    --hellaswag-file and --hellaswag-every 0 and makes no run folder. No partial download is left behind."""
    proxy = "http://127.0.0.1:9"  # no internet: a proxy nobody answers; tmp_path the (empty) HellaSwag cache folder
    offline = dict(https_proxy=proxy, HTTPS_PROXY=proxy, no_proxy="", NO_PROXY="", HELLASWAG_DIR=str(tmp_path))
    if script == "hellaswag.py":
        proc = run_main("hellaswag.py", "--checkpoint", checkpoint, "--device", "cpu", env=offline)
        flag, past = "data-file", ""
        assert proc.stdout == ""
    else:
        flags = tiny_run_args(data_dir, tmp_path / "out", steps=1, B=2, rows=2, hellaswag_every=None)
        proc = run_main("train_gpt2.py", *flags, env=offline)
        flag, past = "hellaswag-file", r", or pass --hellaswag-every 0 to train without HellaSwag"
    assert proc.returncode == 2, proc.stderr
    assert re.fullmatch(
        rf"error: cannot download HellaSwag from {re.escape(hellaswag_examples.DATA_URL)} \(\[Errno \d+\] "
        rf"Connection refused\); pass a local copy of hellaswag_val.jsonl with --{flag} PATH "
        rf"\(the repository ships a subset: fixtures/hellaswag_val_subset.jsonl\){past}\n",
        proc.stderr,
    ), proc.stderr
    assert os.listdir(tmp_path) == []  # no partial download, nor the run's folder


def test_the_first_line_names_the_checkpoint_and_step_and_no_lm_eval_scores_once(model, tmp_path):
    """Of a run folder: its newest. Both renderings go under one labelled progress bar of 2 x N examples;
    --no-lm-eval scores each example once, giving acc and acc_norm only, the same numbers."""
    from trainkit.runfiles.checkpoints import save_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    ckpt = {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config)}
    for step in (5, 12):
        save_checkpoint(str(run / f"ckpt_{step:07d}.pt"), {**ckpt, "step": step})
    flags = ["--data-file", DATA_FILE, "--limit", "6", "--device", "cpu"]
    both = run_main("hellaswag.py", "--checkpoint", run, *flags)
    expected = hellaswag_eval.evaluate(model, "cpu", limit=6, data_file=DATA_FILE, lm_eval=True)
    data_line = f"hellaswag: the first 6 of 446 examples in {DATA_FILE}{SUBSET_NAMED}"
    assert result_line(both, f"hellaswag: scoring {run / 'ckpt_0000012.pt'}, step 12", data_line) == expected
    bars = both.stderr.replace("\r", "\n")
    assert "hellaswag, both texts: 100%" in bars and "12/12 [" in bars and "6/6 [" not in bars
    once = run_main("hellaswag.py", "--checkpoint", run / "ckpt_0000005.pt", *flags, "--no-lm-eval")
    got = result_line(once, f"hellaswag: scoring {run / 'ckpt_0000005.pt'}, step 5", data_line)
    assert got == {key: expected[key] for key in ("acc", "acc_norm", "n")}
    bars = once.stderr.replace("\r", "\n")
    assert "hellaswag: 100%" in bars and "6/6 [" in bars and "12/12 [" not in bars
