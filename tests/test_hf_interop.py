"""hf_interop.py: Hugging Face GPT-2 <-> our GPT, offline, on tiny random models."""
import dataclasses
import math
import os
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import hf_interop  # noqa: E402
from conftest import REPO  # noqa: E402
import checkpoints  # noqa: E402
import train_gpt2  # noqa: E402
from cli import UserError  # noqa: E402
from train_gpt2 import GPT, GPTConfig  # noqa: E402



def tiny_hf(vocab_size=50257, n_positions=32, seed=0, **overrides):
    torch.manual_seed(seed)
    fields = dict(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new",
                  bos_token_id=None, eos_token_id=None)
    cfg = GPT2Config(**{**fields, **overrides})
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # random LayerNorm affine too, so a swapped weight/bias shows
        for name, p in model.named_parameters():
            if ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_hf(model, path):
    model.save_pretrained(str(path))
    return str(path)


def tiny_ours(vocab_size=50304, block_size=32, seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # biases and LayerNorms start at 0/1: make them random
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_ours(model, path, step=7):
    checkpoints.save_checkpoint(str(path), dict(model=model.state_dict(),
                                               model_config=dataclasses.asdict(model.config), step=step))
    return str(path)


def logits_of(model, idx):
    with torch.no_grad():
        out = model(idx)
    return out.logits if hasattr(out, "logits") else out[0]


def test_import_matches_hf_logits(tmp_path):
    hf = tiny_hf()
    model = GPT.from_hf(save_hf(hf, tmp_path / "hf"))
    assert model.config == GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(1))
    ours, theirs = logits_of(model, idx), logits_of(hf, idx)
    assert ours.shape == (2, 32, 50304)
    torch.testing.assert_close(ours[..., :50257], theirs, atol=1e-5, rtol=0)
    wte = model.transformer.wte.weight
    assert model.lm_head.weight is wte  # still tied
    torch.testing.assert_close(wte[50257:], wte[:50257].mean(0).expand(47, -1))


def test_import_small_vocab_crop_and_bad_sizes(tmp_path):
    hf = tiny_hf(vocab_size=100)
    path = save_hf(hf, tmp_path / "hf")
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

    zero = GPT.from_hf(path, pad_init="zero")
    assert logits_of(zero, idx).softmax(-1)[..., 100:].sum(-1).min() > 0.99  # padding takes it all


def test_export_checkpoint_loads_in_transformers(tmp_path):
    model = tiny_ours()
    out = hf_interop.export_hf(save_ours(model, tmp_path / "ckpt_0000007.pt"), str(tmp_path / "hf"))
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    hf, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = hf.config
    assert (cfg.vocab_size, cfg.n_positions, cfg.n_embd, cfg.n_layer, cfg.n_head) == (50257, 32, 32, 2, 2)
    assert cfg.n_ctx == 32 and cfg.tie_word_embeddings and cfg.activation_function == "gelu_new"
    assert cfg.bos_token_id == cfg.eos_token_id == 50256
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(logits_of(hf.eval(), idx), logits_of(model, idx)[..., :50257], atol=1e-5, rtol=0)


@pytest.mark.parametrize("vocab_size, kept", [(50304, 50257), (100, 100)])
def test_round_trip_is_exact(tmp_path, vocab_size, kept):
    model = tiny_ours(vocab_size=vocab_size)
    wrapped = types.SimpleNamespace(module=model)  # like DDP's .module
    out = hf_interop.export_hf(wrapped, str(tmp_path / "hf"))
    assert GPT2Config.from_pretrained(out).vocab_size == kept
    back = GPT.from_hf(out, vocab_size=vocab_size)
    assert back.config == model.config
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        n = kept if key in hf_interop.TIED else None
        assert torch.equal(a[key][:n], b[key][:n]), key


def run_cli(*args, cwd=None, umask=None):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=300,
                          cwd=cwd or REPO, preexec_fn=None if umask is None else lambda: os.umask(umask))


