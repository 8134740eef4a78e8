"""Sampling: the KV cache against full forward passes, sample.py as users run it, the trainer's samples as plain text."""

import numpy as np
import pytest
import torch

from conftest import GPT2_VOCAB_RUN, assert_one_error_line, assert_refused, assert_refused_quietly, run_main
from conftest import tiny_hf, tiny_run_args
from shards import make_docs, write_shards
from trainkit.runfiles import checkpoints
from trainkit import cli
from trainkit.data import tokenizer
import sample
from trainkit.evaluation import sampling
from trainkit.data.tokenizer import EOT
from train_gpt2 import GPT, GPTConfig


SAMPLE_RUN = dict(GPT2_VOCAB_RUN, warmup=1, ckpt_every=0)  # tiny_run_args' sizes: GPT-2's vocabulary, 4 rows of 32
tiny = lambda data_dir, out_dir, *extra, steps: tiny_run_args(data_dir, out_dir, *extra, steps=steps, **SAMPLE_RUN)
PROMPT = "Hello, I'm a language model,"


def random_gpt(block_size=32, vocab_size=96, seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():  # sharper distributions than the init's, so that sampling has structure
        for p in model.parameters():
            p.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory):
    """A run folder trained by the real command (GPT-2 vocabulary), with its stdout."""
    root = tmp_path_factory.mktemp("sample")
    write_shards(root / "data", make_docs(300, vocab=500), shard_size=2048)
    proc = run_main("train_gpt2.py", *tiny(root / "data", root / "out", "--sample-every", "2", steps=2))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root / "out", proc.stdout


run_sample = lambda source, *flags, flag="--checkpoint": run_main("sample.py", flag, source, *flags)  # in-process


def texts_of(out, prompt=PROMPT, **kwargs) -> list:
    """sampling.sample_text's texts (n, length, ...: kwargs) from the newest checkpoint of the run folder out."""
    return list(sampling.sample_text(GPT.from_checkpoint(str(out)), tokenizer.get_encoding(), "cpu", prompt, **kwargs))


def samples_of(stdout):
    """The texts of sample.py's output, split at its `--- sample i/N ---` lines."""
    parts = stdout.split("--- sample ")[1:]
    return [part.split(" ---\n", 1)[1].removesuffix("\n") for part in parts]


