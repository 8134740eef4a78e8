"""Model, loader, optimizer and schedule against references and hand counts."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainkit import cli
from trainkit.runtime.launch import Dist
import train_gpt2 as tg
from trainkit.runtime.kernels import chunked_loss_and_grads
from trainkit.data.shards import open_shard
from shards import EOT, loss_and_grads

SHARDS = dict(n_docs=300, seed=3, vocab=1000, max_len=40, shard_size=1500)  # conftest's data_dir: the row tests'


# --- model --------------------------------------------------------------------------------
def test_parameter_names_shapes_and_counts_of_gpt2_124m_and_the_cpu_preset():
    with torch.device("meta"):  # shapes, ties and counts without 500 MB of weights to initialize
        model = tg.GPT(tg.GPTConfig())
    sd = model.state_dict()
    shapes = [sd[f"transformer.{k}.weight"].shape for k in ("wte", "wpe", "h.11.attn.c_attn", "h.0.mlp.c_fc")]
    assert shapes == [(50304, 768), (1024, 768), (2304, 768), (3072, 768)]
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    # 124,475,904 with the 50304 vocab (GPT-2's 124,439,808 + 47 padded rows x 768)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808 + 47 * 768
    names = {k.split(".", 3)[-1] for k in sd if k.startswith("transformer.h.0.")}
    modules = ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
    assert names == {f"{m}.{p}" for m in modules for p in ("weight", "bias")}
    model = tg.GPT(tg.GPTConfig(**tg.MODEL_PRESETS["cpu"]))  # the counts add up, the tied embedding counted once
    C, V, L = 128, 50304, 4
    block = 2 * 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
    total = V * C + 256 * C + L * block + 2 * C  # wte (= lm_head), wpe, blocks, ln_f
    assert model.num_params(without_positions=False) == total == 7_265_024
    assert model.num_params() == total - 256 * C  # the 6·P of the FLOPs: lm_head in, position lookup out
    summary = "7.27M params (6.44M token embedding = lm_head, 0.03M positions, 0.79M blocks + ln_f)"
    assert model.param_summary() == summary


def test_init_scales_residual_projections():
    torch.manual_seed(0)
    model = tg.GPT(tg.GPTConfig(n_layer=8, n_head=4, n_embd=256, vocab_size=512, block_size=64))
    h = model.transformer.h
    weights = (model.transformer.wte, h[0].mlp.c_fc, h[0].mlp.c_proj, h[3].attn.c_proj)
    residual = 0.02 / math.sqrt(2 * 8)  # the projections into the residual stream: 1 / sqrt(2 * n_layer)
    assert [w.weight.std().item() for w in weights] == pytest.approx([0.02, 0.02, residual, residual], rel=0.05)
    assert model.transformer.h[0].attn.c_attn.bias.abs().max().item() == 0


def test_sdpa_attention_matches_explicit_masked_softmax():
    torch.manual_seed(0)
    cfg = tg.GPTConfig(n_layer=1, n_head=4, n_embd=32, vocab_size=64, block_size=16)
    attn = tg.CausalSelfAttention(cfg)
    x = torch.randn(3, 16, 32)
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, 4, 8).transpose(1, 2) for t in (q, k, v))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    expected = attn.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))
    torch.testing.assert_close(attn(x), expected, atol=1e-6, rtol=1e-5)


# --- optimizer and schedule ---------------------------------------------------------------
def test_adamw_decays_matrices_only_and_muon_takes_the_blocks_matrices():
    cfg = tg.GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=64, block_size=8)
    model = tg.GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    opt = tg.build_optimizer(model, 0.1, 6e-4, "cpu")
    decay, no_decay = opt.param_groups
    # by hand: wte (tied with lm_head), wpe, and per block c_attn, attn c_proj, c_fc, mlp c_proj
    assert len(decay["params"]) == 2 + 4 * cfg.n_layer
    # per block 2 LayerNorms x (weight, bias) + 4 linear biases; plus ln_f weight and bias
    assert len(no_decay["params"]) == 8 * cfg.n_layer + 2
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8 and opt.defaults["fused"]
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == n_params
    opt = tg.build_optimizer(model, 0.1, 6e-4, "cpu", muon_lr=0.02, muon_momentum=0.9)
    names = {p: n for n, p in model.named_parameters()}  # the tied lm_head is transformer.wte.weight
    matrices = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    muon_names = sorted(names[p] for p in opt.muon.param_groups[0]["params"])
    assert muon_names == sorted(f"transformer.h.{i}.{m}.weight" for i in range(2) for m in matrices)
    decay, no_decay = opt.adamw.param_groups
    assert [names[p] for p in decay["params"]] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert all(p.dim() == 1 for p in no_decay["params"]) and len(no_decay["params"]) == 8 * cfg.n_layer + 2
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    muon = opt.muon.param_groups[0]
    assert [muon[k] for k in ("lr", "momentum", "nesterov", "weight_decay", "ns_steps")] == [0.02, 0.9, True, 0.0, 5]
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == n_params
    tg.set_lr(opt, 3e-4)  # half of --max-lr: Muon's LR follows the schedule
    assert [g["lr"] for g in opt.param_groups] == [3e-4, 3e-4, 0.01]


def test_a_min_lr_of_zero_is_kept_not_the_default():
    """(The cosine's phases: test_schedules.)"""
    assert tg.get_lr(500, tg.RunConfig(max_lr=1e-3, min_lr=0.0, warmup_steps=1, max_steps=10)) == 0.0


# --- data ---------------------------------------------------------------------------------
def test_plain_rows_use_every_token(tmp_path):
    tokens = np.arange(100, dtype=np.uint16)
    np.save(tmp_path / "t_train_000000.npy", tokens)
    rows = tg.TokenRows(str(tmp_path), "train", T=9)
    assert rows.rows_per_epoch == (100 - 1) // 9 == 11
    x, y = rows.batch(10, 1)  # the last row ends on the shard's last token
    assert x[0].tolist() == list(range(90, 99)) and y[0].tolist() == list(range(91, 100))
    x, y = rows.batch(11, 1)  # wraps into epoch 1, row 0
    assert x[0].tolist() == list(range(0, 9))


def test_aligned_rows_hold_whole_documents_and_lose_no_token():
    lengths = [5, 3, 20, 7, 2, 9, 4]  # one document (20) longer than a row
    tokens = np.concatenate([np.r_[EOT, np.arange(1, n) + 100 * i] for i, n in enumerate(lengths)]).astype(np.uint16)
    T = 8
    table = tg.aligned_rows(tokens, T)
    starts = set(np.flatnonzero(tokens == EOT))
    targets = []
    for start, n in table:
        assert 1 <= n <= T
        targets.extend(range(start + 1, start + n + 1))
    assert targets == list(range(1, len(tokens)))  # every token after the first is a target once
    for (start, n), (next_start, _) in zip(table, table[1:]):
        assert next_start == start + n  # rows chain: the last target opens the next row
        assert start + n in starts or n == T  # a row stops at a document boundary unless the document fills it
    assert table.tolist() == [[0, 8], [8, 8], [16, 8], [24, 4], [28, 7], [35, 2], [37, 8], [45, 4]]


def test_aligned_batch_pads_with_ignored_targets(tmp_path):
    docs = [np.r_[EOT, [1, 2]], np.r_[EOT, [3, 4, 5]], np.r_[EOT, [6, 7, 8, 9, 10, 11]]]
    np.save(tmp_path / "t_train_000000.npy", np.concatenate(docs).astype(np.uint16))
    rows = tg.TokenRows(str(tmp_path), "train", T=8, align_docs=True)
    x, y = rows.batch(0, 2)
    assert x.tolist() == [[EOT, 1, 2, EOT, 3, 4, 5, EOT], [EOT, 6, 7, 8, 9, 10, EOT, EOT]]
    assert y.tolist() == [[1, 2, EOT, 3, 4, 5, EOT, -1], [6, 7, 8, 9, 10, 11, -1, -1]]
    assert rows.count_targets(0, 2) == 7 + 6


@pytest.mark.parametrize("align_docs,shuffle", [(False, False), (True, False), (False, True), (True, True)])
def test_every_split_reads_the_same_rows_each_step(data_dir, align_docs, shuffle):
    rows = tg.TokenRows(data_dir, "train", T=16, align_docs=align_docs, shuffle=shuffle, seed=7)
    splits = [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 2, 4), (4, 1, 2)]  # B, accumulation, world: 8 rows
    for step in (0, 1, 5, rows.rows_per_epoch // 8 + 1):  # the last one is in the second epoch
        seen = []
        for B, accum, W in splits:  # the step's rows over every rank and micro-step, sorted
            batches = [tg.StepLoader(rows, B, accum, r, W).micro_batch(step, m) for r in range(W) for m in range(accum)]
            seen.append(sorted(tuple(row) + tuple(t) for x, y in batches for row, t in zip(x.tolist(), y.tolist())))
        assert all(s == seen[0] for s in seen[1:])
        n = tg.StepLoader(rows, 8, 1, 0, 1).step_tokens(step)
        assert n == sum(sum(t != -1 for t in r[16:]) for r in seen[0])


def test_shuffle_permutes_rows_and_epochs_differ(data_dir):
    plain = tg.TokenRows(data_dir, "train", T=16)
    shuffled = tg.TokenRows(data_dir, "train", T=16, shuffle=True, seed=7)
    n = plain.rows_per_epoch
    order = lambda r, epoch: [r.locate(epoch * n + g) for g in range(n)]
    assert sorted(order(shuffled, 0)) == order(plain, 0)  # a permutation of the same rows
    assert order(shuffled, 0) != order(plain, 0)
    assert order(shuffled, 1) != order(shuffled, 0)
    again = tg.TokenRows(data_dir, "train", T=16, shuffle=True, seed=7)
    assert order(again, 1) == order(shuffled, 1)  # seeded: reproducible


def test_a_truncated_or_foreign_llmc_bin_shard_is_refused(tmp_path):
    """(A .bin reads as its .npy: test_train_cli's test_trains_identically_from_fineweb_npy_and_llmc_bin_shards.)"""
    tokens, header = np.arange(1000, dtype=np.uint16), np.zeros(256, dtype=np.int32)
    for magic, n, refused in [(20240520, 10, "truncated or corrupt"), (123, 1000, "HINT: are you passing the right")]:
        header[:3] = [magic, 1, len(tokens)]  # llm.c's magic, version, token count
        (tmp_path / "x_val_000000.bin").write_bytes(header.tobytes() + tokens[:n].tobytes())
        with pytest.raises(cli.UserError, match=refused):
            open_shard(str(tmp_path / "x_val_000000.bin"))


def test_chunked_loss_under_bf16_autocast_matches_its_bf16_logits():
    """fp32 chunks share one logits buffer; under autocast the matmul returns bf16 logits, which
    each chunk copies to fp32 instead: the loss of those logits, the last chunk shorter (50 = 2 x 20 + 10)."""
    torch.manual_seed(0)
    h, weight = torch.randn(50, 16), torch.randn(300, 16)
    targets = torch.randint(0, 290, (50,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grad_h, grad_w = chunked_loss_and_grads(h, weight, targets, 1.0, 20, 290, want_grad=True)
        logits = (h @ weight.t()).float()[:, :290]
    assert grad_h.dtype == torch.float32 and grad_w.shape == (300, 16)
    assert loss.item() == pytest.approx(F.cross_entropy(logits, targets, reduction="sum").item(), rel=1e-5)


@pytest.mark.parametrize("loss_chunk,reduction", [(0, "sum"), (20, "sum"), (20, "mean")])
def test_padded_ids_take_no_probability_and_get_no_gradient(loss_chunk, reduction):
    """Both losses (full logits, chunks of 20: one of 12 last) multiply by all 50304 rows of lm_head, the softmax over
    GPT-2's 50257 ids only: a real-vocabulary softmax's loss and gradients, 0 for the 47 padded rows of wte / lm_head."""
    torch.manual_seed(0)
    model = tg.GPT(tg.GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=16))  # vocab 50304
    with torch.no_grad():  # padded logits far above the real ones: any probability they kept would show
        model.lm_head.weight[50257:] = 3 * torch.randn(47, 8)
    x, y = torch.randint(0, 50257, (2, 3, 16))
    y[1, 5:] = -1

    def real_vocabulary_loss(reduction="sum"):
        logits = model.hidden_states(x) @ model.lm_head.weight[:50257].t()
        return F.cross_entropy(logits.view(-1, 50257), y.view(-1), ignore_index=-1, reduction=reduction)

    # an incoming gradient other than 1 (0.37) must be applied too
    ref_loss, ref = loss_and_grads(model, lambda: real_vocabulary_loss(reduction), 0.37)
    loss, grads = loss_and_grads(model, lambda: model(x, y, reduction=reduction, loss_chunk=loss_chunk)[1], 0.37)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for k in ref:  # fp32 rounding: the chunked softmax's gradient reaches 1.2e-5 of the largest, as before padding
        torch.testing.assert_close(grads[k], ref[k], atol=2e-5 * ref[k].abs().max().item(), rtol=1e-5, msg=k)
    assert torch.equal(grads["transformer.wte.weight"][50257:], torch.zeros(47, 8))
    with torch.no_grad():  # evaluation: each target's loss; the default mean is over the targets not -1
        _, token_losses = model(x, y, reduction="none", loss_chunk=loss_chunk)
        torch.testing.assert_close(token_losses, real_vocabulary_loss("none"), rtol=1e-5, atol=1e-6)
        logits, mean = model(x, y, loss_chunk=loss_chunk)
    assert mean.item() == pytest.approx(real_vocabulary_loss("mean").item(), rel=1e-6)
    assert (logits is None) == bool(loss_chunk)  # chunked: no logits tensor is returned


@pytest.mark.parametrize("loss_chunk", [0, 3])
def test_validation_loss_and_bits_per_byte_of_a_uniform_model(tmp_path, loss_chunk):
    """Logits all equal; bits per byte counts the targets with text only (not <|endoftext|>) over their UTF-8 bytes."""
    from trainkit.data import tokenizer

    # <|endoftext|> "Hello" " world" "!" <|endoftext|> " café" " au" " l" "ait": 2 rows of 4 tokens
    np.save(tmp_path / "t_val_000000.npy", np.array([EOT, 15496, 995, 0, EOT, 40304, 35851, 300, 4548], np.uint16))
    rows = tg.TokenRows(str(tmp_path), "val", 4)
    model = tg.GPT(tg.GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=4))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    logged = tg.evaluate_loss(model, rows, 2, 1, Dist(), torch.float32, tokenizer.token_byte_lengths(50304), loss_chunk)
    # every target costs ln(50257), not ln(50304); 7 text targets (the 8th is <|endoftext|>) of
    # 5 + 6 + 1 + 6 + 3 + 2 + 3 = 26 bytes (é is 2)
    assert logged == pytest.approx(dict(val_loss=math.log(50257), val_bpb=7 * math.log2(50257) / 26), rel=1e-7)
    (tmp_path / "small").mkdir()  # a model with fewer ids than GPT-2's reads no GPT-2 text: no bits per byte
    np.save(tmp_path / "small" / "t_val_000000.npy", np.arange(9, dtype=np.uint16))
    small = tg.GPT(tg.GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=4, vocab_size=64))
    rows = tg.TokenRows(str(tmp_path / "small"), "val", 4)
    logged = tg.evaluate_loss(small, rows, 2, 1, Dist(), torch.float32, tokenizer.token_byte_lengths(64), loss_chunk)
    assert set(logged) == {"val_loss"}
