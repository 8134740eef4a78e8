"""hf_interop.py: Hugging Face GPT-2 <-> our GPT, offline, on tiny random models, in-process through main; as programs
only an export under a file size limit and one under a non-UTF-8 folder (one interpreter), one killed mid-way, three
into a mount point (one namespace), and transformers 4 and 5 loading one export."""

import dataclasses
import errno
import fcntl
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import types

import pytest
import tiktoken
import torch
from packaging.version import Version
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext.openai_public import r50k_pat_str

pytest.importorskip("transformers")
import transformers  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402

import hf_interop  # noqa: E402
import train_gpt2  # noqa: E402
from conftest import NOT_GPT2, REPO, assert_one_error_line, assert_refused, assert_refused_quietly  # noqa: E402
from conftest import log_records, not_gpt2_folder, run_as_programs, run_command, run_main, start  # noqa: E402
from conftest import tiny_hf, tiny_run_args, tree_hashes, write_checkpoint  # noqa: E402
from trainkit.runfiles import checkpoints  # noqa: E402
from trainkit.hf import export as export_folder  # noqa: E402
from trainkit.cli import UserError  # noqa: E402
from trainkit.data.tokenizer import BPE_SHA256, token_byte_lengths  # noqa: E402
from train_gpt2 import GPT, GPTConfig  # noqa: E402

SHARDS = dict(n_docs=200, seed=0, vocab=500, shard_size=3000)  # the trainer's data


save_hf = lambda model, path: model.save_pretrained(str(path)) or str(path)  # its folder


def tiny_ours(vocab_size=50304, block_size=32, seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:  # biases and LayerNorms start at 0/1: make them random
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_ours(model, path, step=7):
    state = dict(model=model.state_dict(), model_config=dataclasses.asdict(model.config), step=step)
    return checkpoints.save_checkpoint(str(path), state) or str(path)


def logits_of(model, idx):
    with torch.no_grad():
        out = model(idx)
    return out.logits if hasattr(out, "logits") else out[0]


def assert_same_logits(hf, ours, n_ids, shape=(1, 16), seed=3):
    """hf (a GPT2LMHeadModel or its folder) gives our model's logits over its n_ids real ids, to fp32 precision."""
    hf = GPT2LMHeadModel.from_pretrained(hf).eval() if isinstance(hf, (str, os.PathLike)) else hf
    idx = torch.randint(0, n_ids, shape, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(logits_of(hf, idx), logits_of(ours, idx)[..., :n_ids], atol=1e-5, rtol=0)


def test_import_matches_hf_logits_in_any_vocabulary(tmp_path):
    hf = tiny_hf()
    model = GPT.from_hf(save_hf(hf, tmp_path / "hf"))
    assert model.config == GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(1))
    ours, theirs = logits_of(model, idx), logits_of(hf, idx)
    assert ours.shape == (2, 32, 50257)  # the logits of the real ids: the padded ones carry no probability
    torch.testing.assert_close(ours[..., :50257], theirs, atol=1e-5, rtol=0)
    wte = model.transformer.wte.weight
    assert model.lm_head.weight is wte  # still tied
    torch.testing.assert_close(wte[50257:], wte[:50257].mean(0).expand(47, -1))
    hf = tiny_hf(vocab_size=100)  # a small vocabulary, padded or cropped, and sizes beyond the model's
    path = save_hf(hf, tmp_path / "hf100")
    assert GPT.from_hf(path).config.vocab_size == 128  # padded to a multiple of 64
    model = GPT.from_hf(path, vocab_size=100, block_size=16)
    assert (model.config.vocab_size, model.config.block_size) == (100, 16)
    idx = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits_of(model, idx), logits_of(hf, idx), atol=1e-5, rtol=0)
    with pytest.raises(UserError, match="smaller than"):
        GPT.from_hf(path, vocab_size=99)
    with pytest.raises(UserError, match="n_positions"):
        GPT.from_hf(path, block_size=33)