def test_cli_export_a_run_folder_with_the_files_mode_the_umask_gives(tmp_path):
    umask = 0o027  # not the usual 022, so that the test tells honouring it from a fixed 0644
    model = tiny_ours(vocab_size=100)
    (tmp_path / "run").mkdir()
    save_ours(tiny_ours(vocab_size=100, seed=1), tmp_path / "run" / "ckpt_0000003.pt", step=3)
    save_ours(model, tmp_path / "run" / "ckpt_0000007.pt")
    out = tmp_path / "exported"
    proc = run_cli(os.path.join(REPO, "hf_interop.py"), "export", tmp_path / "run", out, cwd=tmp_path, umask=umask)
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout and "wrote" in proc.stdout
    # safetensors writes through a private temporary file; the export gives it a normal file's mode
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes == dict.fromkeys(["config.json", "generation_config.json", "model.safetensors",
                                   hf_interop.EXPORT_MARK], 0o666 & ~umask)
    hf = GPT2LMHeadModel.from_pretrained(out).eval()  # the newest checkpoint's weights
    idx = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(logits_of(hf, idx), logits_of(model, idx), atol=1e-5, rtol=0)


def test_cli_export_help_names_both_sources(capsys):
    with pytest.raises(SystemExit):
        hf_interop.main(["export", "--help"])
    assert ("a checkpoint written by train_gpt2.py: a ckpt_*.pt file, or a run's --out-dir folder for its "
            "newest checkpoint") in " ".join(capsys.readouterr().out.split())