# ---- the model's KV cache ----
def test_cached_logits_equal_the_full_forward():
    model = random_gpt()
    seq = torch.randint(0, 96, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(seq)
        cache = sampling.new_kv_cache(model)
        # a prefill, single tokens, then several new tokens at once after cached ones
        pieces = [seq[:, :7], *(seq[:, t : t + 1] for t in range(7, 20)), seq[:, 20:]]
        incremental = torch.cat([model.lm_head(model.hidden_states(p, kv_cache=cache)) for p in pieces], dim=1)
    assert cache[0].length == 32 and cache[0].k.shape == (3, 2, 32, 16)
    torch.testing.assert_close(incremental, full, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="longer than block_size"):
        model.hidden_states(seq[:, :1], kv_cache=cache)


@pytest.mark.parametrize("prompt_len, new_tokens", [(5, 20), (5, 60), (40, 10)])  # within the block, sliding, longer
def test_cached_generation_draws_the_same_tokens(prompt_len, new_tokens):
    model = random_gpt()
    idx = torch.randint(0, 96, (4, prompt_len), generator=torch.Generator().manual_seed(2))
    runs = {
        kv: sampling.generate(
            model, idx, new_tokens, temperature=0.9, top_k=40, generator=torch.Generator().manual_seed(3), kv_cache=kv
        )
        for kv in (True, False)
    }
    assert runs[True].shape == (4, prompt_len + new_tokens)
    assert torch.equal(runs[True][:, :prompt_len], idx)
    assert torch.equal(runs[True], runs[False])
    assert len({tuple(row) for row in runs[True][:, prompt_len:].tolist()}) == 4  # the rows differ


def test_top_k_1_is_greedy_decoding():
    model = random_gpt()
    idx = torch.randint(0, 96, (2, 4), generator=torch.Generator().manual_seed(4))
    expected = idx
    with torch.no_grad():
        for _ in range(12):  # reference: argmax of a full forward pass over the whole sequence
            logits, _ = model(expected)
            expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    for temperature in (0.5, 1.0, 3.0):
        assert torch.equal(sampling.generate(model, idx, 12, temperature=temperature, top_k=1), expected)
    for temperature in (1e-40, 1e-300):  # the limit T -> 0, below float32's range: greedy, not NaN
        g = torch.Generator().manual_seed(0)
        assert torch.equal(sampling.generate(model, idx, 12, temperature=temperature, top_k=96, generator=g), expected)


def test_temperature_scales_the_logits():
    """Each draw comes from softmax(logits / T) over the top k: counted over many one-token draws of one context."""
    model = random_gpt(seed=5)
    idx = torch.zeros(20000, 3, dtype=torch.long)
    with torch.no_grad():
        logits = model(idx[:1])[0][0, -1]
    for temperature in (0.5, 2.0):
        g = torch.Generator().manual_seed(6)
        drawn = sampling.generate(model, idx, 1, temperature=temperature, top_k=96, generator=g)[:, -1]
        freq = torch.bincount(drawn, minlength=96).double() / len(drawn)
        expected = torch.softmax(logits.double() / temperature, dim=-1)
        assert (freq - expected).abs().max() < 0.015


def test_padded_ids_are_never_drawn():
    # GPT-2's 50257 ids padded to 50304: padded rows that would take nearly all the probability
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50304, n_layer=1, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        model.transformer.wte.weight[50257:] = 100 * model.transformer.wte.weight[:47]
        probs = model.lm_head(model.hidden_states(torch.zeros(1, 1, dtype=torch.long))).softmax(-1)
        assert probs[..., 50257:].sum() > 0.9
    g = torch.Generator().manual_seed(0)
    drawn = sampling.generate(model, torch.zeros(64, 1, dtype=torch.long), 8, top_k=200, generator=g)
    assert drawn.max() < 50257


# ---- sample.py ----
def test_sample_cli_is_plain_deterministic_text_of_sample_text(sampled_run):
    """The same seed, the same texts; another seed, others; and sample.py adds nothing to the trainer's sampling: its
    texts are sampling.sample_text's (all three in one batch there, in batches of 2 and 1 here: each its generator)."""
    out, _ = sampled_run
    first, again, other = (
        run_sample(out, *f"--num-samples 3 --max-new-tokens 12 --seed {s}".split()) for s in (7, 7, 8)
    )
    assert (first.returncode, first.stderr) == (0, "")
    assert first.stdout == again.stdout != other.stdout and first.stdout.startswith("--- sample 1/3 ---\n" + PROMPT)
    texts = samples_of(first.stdout)
    assert len(texts) == 3 and all(t.startswith(PROMPT) and len(t) > len(PROMPT) for t in texts)
    flags = "--num-samples 3 --max-new-tokens 10 --temperature 0.7 --top-k 5 --seed 3 --batch-size 2"
    proc = run_sample(out, "--prompt", "def f(x):", *flags.split())
    expected = texts_of(out, "def f(x):", n=3, length=10, temperature=0.7, top_k=5, seed=3)
    assert (proc.returncode, samples_of(proc.stdout)) == (0, expected) and len(set(expected)) == 3, proc.stderr


def test_empty_and_long_prompts(sampled_run):
    out, _ = sampled_run
    empty = run_sample(out, "--prompt", "", "--num-samples", "1", "--max-new-tokens", "8")
    assert empty.returncode == 0, empty.stderr
    (text,) = samples_of(empty.stdout)
    assert text and not text.startswith("<|endoftext|>")  # started from the token, which is not printed
    long_prompt = " ".join(["word"] * 100)  # 100 tokens, block size 64
    proc = run_sample(out, "--prompt", long_prompt, "--num-samples", "1", "--max-new-tokens", "5")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "note: the prompt is 100 tokens; the model sees only the newest 64\n"
    assert samples_of(proc.stdout)[0].startswith(long_prompt)


BAD_FLAGS = [  # (flags, message): in-process; tests/test_cli.py runs sample.py's usage errors as a program
    (["--temperature", "nan"], "--temperature must be a finite number > 0, got nan"),
    (["--temperature", "0"], "--temperature must be a finite number > 0, got 0.0"),
    (["--temperature", "-1"], "--temperature must be a finite number > 0, got -1.0"),
    (["--temperature", "inf"], "--temperature must be a finite number > 0, got inf"),
    # the counts: cli.int_in, as every script's (tests/test_cli.py runs --top-k 0 as a program)
    (["--num-samples", "0"], "argument --num-samples: must be in 1..2**62, got 0 (see {prog} --help)"),
    (["--top-k", "0"], "argument --top-k: must be in 1..2**62, got 0 (see {prog} --help)"),
    (["--batch-size", "0"], "argument --batch-size: must be in 1..2**62, got 0 (see {prog} --help)"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens: must be in 0..2**62, got -1 (see {prog} --help)"),
    (["--seed", str(2**63)], f"argument --seed: must be in 0..2**63-1, got {2**63} (see {{prog}} --help)"),
    (["--device", "gpu"], "--device gpu: expected auto, cpu, cuda, cuda:N or mps"),
]


@pytest.mark.parametrize("flags, message", BAD_FLAGS, ids=[" ".join(f[0]) for f in BAD_FLAGS])
def test_bad_flags_are_one_line_errors(sampled_run, flags, message):
    assert_refused_quietly(run_sample(sampled_run[0], *flags), message.format(prog="sample.py"))


def test_prompt_beyond_a_small_vocabulary_is_refused(tmp_path):
    """A run trained with --vocab-size 128 on ids below 128 (no <|endoftext|>), and its export of 100 ids."""
    write_shards(tmp_path / "data", [np.random.default_rng(0).integers(0, 128, 3000)], shard_size=1000)
    small_vocab_run = tmp_path / "out"
    proc = run_main("train_gpt2.py", *tiny(tmp_path / "data", small_vocab_run, "--vocab-size", "128", steps=1))
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_sample(small_vocab_run, "--prompt", "Hello")
    assert_refused(proc, "the prompt has token 15496 ('Hello'), beyond the model's vocabulary of 128 ids")
    empty = run_sample(small_vocab_run, "--prompt", "")
    assert empty.returncode == 2 and f"token {EOT} ('<|endoftext|>')" in empty.stderr
    ok = run_sample(small_vocab_run, "--prompt", "!#", "--num-samples", "1", "--max-new-tokens", "4")  # ids 0 and 2
    assert ok.returncode == 0, ok.stderr
    assert samples_of(ok.stdout)[0].startswith("!#")
    # an export with --vocab-size 100 is a model of 100 ids, not the 128 that padding to a multiple of 64 would
    # give: '¡' is ids 126, 94, beyond it (it was accepted, and padded ids could be drawn)
    pytest.importorskip("transformers")
    assert run_main("hf_interop.py", "export", small_vocab_run, tmp_path / "hf", "--vocab-size", "100").returncode == 0
    model = sample.load_model(sample.parse_args(["--hf-model", str(tmp_path / "hf")]), "cpu")
    assert model.config.vocab_size == model.transformer.wte.weight.shape[0] == 100
    proc = run_sample(tmp_path / "hf", "--prompt", "¡", flag="--hf-model")
    assert_refused(proc, "the prompt has token 126 ('\ufffd'), beyond the model's vocabulary of 100 ids")


def test_greedy_ends_at_endoftext_as_transformers_generate(tmp_path):
    """A model trained on documents `<|endoftext|>!"#$` (ids 50256, 0, 1, 2, 3) and its export: sample.py's greedy text
    of either (--checkpoint, --hf-model) ends at <|endoftext|> as GPT2LMHeadModel.generate stops at its
    generation_config's eos, and with --continue-past-eot runs on as generate(eos_token_id=None)."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer, GPT2LMHeadModel

    write_shards(tmp_path / "data", [np.array([EOT, 0, 1, 2, 3])] * 400, shard_size=1000)
    # past the plateau of the 5-token unigram
    proc = run_main("train_gpt2.py", *tiny(tmp_path / "data", tmp_path / "out", steps=80))
    assert proc.returncode == 0, proc.stderr[-2000:]
    export = run_main("hf_interop.py", "export", tmp_path / "out", tmp_path / "hf")
    assert export.returncode == 0, export.stderr
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    enc = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))  # the export's own tokenizer, as a user runs it
    ids = torch.tensor([enc.encode("!")])
    assert ids.tolist() == [[0]]
    texts, greedy_12 = {}, ["--prompt", "!", "--num-samples", "1", "--max-new-tokens", "12", "--top-k", "1"]
    for flags, eos in [((), {}), (("--continue-past-eot",), {"eos_token_id": None})]:
        with torch.no_grad():
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=EOT, **eos
            )
        proc = run_sample(tmp_path / "out", *greedy_12, *flags)
        hf_proc = run_sample(tmp_path / "hf", *greedy_12, *flags, flag="--hf-model")
        assert (proc.returncode, hf_proc.returncode) == (0, 0), proc.stderr + hf_proc.stderr
        texts[flags] = samples_of(proc.stdout)
        assert texts[flags] == samples_of(hf_proc.stdout) == [enc.decode(ref[0].tolist())]
    (stopped,), (went_on,) = texts.values()
    assert stopped.endswith("<|endoftext|>") and went_on.startswith(stopped) and len(went_on) > len(stopped)


def test_bad_sources_and_nan_weights_are_one_line_errors(sampled_run, tmp_path):
    for flag, path, message in [
        ("--checkpoint", tmp_path, f"no checkpoint (ckpt_NNNNNNN.pt) in {tmp_path}"),
        ("--checkpoint", tmp_path / "nope.pt", "does not exist"),
        ("--hf-model", tmp_path / "nope", "--hf-model"),
    ]:
        proc = run_sample(path, flag=flag)
        assert_one_error_line(proc, message)
        assert proc.stdout == ""
    pytest.importorskip("transformers")
    out, _ = sampled_run
    ckpt = torch.load(checkpoints.latest_checkpoint(str(out)), weights_only=True)
    ckpt["model"]["transformer.h.1.mlp.c_fc.weight"][3, 4] = float("nan")
    del ckpt["checksum"]
    (tmp_path / "run").mkdir()
    torch.save(dict(ckpt, checksum=checkpoints.state_digest(ckpt)), tmp_path / "run" / "ckpt_0000002.pt")
    hf = tiny_hf()
    with torch.no_grad():
        hf.transformer.h[0].attn.c_proj.weight[0, 0] = float("inf")
    hf.save_pretrained(str(tmp_path / "hf"))
    said = (
        "the model weights hold NaN or inf (transformer.h.1.mlp.c_fc.weight): there is no earlier checkpoint next to it"
    )
    assert_refused_quietly(run_sample(tmp_path / "run"), f"{tmp_path / 'run' / 'ckpt_0000002.pt'}: {said}")
    said = f"{tmp_path / 'hf' / 'model.safetensors'}: the weights hold NaN or inf (transformer.h.0.attn.c_proj.weight)"
    assert_refused_quietly(run_sample(tmp_path / "hf", flag="--hf-model"), said)


def test_huge_num_samples_are_drawn_in_bounded_batches(sampled_run, monkeypatch):
    """--num-samples 10**12, printed a batch at a time (one tensor of all rows was a MemoryError), the first ones those
    of --num-samples 3; once stdout is gone no more are drawn (as a program under `| head`, 141: test_output)."""
    out, (real, printed) = sampled_run[0], (sample.print_result, [])
    gone_after_3 = lambda text, **kwargs: printed.append(text) or (len(printed) <= 6 and real(text, **kwargs))
    monkeypatch.setattr(sample, "print_result", gone_after_3)  # a reader that leaves after 3 samples (6 lines)
    proc = run_sample(out, "--num-samples", 10**12, "--max-new-tokens", 4, "--seed", 5)
    assert (proc.returncode, proc.stderr, len(printed)) == (0, "", 7)
    assert proc.stdout.startswith(f"--- sample 1/{10**12} ---\n")
    assert samples_of(proc.stdout) == texts_of(out, n=3, length=4, seed=5)


# ---- the trainer's samples ----
def test_trainer_prints_samples_as_plain_text_that_continue_sample_prompt(sampled_run):
    out, stdout = sampled_run
    lines = [line for line in stdout.splitlines() if line.startswith("sample: ")]
    assert len(lines) == 4 and all(line.startswith(f"sample: {PROMPT}") for line in lines)
    # the prompt fits the data (the quickstart's Python gets "def "); the texts are sample_text's for it
    flags = ["--resume", "--eval-only", "--sample-every", "1", "--sample-prompt", "def "]
    proc = run_main("train_gpt2.py", *tiny(out.parent / "data", out, *flags, steps=2))
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = texts_of(out, "def ")
    assert len(expected) == 4 and all(text.startswith("def ") for text in expected)
    # as the trainer prints them: control characters but newlines and tabs escaped (a \x0b here)
    shown = [cli.shown(text, keep_newlines=True) for text in expected]
    assert proc.stdout.count("sample: ") == 4 and all(f"sample: {text}\n" in proc.stdout for text in shown)