def test_padded_rows_take_little_probability(tmp_path):
    """Why padded rows are the mean row, not zero: GPT-2's real logits are large and negative.
    Build a model like that (every output shares a direction opposite the mean embedding)."""
    hf = tiny_hf(vocab_size=100)
    with torch.no_grad():
        shared = torch.randn(32)
        hf.transformer.wte.weight.add_(shared)  # tied: lm_head too
        hf.transformer.ln_f.weight.mul_(0.1)
        hf.transformer.ln_f.bias.copy_(-shared)
    path = save_hf(hf, tmp_path / "hf")
    idx = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(3))
    targets = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(4))
    hf_logits = logits_of(hf, idx)
    assert hf_logits.max() < -5  # every real logit well below zero, as in GPT-2
    hf_loss = torch.nn.functional.cross_entropy(hf_logits.view(-1, 100), targets.view(-1))
    model = GPT.from_hf(path)  # vocab 128: 28 padded rows
    pad_mass = logits_of(model, idx).softmax(-1)[..., 100:].sum(-1)
    assert pad_mass.max() <= 28 / 100 + 1e-6  # Jensen's bound
    _, loss = model(idx, targets)
    assert hf_loss <= loss <= hf_loss + math.log(1 + 28 / 100) + 1e-5
    zero = GPT.from_hf(path)
    with torch.no_grad():
        zero.transformer.wte.weight[100:] = 0  # the padded rows zero instead (tied: lm_head too)
    assert logits_of(zero, idx).softmax(-1)[..., 100:].sum(-1).min() > 0.99  # padding takes it all