def test_cli_export_refuses_torch_files_that_are_not_ours(tmp_path, capsys):
    model = tiny_ours(vocab_size=100)
    config = dataclasses.asdict(model.config)
    files = {  # load_checkpoint's checks, seen through the export
        "nanogpt.pt": ({"model": model.state_dict(), "model_args": config, "iter_num": 5},
                       "no model_config, checksum; its keys: model, model_args, iter_num"),
        "tensor.pt": (torch.zeros(3), "it holds a Tensor, not a dict"),
        "unknown_key.pt": ({"model": model.state_dict(), "model_config": {**config, "bias": True}, "checksum": ""},
                           "unknown model_config bias"),
    }
    for name, (obj, _) in files.items():
        torch.save(obj, tmp_path / name)
    nanogpt = tmp_path / "nanogpt.pt"
    proc = run_cli(os.path.join(REPO, "hf_interop.py"), "export", nanogpt, tmp_path / "out")
    assert (proc.returncode, proc.stderr) == (
        2, f"error: {nanogpt}: not a train_gpt2.py checkpoint ({files['nanogpt.pt'][1]})\n")
    for name, (_, reason) in files.items():  # the other kinds in-process: the same code path
        assert hf_interop.main(["export", str(tmp_path / name), str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == f"error: {tmp_path / name}: not a train_gpt2.py checkpoint ({reason})\n"
    assert not (tmp_path / "out").exists()


def test_export_disk_full_is_one_line(tmp_path, monkeypatch, capsys):
    import errno

    def full_disk(self, out_dir, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(GPT2LMHeadModel, "save_pretrained", full_disk)
    ckpt = save_ours(tiny_ours(vocab_size=100), tmp_path / "ckpt.pt")
    assert hf_interop.main(["export", ckpt, str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: cannot write the Hugging Face model to {tmp_path / 'out'}: no space left on device\n"


def not_gpt2_folder(path, kind):
    """A folder that GPT2LMHeadModel.from_pretrained loads without an error, as random weights."""
    from safetensors.torch import load_file, save_file
    if kind == "bert":
        from transformers import BertConfig, BertModel
        BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=64)).save_pretrained(path)
    elif kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64)).save_pretrained(path)
    else:
        save_hf(tiny_hf(vocab_size=100), path)
        weights = load_file(path / "model.safetensors")
        if kind == "gpt2 without layer 1":
            weights = {k: v for k, v in weights.items() if ".h.1." not in k}
        else:  # "gpt2 with a shorter position table"
            weights["transformer.wpe.weight"] = weights["transformer.wpe.weight"][:16].clone()
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


NOT_GPT2 = {
    "bert": "its config.json describes a 'bert' model, not GPT-2",
    "llama": "its config.json describes a 'llama' model, not GPT-2",
    "gpt2 without layer 1": ("tensors missing from its weights (transformer.h.1.attn.c_attn.bias, "
                             "transformer.h.1.attn.c_attn.weight, ...; 12 in all) would be random; "
                             "is it a complete GPT-2?"),
    "gpt2 with a shorter position table": ("tensors of another shape than its config.json gives "
                                           "(transformer.wpe.weight; 1 in all)"),
}


@pytest.mark.parametrize("kind", ["llama", "gpt2 with a shorter position table"])
def test_gpt_from_hf_refuses_a_folder_that_is_not_gpt2(tmp_path, kind):
    folder = not_gpt2_folder(tmp_path / "hf", kind)
    with pytest.raises(UserError) as e:
        GPT.from_hf(str(folder))
    assert str(e.value) == f"--init-from {folder}: {NOT_GPT2[kind]}"


@pytest.mark.parametrize("kind", ["bert", "gpt2 without layer 1"])
def test_cli_init_from_a_folder_that_is_not_gpt2_is_refused(tmp_path, kind):
    from shards import make_docs, write_shards
    folder = not_gpt2_folder(tmp_path / "hf", kind)
    write_shards(tmp_path / "data", make_docs(50, vocab=100), shard_size=1000)
    proc = run_cli(os.path.join(REPO, "train_gpt2.py"), "--init-from", folder, "--data-dir", tmp_path / "data",
                   "--out-dir", tmp_path / "out", "--batch-size", "2", "--seq-len", "16", "--total-batch-size", "32",
                   "--max-steps", "1", "--val-every", "0", "--sample-every", "0", "--hellaswag-every", "0")
    assert (proc.returncode, proc.stderr) == (2, f"error: --init-from {folder}: {NOT_GPT2[kind]}\n")
    assert not (tmp_path / "out" / "ckpt_0000001.pt").exists()


def test_cli_missing_checkpoint_is_one_line(tmp_path, capsys):
    missing = str(tmp_path / "nope.pt")
    assert hf_interop.main(["export", missing, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "does not exist" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError):
        hf_interop.main(["export", missing, str(tmp_path / "out"), "--debug"])


@pytest.mark.parametrize("name", ["missing_dir", "./missing", "empty"])
def test_init_from_missing_dir_is_one_line(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    arg = str(tmp_path / name) if name == "missing_dir" else name
    with pytest.raises(UserError) as e:
        GPT.from_hf(arg)
    msg = str(e.value)
    assert "--init-from" in msg and "local Hugging Face directory" in msg and "\n" not in msg


@pytest.mark.parametrize("overrides, match", [
    (dict(activation_function="relu"), "activation_function"),
    (dict(tie_word_embeddings=False), "not tied"),
])
def test_import_refuses_what_we_cannot_reproduce(tmp_path, overrides, match):
    hf = tiny_hf(vocab_size=100, **overrides)
    if not overrides.get("tie_word_embeddings", True):
        with torch.no_grad():
            hf.lm_head.weight.normal_()
    with pytest.raises(UserError, match=match):
        GPT.from_hf(save_hf(hf, tmp_path / "hf"))


def test_transformers_missing_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(UserError, match="pip install transformers"):
        GPT.from_hf(str(tmp_path))
    with pytest.raises(UserError, match="pip install transformers"):
        hf_interop.export_hf(tiny_ours(vocab_size=100), str(tmp_path / "out"))


def test_train_init_from_hf_directory_starts_at_the_pretrained_loss(tmp_path):
    import json
    from shards import make_docs, write_shards
    hf_dir = save_hf(tiny_hf(), tmp_path / "hf")
    write_shards(tmp_path / "data", make_docs(200, vocab=500), shard_size=3000)
    args = ["--init-from", hf_dir, "--data-dir", str(tmp_path / "data"), "--out-dir", str(tmp_path / "out"),
            "--batch-size", "4", "--seq-len", "16", "--total-batch-size", "64", "--max-steps", "2",
            "--val-every", "2", "--val-steps", "1", "--sample-every", "0", "--hellaswag-every", "0"]
    assert train_gpt2.main(args) == 0
    records = [json.loads(l) for l in open(tmp_path / "out" / "log.jsonl")]
    # the step-0 validation loss is the pretrained model's loss on the first val rows
    rows = train_gpt2.TokenRows(str(tmp_path / "data"), "val", 16)
    x, y = (torch.from_numpy(a) for a in rows.batch(0, 4))
    _, expected = GPT.from_hf(hf_dir)(x, y)
    ckpt = checkpoints.load_checkpoint(str(tmp_path / "out" / "ckpt_0000002.pt"))
    assert records[0] == {"step": 0, "val_loss": pytest.approx(expected.item(), rel=1e-5), "run": ckpt["run"]["id"]}
    assert ckpt["model_config"] == dict(block_size=32, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)


def test_export_of_a_muon_trained_run_has_our_logits(tmp_path):
    from shards import make_docs, write_shards
    write_shards(tmp_path / "data", make_docs(200, vocab=500), shard_size=3000)
    out = tmp_path / "out"
    args = ["--data-dir", str(tmp_path / "data"), "--out-dir", str(out), "--n-layer", "2", "--n-head", "2",
            "--n-embd", "32", "--block-size", "32", "--batch-size", "4", "--seq-len", "16", "--total-batch-size", "64",
            "--max-steps", "3", "--warmup-steps", "1", "--optimizer", "muon", "--val-every", "0", "--sample-every", "0",
            "--hellaswag-every", "0"]
    assert train_gpt2.main(args) == 0
    ours = GPT.from_checkpoint(str(out))
    torch.manual_seed(1337)  # the run's initial weights: Muon moved every block matrix away from them
    initial = GPT(ours.config).state_dict()
    assert all(not torch.equal(initial[k], v) for k, v in ours.state_dict().items() if ".h." in k and v.dim() == 2)
    hf = GPT2LMHeadModel.from_pretrained(hf_interop.export_hf(str(out), str(tmp_path / "hf"))).eval()
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(logits_of(hf, idx), logits_of(ours, idx)[..., :50257], atol=1e-5, rtol=0)


CLIENT_SCRIPT = r'''
import glob, json, sys, tiktoken
from transformers import AutoTokenizer, pipeline
export, data, repo = sys.argv[1:4]
enc = tiktoken.get_encoding("r50k_base")
tok = AutoTokenizer.from_pretrained(export)
texts = open(f"{data}/tinyshakespeare.txt", encoding="utf-8").read().splitlines()[:8000]
with open(f"{data}/hellaswag/hellaswag_val.jsonl", encoding="utf-8") as f:
    for line in list(f)[:1000]:
        ex = json.loads(line)
        texts += [ex["ctx"], *ex["endings"]]
for path in sorted(glob.glob(f"{repo}/*.py")):
    texts += open(path, encoding="utf-8").read().splitlines()
texts += ["Hello world", "", " ", "\t\t  \t", "   many    spaces     ", "a\r\nb\r\n\r\n", "\n\n\n",
          "naïve café 世界 こんにちは 안녕하세요 🎉👍🏽 👨‍👩‍👧", "1234567890 3.14159 1e-9", "<|endoftext|>",
          "x<|endoftext|>y <|endoftext|> z", "<|endoftext|><|endoftext|>", "don't I'll we've THEY'RE",
          "\u00a0\u2003nbsp\u200b", "Ω≈ç√∫ ∑ ¡™£¢"]
texts += [open(p, encoding="utf-8").read() for p in [f"{repo}/README.md", *sorted(glob.glob(f"{repo}/docs/*.md"))]]
diff = [t for t in texts if tok.encode(t) != enc.encode(t, allowed_special={"<|endoftext|>"})]
gen = pipeline("text-generation", model=export, device="cpu")
out = gen("Hello world", max_new_tokens=5, do_sample=False)[0]["generated_text"]
print(json.dumps(dict(n=len(texts), chars=sum(map(len, texts)), diff=diff[:3], ndiff=len(diff), vocab=len(tok),
                      eos=tok.eos_token_id, bos=tok.bos_token_id, unk=tok.unk_token_id, generated=out)))
'''


def test_export_tokenizes_like_tiktoken_in_transformers_clients(tmp_path):
    """AutoTokenizer and pipeline('text-generation') on the export folder alone, offline, as a user runs them."""
    from conftest import SHARED
    save_ours(tiny_ours(vocab_size=50304), tmp_path / "ckpt_0000007.pt")
    out = tmp_path / "hf"
    proc = run_cli(os.path.join(REPO, "hf_interop.py"), "export", tmp_path / "ckpt_0000007.pt", out)
    assert proc.returncode == 0, proc.stderr
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", hf_interop.EXPORT_MARK} == (
        {p.name for p in out.iterdir()} - {"config.json", "generation_config.json", "model.safetensors"})
    # the reference is tiktoken's own r50k_base (its cached download in ../shared), not our copy in bpe/
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TIKTOKEN_CACHE_DIR": str(SHARED / "tiktoken_cache")}
    proc = subprocess.run([sys.executable, "-c", CLIENT_SCRIPT, str(out), str(SHARED / "data"), REPO],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    r = __import__("json").loads(proc.stdout.splitlines()[-1])
    print("tokenizer parity:", r["n"], "strings,", r["chars"], "chars,", r["ndiff"], "differences")
    assert r["n"] > 10000 and r["chars"] > 300_000
    assert (r["ndiff"], r["diff"]) == (0, [])
    assert (r["vocab"], r["eos"], r["bos"], r["unk"]) == (50257, 50256, 50256, 50256)
    assert r["generated"].startswith("Hello world") and len(r["generated"]) > len("Hello world")


def folder_bytes(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_cli_export_over_an_earlier_one_is_atomic(tmp_path):
    import resource
    import signal

    def small_files():  # a write error mid-way: model.safetensors (~100 KB) over the file size limit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    export = [os.path.join(REPO, "hf_interop.py"), "export"]
    first, second = (save_ours(tiny_ours(vocab_size=200, seed=s), tmp_path / f"ckpt_000000{s}.pt") for s in (1, 2))
    out = tmp_path / "hf"
    assert run_cli(*export, first, out).returncode == 0
    before = folder_bytes(out)
    proc = subprocess.run([sys.executable, *export, second, out], capture_output=True, text=True, timeout=300,
                          preexec_fn=small_files)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: cannot write the Hugging Face model to {out}")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert folder_bytes(out) == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt_0000001.pt", "ckpt_0000002.pt", "hf"]  # the earlier export whole, no temporary folder left
    idx = torch.randint(0, 200, (1, 16), generator=torch.Generator().manual_seed(3))
    want = logits_of(tiny_ours(vocab_size=200, seed=1), idx)
    torch.testing.assert_close(logits_of(GPT2LMHeadModel.from_pretrained(out).eval(), idx), want, atol=1e-5, rtol=0)

    proc = run_cli(*export, second, out)  # a successful one replaces it whole
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_0000001.pt", "ckpt_0000002.pt", "hf"]
    want = logits_of(tiny_ours(vocab_size=200, seed=2), idx)
    torch.testing.assert_close(logits_of(GPT2LMHeadModel.from_pretrained(out).eval(), idx), want, atol=1e-5, rtol=0)

    (out / "notes.txt").write_text("mine")  # a folder with the user's own files is refused, nothing lost
    before = folder_bytes(out)
    proc = run_cli(*export, first, out)
    assert proc.returncode == 2 and "notes.txt" in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert folder_bytes(out) == before


def test_cli_export_refuses_a_folder_it_did_not_mark(tmp_path, capsys):
    """A save_pretrained folder of the user's own GPT-2 holds only file names an export writes: the
    export leaves it byte for byte (it replaced it, exit 0); it replaces only a folder holding its
    mark, and writes into an empty or missing one."""
    import json
    ckpt = save_ours(tiny_ours(vocab_size=100), tmp_path / "ckpt_0000007.pt")
    mine = save_hf(tiny_hf(vocab_size=100), tmp_path / "mine")
    before = folder_bytes(tmp_path / "mine")
    assert sorted(before) == ["config.json", "generation_config.json", "model.safetensors"]
    proc = run_cli(os.path.join(REPO, "hf_interop.py"), "export", ckpt, mine)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", (
        f"error: {mine} is not empty and is not an export of hf_interop.py (it has no gpt2_trainer_export.json), "
        "so it may hold a model of your own and is left as it is: export into a new or empty folder\n"))
    assert folder_bytes(tmp_path / "mine") == before and sorted(os.listdir(tmp_path)) == ["ckpt_0000007.pt", "mine"]

    (tmp_path / "empty").mkdir()
    for folder in ("empty", "missing", "empty"):  # the second export into empty/ replaces the marked first
        assert hf_interop.main(["export", ckpt, str(tmp_path / folder)]) == 0
        mark = json.loads((tmp_path / folder / hf_interop.EXPORT_MARK).read_text())
        assert mark == dict(written_by="gpt2-trainer hf_interop.py export", mark_version=1, checkpoint=ckpt, step=7,
                            checksum=checkpoints.load_checkpoint(ckpt)["checksum"], vocab_size=100)
    capsys.readouterr()
    (tmp_path / "missing" / hf_interop.EXPORT_MARK).write_text('{"written_by": "someone else"}')
    before = folder_bytes(tmp_path / "missing")
    assert hf_interop.main(["export", ckpt, str(tmp_path / "missing")]) == 2
    assert "is not an export of hf_interop.py" in capsys.readouterr().err
    assert folder_bytes(tmp_path / "missing") == before


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_export_swap_leaves_the_folder_whole_at_every_step(tmp_path, monkeypatch, exchange):
    """Over an earlier export, the swap is one renameat2(RENAME_EXCHANGE): after every rename the
    export's path names a whole export. Where the exchange is missing (macOS, some network file
    systems) two renames leave the path missing for a moment: the fallback shows that this test sees it."""
    out = tmp_path / "hf"
    first, second = (save_ours(tiny_ours(vocab_size=100, seed=s), tmp_path / f"ckpt_000000{s}.pt") for s in (1, 2))
    assert hf_interop.main(["export", first, str(out)]) == 0
    whole = []  # after each rename or exchange: does out hold a whole export?
    for name in ("rename", "replace"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda a, b, real=real: (real(a, b), whole.append(is_whole(out)))[0])
    real_exchange = hf_interop._exchange
    monkeypatch.setattr(hf_interop, "_exchange", lambda a, b: exchange and (real_exchange(a, b),
                                                                           whole.append(is_whole(out)))[0])
    assert hf_interop.main(["export", second, str(out)]) == 0
    assert whole == ([True] if exchange else [False, True])
    assert sorted(os.listdir(tmp_path)) == ["ckpt_0000001.pt", "ckpt_0000002.pt", "hf"]  # the old one deleted
    idx = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(logits_of(GPT2LMHeadModel.from_pretrained(out).eval(), idx),
                               logits_of(tiny_ours(vocab_size=100, seed=2), idx), atol=1e-5, rtol=0)


def is_whole(folder) -> bool:
    return folder.is_dir() and {"config.json", "model.safetensors", hf_interop.EXPORT_MARK} <= set(os.listdir(folder))