@pytest.mark.parametrize("loss_chunk", [0, 24])
def test_our_loss_is_the_exported_models(tmp_path, loss_chunk):
    """The padded ids carry no probability: with full logits and in chunks, our loss equals that of
    the Hugging Face export (50257 logits) on the same rows, to fp32 precision."""
    model = tiny_ours()
    with torch.no_grad():  # padded rows that would take most of the probability if they were in the softmax
        model.transformer.wte.weight[50257:] = 100 * model.transformer.wte.weight[:47]
    hf = GPT2LMHeadModel.from_pretrained(hf_interop.export_hf(model, str(tmp_path / "hf"))).eval()
    g = torch.Generator().manual_seed(2)
    idx, targets = torch.randint(0, 50257, (3, 32), generator=g), torch.randint(0, 50257, (3, 32), generator=g)
    targets[2, 20:] = -1
    with torch.no_grad():
        theirs = torch.nn.functional.cross_entropy(hf(idx).logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        _, ours = model(idx, targets, loss_chunk=loss_chunk)
        _, token_losses = model(idx, targets, reduction="none", loss_chunk=loss_chunk)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    assert token_losses.sum().item() / 84 == pytest.approx(theirs.item(), rel=1e-6)  # what validation sums
    assert (token_losses[targets.flatten() == -1] == 0).all()
    with torch.no_grad():
        padded = model.lm_head(model.hidden_states(idx)).softmax(-1)[..., 50257:].sum(-1)
    assert padded.min() > 0.9  # in a softmax over all 50304 logits they would take nearly everything
    torch.testing.assert_close(logits_of(model, idx), logits_of(hf, idx), rtol=0, atol=1e-5)


@pytest.mark.parametrize("vocab_size, kept", [(50304, 50257), (100, 100)])
def test_export_loads_in_transformers_and_round_trips_exactly(tmp_path, vocab_size, kept):
    """Exported from a checkpoint file (GPT-2's vocabulary) and from a model wrapped as DDP wraps it (.module)."""
    model = tiny_ours(vocab_size=vocab_size)
    source = save_ours(model, tmp_path / "ckpt.pt") if kept == 50257 else types.SimpleNamespace(module=model)
    out = hf_interop.export_hf(source, str(tmp_path / "hf"))
    hf, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = hf.config
    assert (cfg.vocab_size, cfg.n_positions, cfg.n_ctx, cfg.n_embd, cfg.n_layer, cfg.n_head) == (kept, 32, 32, 32, 2, 2)
    assert (cfg.tie_word_embeddings, cfg.activation_function) == (True, "gelu_new")
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    assert_same_logits(hf.eval(), model, kept, (2, 32), seed=5)
    if kept == 50257:
        assert cfg.bos_token_id == cfg.eos_token_id == 50256
    back = GPT.from_hf(out, vocab_size=vocab_size)
    assert back.config == model.config
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        n = kept if key in hf_interop.TIED else None
        assert torch.equal(a[key][:n], b[key][:n]), key


EXPORT = [os.path.join(REPO, "hf_interop.py"), "export"]  # the command line of an export run as a program
export = lambda *args, cwd=None: run_main("hf_interop.py", "export", *args, cwd=cwd)  # in-process, through main


def refused_leaving(ckpt, out, check, message):
    """`export ckpt out` refused (check: assert_refused_quietly, or assert_one_error_line of a fragment), out kept."""
    before = tree_hashes(out)
    check(export(ckpt, out), message)
    assert tree_hashes(out) == before


def test_cli_export_refuses_a_missing_checkpoint_and_a_full_disk(tmp_path, monkeypatch):
    """(A checkpoint not ours: test_hostile's test_foreign_or_damaged_checkpoint_in_every_command.)"""
    missing = str(tmp_path / "nope.pt")
    assert_one_error_line(export(missing, tmp_path / "out"), "does not exist")
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError):
        hf_interop.main(["export", missing, str(tmp_path / "out"), "--debug"])

    def full_disk(self, out_dir, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(GPT2LMHeadModel, "save_pretrained", full_disk)
    ckpt = save_ours(tiny_ours(vocab_size=100), tmp_path / "ckpt.pt")
    out = tmp_path / "out"
    assert_refused(export(ckpt, out), f"cannot write the Hugging Face model to {out}: no space left on device")


def init_from_args(data_dir, out, folder, *extra, **sizes) -> list:
    """tiny_run_args of a run initialized from the Hugging Face folder: without the shape flags (the weights set it)."""
    args = tiny_run_args(data_dir, out, "--init-from", folder, *extra, **sizes)
    for flag in ("--n-layer", "--n-head", "--n-embd", "--block-size"):
        del args[args.index(flag) : args.index(flag) + 2]
    return args


@pytest.mark.parametrize("kind", list(NOT_GPT2))
def test_a_folder_that_is_not_gpt2_is_refused(data_dir, tmp_path, kind):
    """Through the trainer's --init-from (bert, a GPT-2 without layer 1) or GPT.from_hf (the others)."""
    folder = not_gpt2_folder(tmp_path / "hf", kind)
    if kind in ("llama", "gpt2 with a shorter position table"):
        with pytest.raises(UserError) as e:
            GPT.from_hf(str(folder))
        assert str(e.value) == f"--init-from {folder}: {NOT_GPT2[kind]}"
        return
    proc = run_main("train_gpt2.py", *init_from_args(data_dir, tmp_path / "out", folder, B=2, rows=2, steps=1))
    assert_refused(proc, f"--init-from {folder}: {NOT_GPT2[kind]}")
    assert not (tmp_path / "out" / "ckpt_0000001.pt").exists()


def test_import_refuses_a_missing_folder_and_what_we_cannot_reproduce(tmp_path, monkeypatch):
    """A missing or empty folder; a GPT-2 of another activation, or untied; transformers missing: one line each."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    for name in (str(tmp_path / "missing_dir"), "./missing", "empty"):
        with pytest.raises(UserError, match="local Hugging Face directory") as e:
            GPT.from_hf(name)
        assert "--init-from" in str(e.value) and "\n" not in str(e.value)
    untied = tiny_hf(vocab_size=100, tie_word_embeddings=False)
    with torch.no_grad():
        untied.lm_head.weight.normal_()
    for hf, match in [
        (tiny_hf(vocab_size=100, activation_function="relu"), "activation_function"),
        (untied, "not tied"),
    ]:
        with pytest.raises(UserError, match=match):
            GPT.from_hf(save_hf(hf, tmp_path / "hf"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(UserError, match="pip install transformers"):
        GPT.from_hf(str(tmp_path))
    with pytest.raises(UserError, match="pip install transformers"):
        hf_interop.export_hf(tiny_ours(vocab_size=100), str(tmp_path / "out"))


def test_train_init_from_hf_starts_at_the_pretrained_loss_and_exports_back(data_dir, tmp_path):
    """Trained on with Muon (every block matrix moved), the run's export gives transformers our logits."""
    hf_dir, out = save_hf(tiny_hf(), tmp_path / "hf"), tmp_path / "out"
    flags = ("--val-steps", "1", "--optimizer", "muon")
    assert train_gpt2.main(init_from_args(data_dir, out, hf_dir, *flags, steps=2, seq_len=16, rows=4, val_every=2)) == 0
    # the step-0 validation loss is the Hugging Face model's own loss on the first val rows (our
    # 47 padded ids carry no probability), and its bits per byte come from that model's token losses
    rows = train_gpt2.TokenRows(data_dir, "val", 16)
    x, y = (torch.from_numpy(a) for a in rows.batch(0, 4))
    with torch.no_grad():
        hf_losses = torch.nn.functional.cross_entropy(
            GPT2LMHeadModel.from_pretrained(hf_dir)(x).logits.flatten(0, 1), y.flatten(), reduction="none"
        )
    n_bytes = torch.from_numpy(token_byte_lengths(50304))[y.flatten()]
    ckpt = checkpoints.load_checkpoint(str(out / "ckpt_0000002.pt"))
    loss, bpb = hf_losses.mean().item(), (hf_losses * (n_bytes > 0)).sum().item() / (math.log(2) * n_bytes.sum().item())
    approx = dict(val_loss=pytest.approx(loss, rel=1e-6), val_bpb=pytest.approx(bpb, rel=1e-6))
    assert log_records(out)[0] == {"step": 0, **approx, "run": ckpt["run"]["id"]}
    assert ckpt["model_config"] == dict(block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)
    ours, initial = GPT.from_checkpoint(str(out)), GPT.from_hf(hf_dir).state_dict()
    assert all(not torch.equal(initial[k], v) for k, v in ours.state_dict().items() if ".h." in k and v.dim() == 2)
    assert_same_logits(hf_interop.export_hf(str(out), str(tmp_path / "back")), ours, 50257, (2, 32), seed=5)


TRANSFORMERS_CLIENT = r"""
import json, sys, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
export, texts_file, long_prompt = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(export)
model = AutoModelForCausalLM.from_pretrained(export)
gen = pipeline("text-generation", model=export, device="cpu")
short = gen("Hello world", max_new_tokens=5, do_sample=False)[0]["generated_text"]
# a prompt longer than the model's positions: "hole" keeps its end, with room for the new tokens
long = gen(long_prompt, max_new_tokens=5, do_sample=False, handle_long_generation="hole",
           return_full_text=False)[0]["generated_text"]
print(json.dumps(dict(version=transformers.__version__, ids=[tok.encode(t) for t in json.load(open(texts_file))],
                      vocab=len(tok), special=[tok.bos_token_id, tok.eos_token_id, tok.unk_token_id],
                      max_length=tok.model_max_length, model=type(model).__name__,
                      n_positions=model.config.n_positions, short=short, long=long)))
"""


def reference_encoding():
    """GPT-2's r50k_base built by tiktoken's own loader from the shipped bpe/ file (not trainkit.data.tokenizer's
    parser of it), with tiktoken's r50k pattern and <|endoftext|> = 50256; never the network."""
    ranks = load_tiktoken_bpe(os.path.join(REPO, "bpe", "r50k_base.tiktoken"), expected_hash=BPE_SHA256)
    tables = dict(pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256})
    return tiktoken.Encoding("r50k_base_reference", explicit_n_vocab=50257, **tables)


def parity_texts():
    """Lines and whole files of the repository's sources and docs, with unicode, whitespace runs
    and literal <|endoftext|>: the strings an export's tokenizer must encode as tiktoken does."""
    patterns = ("*.py", "trainkit/**/*.py", "tests/*.py", "benchmarks/*.py", "docs/*.md", "README.md")
    files = sorted(path for pattern in patterns for path in glob.glob(f"{REPO}/{pattern}", recursive=True))
    whole = [open(path, encoding="utf-8").read() for path in files]
    return (
        [line for text in whole for line in text.splitlines()]
        + whole
        + ["Hello world", "", " ", "\t\t  \t", "   many    spaces     ", "a\r\nb\r\n\r\n", "\n\n\n"]
        + ["naïve café 世界 こんにちは 안녕하세요 🎉👍🏽 👨‍👩‍👧", "1234567890 3.14159 1e-9", "don't I'll we've THEY'RE"]
        + ["<|endoftext|>", "x<|endoftext|>y <|endoftext|> z", "<|endoftext|><|endoftext|>"]
        + ["\u00a0\u2003nbsp\u200b", "Ω≈ç√∫ ∑ ¡™£¢"]
    )


def greedy(model, ids, n):
    """Our model's n greedy tokens after ids (over the 50257 real ids), up to <|endoftext|>."""
    ids = list(ids)
    for _ in range(n):
        token = int(logits_of(model, torch.tensor([ids]))[0, -1, :50257].argmax())
        if token == 50256:
            break
        ids.append(token)
    return ids


@pytest.fixture(scope="module")
def exported_for_clients(tmp_path_factory):
    """A tiny model of ours (32 positions) exported by the real command, with the texts to encode."""
    tmp = tmp_path_factory.mktemp("clients")
    proc = export(save_ours(tiny_ours(vocab_size=50304), tmp / "ckpt_0000007.pt"), tmp / "hf")
    assert proc.returncode == 0, proc.stderr
    texts = parity_texts()
    (tmp / "texts.json").write_text(json.dumps(texts))
    return tmp / "hf", tmp / "texts.json", texts


@pytest.mark.parametrize("transformers_release", ["installed", "oldest allowed"])
def test_export_loads_and_tokenizes_like_tiktoken_in_transformers_clients(exported_for_clients, transformers_release):
    """AutoTokenizer, AutoModelForCausalLM and pipeline on the export alone, offline: with the transformers installed
    and with the oldest requirements-dev.txt allows (.ci/run installs it in OLDEST_TRANSFORMERS_DIR, put on PYTHONPATH)."""
    out, texts_file, texts = exported_for_clients
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if transformers_release == "oldest allowed":
        oldest_dir = os.environ.get("OLDEST_TRANSFORMERS_DIR")
        if not oldest_dir or not os.path.isdir(oldest_dir):
            pytest.skip("OLDEST_TRANSFORMERS_DIR is not a folder holding the oldest transformers (.ci/run installs it)")
        env["PYTHONPATH"] = os.pathsep.join([oldest_dir, *filter(None, [env.get("PYTHONPATH")])])
    long_prompt = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()[:400]
    proc = run_command("-c", TRANSFORMERS_CLIENT, out, texts_file, long_prompt, env=env)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.splitlines()[-1])
    oldest = re.search(r"^transformers>=([\d.]+)", open(os.path.join(REPO, "requirements-dev.txt")).read(), re.M)[1]
    release = transformers.__version__ if transformers_release == "installed" else oldest
    assert Version(r["version"]) == Version(release)
    enc = reference_encoding()
    want = [enc.encode(t, allowed_special={"<|endoftext|>"}) for t in texts]
    diff = [t for t, a, b in zip(texts, want, r["ids"]) if a != b]
    assert len(texts) > 10000 and sum(map(len, texts)) > 300_000
    assert (len(diff), diff[:3]) == (0, [])
    assert (r["vocab"], r["special"], r["model"]) == (50257, [50256] * 3, "GPT2LMHeadModel")
    assert r["max_length"] == r["n_positions"] == 32  # the model's block size
    ours = tiny_ours(vocab_size=50304)
    hello = enc.encode("Hello world")
    assert r["short"] == "Hello world" + enc.decode(greedy(ours, hello, 5)[len(hello) :])
    prompt = enc.encode(long_prompt)
    assert len(prompt) > 32
    kept = prompt[-(32 - 5) :]  # the end of the prompt, with room for 5 new tokens in 32 positions
    assert r["long"] == enc.decode(greedy(ours, kept, 5)[len(kept) :])


def two_checkpoints(folder, vocab_size):
    """tiny_ours of seeds 1 and 2 saved as folder/ckpt_0000001.pt and ckpt_0000002.pt: their paths."""
    return [save_ours(tiny_ours(vocab_size=vocab_size, seed=s), folder / f"ckpt_000000{s}.pt") for s in (1, 2)]


# An export under a file size limit (a write error mid-way: model.safetensors, ~100 KB, over 20,000 bytes), run as a
# program (-c's argv: the script and its arguments) in an interpreter it leaves as it found it
SIZE_LIMITED = r"""
import resource, runpy, signal, sys
handler, (soft, hard) = signal.signal(signal.SIGXFSZ, signal.SIG_IGN), resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, handler)
"""


@pytest.fixture(scope="module")
def exports_as_programs(tmp_path_factory):
    """Two exports over an earlier one, as programs in one interpreter: under a non-UTF-8 folder (tmp/run\\xff, to
    tmp/hf) and under a file size limit (to tmp/limited/hf). Returns tmp, the limited folder's bytes, the two programs."""
    tmp = tmp_path_factory.mktemp("programs")
    run, limited = os.path.join(os.fsencode(tmp), b"run\xff"), tmp / "limited"
    os.makedirs(run)
    limited.mkdir()
    write_checkpoint(tiny_ours(), os.fsdecode(os.path.join(run, b"ckpt_0000003.pt")))  # (it records no step)
    first, second = two_checkpoints(limited, 200)
    assert export(os.fsdecode(run), tmp / "hf").returncode == export(first, limited / "hf").returncode == 0
    before = tree_hashes(limited / "hf")
    cases = [
        ["hf_interop.py", "export", os.fsdecode(run), tmp / "hf"],
        ["-c", SIZE_LIMITED, *EXPORT, second, limited / "hf"],
    ]
    return tmp, before, *run_as_programs([dict(argv=[str(a) for a in argv]) for argv in cases])


def test_cli_export_over_an_earlier_one_is_atomic(exports_as_programs):
    tmp, before, _, proc = exports_as_programs
    out = tmp / "limited" / "hf"
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: cannot write the Hugging Face model to {out}")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert tree_hashes(out) == before  # the earlier export whole, no temporary folder left
    assert sorted(os.listdir(out.parent)) == ["ckpt_0000001.pt", "ckpt_0000002.pt", "hf"]
    assert_same_logits(out, tiny_ours(vocab_size=200, seed=1), 200)
    (out / "notes.txt").write_text("mine")  # a folder with the user's own files is refused, nothing lost
    refused_leaving(out.parent / "ckpt_0000001.pt", out, assert_one_error_line, "notes.txt")


def changed_since(out, changes):
    return (
        f"{out} has changed since hf_interop.py exported it ({changes}), so it may hold a model of your "
        f"own and is left as it is: to replace it on purpose, delete what it holds first (rm -r {out}), or export "
        "into a new or empty folder"
    )


def test_cli_export_replaces_only_an_unchanged_export_of_its_own(tmp_path):
    """Left byte for byte: the user's own save_pretrained folder (only file names an export writes), a folder of another
    mark, and an export changed since (fine-tuned and saved over, the mark surviving; a file missing; an older mark)."""
    ckpt = save_ours(tiny_ours(vocab_size=100), tmp_path / "ckpt_0000007.pt")
    mine = save_hf(tiny_hf(vocab_size=100), tmp_path / "mine")
    assert sorted(tree_hashes(mine)) == ["config.json", "generation_config.json", "model.safetensors"]
    said = (
        f"{mine} is not empty and is not an export of hf_interop.py (it has no gpt2_trainer_export.json), "
        "so it may hold a model of your own and is left as it is: export into a new or empty folder"
    )
    refused_leaving(ckpt, mine, assert_refused_quietly, said)
    assert sorted(os.listdir(tmp_path)) == ["ckpt_0000007.pt", "mine"]
    (tmp_path / "empty").mkdir()
    for folder in ("empty", "missing", "empty"):  # the second export into empty/ replaces the marked first
        assert hf_interop.main(["export", ckpt, str(tmp_path / folder)]) == 0
        mark = json.loads((tmp_path / folder / hf_interop.EXPORT_MARK).read_text())
        written = dict(written_by="gpt2-trainer hf_interop.py export", mark_version=2, checkpoint=ckpt, step=7)
        checksum = checkpoints.load_checkpoint(ckpt)["checksum"]
        assert mark == dict(written, checksum=checksum, vocab_size=100, files=mark["files"])
    (tmp_path / "missing" / hf_interop.EXPORT_MARK).write_text('{"written_by": "someone else"}')
    refused_leaving(ckpt, tmp_path / "missing", assert_one_error_line, "is not an export of hf_interop.py")
    out = tmp_path / "empty"  # an export of ckpt: its mark names each file's sha256
    assert mark["files"] == {name: sha for name, sha in tree_hashes(out).items() if name != hf_interop.EXPORT_MARK}
    assert sorted(mark["files"]) == ["config.json", "generation_config.json", "model.safetensors"]
    tiny_hf(vocab_size=100, seed=3).save_pretrained(out)  # the user's own model, saved over the export
    said = changed_since(out, "config.json changed, model.safetensors changed")
    refused_leaving(ckpt, out, assert_refused_quietly, said)
    for change, expected in [
        ("missing", "generation_config.json missing"),
        ("older mark", "its mark lists no files: an older hf_interop.py wrote it"),
    ]:
        shutil.rmtree(out)
        assert hf_interop.main(["export", ckpt, str(out)]) == 0
        if change == "missing":
            (out / "generation_config.json").unlink()
        else:
            (out / hf_interop.EXPORT_MARK).write_text(json.dumps({**mark, "mark_version": 1, "files": None}))
        refused_leaving(ckpt, out, assert_refused_quietly, changed_since(out, expected))
    assert sorted(os.listdir(tmp_path)) == ["ckpt_0000007.pt", "empty", "mine", "missing"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_export_swap_leaves_the_folder_whole_at_every_step(tmp_path, monkeypatch, exchange):
    """Over an earlier export, one renameat2(RENAME_EXCHANGE): the path always names a whole export. Without it
    (macOS, some network file systems) two renames leave it missing a moment: the fallback shows this test sees it."""
    out = tmp_path / "hf"
    first, second = two_checkpoints(tmp_path, 100)
    assert hf_interop.main(["export", first, str(out)]) == 0
    whole = []  # after each rename or exchange: does out hold a whole export?
    is_whole = lambda: (
        out.is_dir() and {"config.json", "model.safetensors", hf_interop.EXPORT_MARK} <= set(os.listdir(out))
    )
    for name in ("rename", "replace"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda a, b, real=real: (real(a, b), whole.append(is_whole()))[0])
    real_exchange = export_folder._exchange
    monkeypatch.setattr(
        export_folder, "_exchange", lambda a, b: exchange and (real_exchange(a, b), whole.append(is_whole()))[0]
    )
    assert hf_interop.main(["export", second, str(out)]) == 0
    assert whole == ([True] if exchange else [False, True])
    assert sorted(os.listdir(tmp_path)) == ["ckpt_0000001.pt", "ckpt_0000002.pt", "hf"]  # the old one deleted
    assert_same_logits(out, tiny_ours(vocab_size=100, seed=2), 100, seed=4)


def test_cli_export_killed_leaves_a_partial_folder_that_the_next_export_removes(tmp_path):
    """kill -9 while an export writes leaves its hidden partial folder (and the earlier export whole); the next export
    to the same folder removes it, as no live process holds its lock, and leaves one that a live process holds."""
    first, second = two_checkpoints(tmp_path, 50304)
    out = tmp_path / "hf"
    assert export(first, out).returncode == 0
    before = tree_hashes(out)
    killed = None
    for _ in range(5):  # writing the weights and the tokenizer takes about a second: kill it then
        proc = start([sys.executable, *EXPORT, second, out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None and killed is None:
            # (once it is marked: a folder killed before its mark is left as the user's)
            marked = [p for p in tmp_path.glob(".hf.export-*") if (p / export_folder.PARTIAL_MARK).exists()]
            killed = marked[0] if marked else None
            time.sleep(0.002)
        proc.kill()
        proc.wait()
        if killed:
            break
    assert killed is not None and killed.is_dir()
    assert tree_hashes(out) == before  # the earlier export, whole
    live = tmp_path / ".hf.export-live0000"  # a partial folder of an export still running
    live.mkdir()
    (live / "config.json").write_text("{}")
    lock = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        export_folder.mark_partial(lock)  # (as a live export marks it: only its lock keeps it)
        proc = export(second, out)
    finally:
        os.close(lock)
    assert proc.returncode == 0, proc.stderr
    assert f"removed {killed}, the partial folder of an export that was killed\n" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == [".hf.export-live0000", "ckpt_0000001.pt", "ckpt_0000002.pt", "hf"]
    assert (live / "config.json").read_text() == "{}"
    assert_same_logits(out, tiny_ours(vocab_size=50304, seed=2), 50257)


def in_mount_namespace(folder, *command):
    """command in a mount namespace where folder is a bind mount onto itself: renames refuse it (EBUSY) as a volume."""
    return subprocess.run(
        ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" "$0" && exec "$@"', str(folder), *map(str, command)],
        capture_output=True,
        text=True,
        timeout=300,
    )


# The exports of the test below through hf_interop's main, each a JSON line [exit code, stderr]; argv: the repo, the
# volume, a folder for its copies (i.before, i.after), pairs (checkpoint, a folder copied into the volume first or "")
EXPORTS_IN_VOLUME = r"""
import contextlib, io, json, os, shutil, sys
repo, volume, copies, *steps = sys.argv[1:]
sys.path.insert(0, repo)
import hf_interop
for i, (ckpt, mine) in enumerate(zip(steps[::2], steps[1::2])):
    for name in os.listdir(mine) if mine else ():
        shutil.copy(os.path.join(mine, name), volume)
    shutil.copytree(volume, os.path.join(copies, f"{i}.before"))
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = hf_interop.main(["export", ckpt, volume])
    shutil.copytree(volume, os.path.join(copies, f"{i}.after"))
    print(json.dumps([code, err.getvalue()]))
"""


def test_cli_export_into_a_mount_point_moves_the_files_in(tmp_path):
    """A mount point cannot be renamed over (EBUSY): the export is written inside it and its files
    are moved in one by one; over an earlier export there too, and a changed one is refused."""
    if shutil.which("unshare") is None or in_mount_namespace(tmp_path, "true").returncode != 0:
        pytest.skip("needs unshare --mount and mount --bind (root)")
    volume, copies = tmp_path / "volume", tmp_path / "copies"
    volume.mkdir()
    first, second = two_checkpoints(tmp_path, 100)
    mine = save_hf(tiny_hf(vocab_size=100), tmp_path / "mine")  # the user's own model, saved over the export
    # into the empty mount point, over the export there, over a changed one
    steps = [first, "", second, "", first, mine]
    proc = in_mount_namespace(volume, sys.executable, "-c", EXPORTS_IN_VOLUME, REPO, volume, copies, *steps)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [code for code, _ in results] == [0, 0, 2], results
    for i, seed in ((0, 1), (1, 2)):
        names = ["config.json", "generation_config.json", hf_interop.EXPORT_MARK, "model.safetensors"]
        assert sorted(os.listdir(copies / f"{i}.after")) == names
        assert_same_logits(copies / f"{i}.after", tiny_ours(vocab_size=100, seed=seed), 100)
    assert results[2][1] == f"error: {changed_since(volume, 'config.json changed, model.safetensors changed')}\n"
    assert tree_hashes(volume) == tree_hashes(copies / "2.before")
    assert sorted(os.listdir(tmp_path)) == ["ckpt_0000001.pt", "ckpt_0000002.pt", "copies", "mine", "volume"]


def test_cli_export_of_a_run_folder_names_its_newest_checkpoint_and_step(tmp_path):
    """Named relative to where it was run, in files of the umask's mode; --help says that the script exports and
    evaluates, export's --help both sources it takes."""
    umask = 0o027  # not the usual 022, so that the test tells honouring it from a fixed 0644
    (tmp_path / "run").mkdir()
    save_ours(tiny_ours(vocab_size=100, seed=1), tmp_path / "run" / "ckpt_0000003.pt", step=3)
    save_ours(tiny_ours(vocab_size=100), tmp_path / "run" / "ckpt_0000012.pt", step=12)
    os.umask(umask)  # (the process's umask is restored after the test)
    for run, out in [("run", "run_hf"), (str(tmp_path / "run"), str(tmp_path / "exported"))]:
        proc = export(run, out, cwd=tmp_path)
        assert (proc.returncode, proc.stderr) == (0, "")
        assert proc.stdout == (
            f"wrote Hugging Face GPT-2 of run/ckpt_0000012.pt (step 12) to {out} (load with "
            f"GPT2LMHeadModel.from_pretrained({out!r}) and AutoTokenizer.from_pretrained({out!r}))\n"
        )
        # safetensors writes through a private temporary file; the export gives it a normal file's mode
        names = ["config.json", "generation_config.json", "model.safetensors", hf_interop.EXPORT_MARK]
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / out).iterdir()}
        assert modes == dict.fromkeys(names, 0o666 & ~umask)
        assert_same_logits(tmp_path / out, tiny_ours(vocab_size=100), 100, (2, 32), seed=6)
    usage, export_usage = (" ".join(run_main("hf_interop.py", *a, "--help").stdout.split()) for a in ([], ["export"]))
    assert (
        "Export a train_gpt2.py checkpoint as a Hugging Face GPT-2 folder, or evaluate one with lm-evaluation-harness."
    ) in usage  # however wide the terminal
    assert (
        "a checkpoint written by train_gpt2.py: a ckpt_*.pt file, or a run's --out-dir folder for its newest checkpoint"
    ) in export_usage


def test_a_run_under_a_folder_whose_name_is_not_utf8_exports(exports_as_programs):
    """The export's mark keeps such a path as its escapes; a second export over the first reads it back. The first
    runs in-process; the second as a program, whose stdout (set up by the script, not run_main) escapes the name."""
    tmp, _, result, _ = exports_as_programs
    ckpt = os.path.join(os.fsencode(tmp), b"run\xff", b"ckpt_0000003.pt")
    assert (result.returncode, result.stderr) == (0, ""), result.stderr[-3000:]
    assert result.stdout.startswith(
        f"wrote Hugging Face GPT-2 of {os.fsdecode(ckpt)} (it records no step)".replace("\udcff", "\\udcff")
    )
    assert json.loads((tmp / "hf" / hf_interop.EXPORT_MARK).read_text())["checkpoint"] == os.fsdecode(ckpt)
