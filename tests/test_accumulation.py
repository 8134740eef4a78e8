"""Token-normalized gradient accumulation equals one big batch, for every split (micro-batches on one process,
DDP across gloo processes, with and without --doc-mask), and so does the update each optimizer makes of it
(AdamW, and Muon with AdamW)."""

import copy

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

from conftest import free_port
from shards import EOT, fresh_model, gloo_rank_of_one_batch, grads_of, make_batch, rank_batches, reference_grads
from trainkit.launch import all_reduce_sum
from train_gpt2 import accumulate_gradients, build_optimizer


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_same_grads(a, b, atol=1e-6, rtol=1e-5):
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=k)


OPTIMIZERS = {"adamw": {}, "muon": dict(muon_lr=0.02)}  # build_optimizer's extra arguments for each


def weights_after_one_step(model) -> dict:
    """{optimizer name: the weights after one step of it on model's .grad} (model stays as it is)."""
    stepped = {}
    for name, extra in OPTIMIZERS.items():
        copied = copy.deepcopy(model)  # (a Parameter's deepcopy leaves its .grad behind)
        for p, original in zip(copied.parameters(), model.parameters()):
            p.grad = original.grad.clone()
        build_optimizer(copied, 0.1, 1e-2, "cpu", **extra).step()
        stepped[name] = {n: p.detach().clone() for n, p in copied.named_parameters()}
    return stepped


def assert_same_updates(stepped, ref_stepped, start, doc_mask):
    """The same weights after the step: measured at most 8.2e-8 apart for either optimizer (Muon
    orthogonalizes in bfloat16, where a gradient that differs in fp32's last bits may round to another
    value), and 1.2e-6 with --doc-mask's batch, where one LayerNorm bias gradient is 2.1e-8, near
    AdamW's eps of 1e-8: its first update lr * g / (|g| + eps) turns the 1.1e-11 by which fp32 sums
    differ into 1.2e-6. The naive mean of micro-batch means moves the weights 2e-2 away."""
    for name in OPTIMIZERS:
        assert_same_grads(ref_stepped[name], stepped[name], atol=2e-6 if doc_mask else 1e-6, rtol=0)
        moved = max((stepped[name][k] - start[k]).abs().max().item() for k in start)
        assert moved > 5e-3, name  # the step moved the weights: the comparison is not vacuous


# --- 1. the toy from the accumulation lesson -------------------------------------------------


def test_toy_mlp_accumulation_matches_one_batch():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    x, y = torch.randn(4, 16), torch.randn(4, 1)

    def grad(fn):
        net.zero_grad()
        fn()
        return {n: p.grad.clone() for n, p in net.named_parameters()}

    one_batch = grad(lambda: nn.functional.mse_loss(net(x), y).backward())
    normalized = grad(
        lambda: [(nn.functional.mse_loss(net(x[i : i + 1]), y[i : i + 1]) / 4).backward() for i in range(4)]
    )
    unnormalized = grad(lambda: [nn.functional.mse_loss(net(x[i : i + 1]), y[i : i + 1]).backward() for i in range(4)])
    assert_same_grads(one_batch, normalized)
    # without the 1/4 the accumulated gradient is 4x too large
    assert_same_grads({k: 4 * v for k, v in one_batch.items()}, unnormalized)
    assert max_diff(one_batch, unnormalized) > 1e-3


# --- 2. a tiny GPT with ignored targets: every split gives the same gradient ------------------


def batch(doc_mask=False):
    """make_batch()'s rows; for --doc-mask with an <|endoftext|> input in every fifth place or so,
    so that each row holds several documents."""
    x, y = make_batch()
    if doc_mask:
        x[x % 5 == 0] = EOT
    return x, y


def weights_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_steps(x, y, doc_mask=False):
    """weights_after_one_step of the one-batch model (reference_grads')."""
    model = fresh_model(doc_mask)
    model(x, y, doc_mask=doc_mask)[1].backward()
    return weights_after_one_step(model)


def split_rows(x, y, B):
    return [(x[i : i + B].numpy(), y[i : i + B].numpy()) for i in range(0, len(x), B)]


@pytest.mark.parametrize("doc_mask", [False, True], ids=["plain", "doc-mask"])
@pytest.mark.parametrize("B", [8, 4, 2, 1])
def test_tiny_gpt_accumulation_matches_one_batch(B, doc_mask):
    x, y = batch(doc_mask)
    n_tokens = int((y != -1).sum())
    assert len({int((y[r] != -1).sum()) for r in range(8)}) == 8  # the counts really differ
    ref, ref_loss = reference_grads(x, y, doc_mask)
    model = fresh_model(doc_mask)
    loss_sum = accumulate_gradients(model, split_rows(x, y, B), n_tokens, 1, "cpu", torch.float32, doc_mask=doc_mask)
    assert_same_grads(ref, grads_of(model))
    assert loss_sum.item() / n_tokens == pytest.approx(ref_loss, rel=1e-6)
    assert_same_updates(
        weights_after_one_step(model), reference_steps(x, y, doc_mask), weights_of(fresh_model(doc_mask)), doc_mask
    )


def test_single_micro_step_is_exactly_the_plain_mean_loss():
    x, y = make_batch()
    ref, _ = reference_grads(x, y)
    model = fresh_model()
    accumulate_gradients(model, split_rows(x, y, 8), int((y != -1).sum()), 1, "cpu", torch.float32)
    for k, g in grads_of(model).items():
        assert torch.equal(g, ref[k]), k  # bit-identical: no scaling op was added


def test_naive_mean_over_steps_is_wrong_with_ignored_targets():
    x, y = make_batch()
    ref, _ = reference_grads(x, y)
    model = fresh_model()
    for xb, yb in split_rows(x, y, 2):  # the reference loop: mean per micro-batch / steps
        _, loss = model(torch.from_numpy(xb), torch.from_numpy(yb))
        (loss / 4).backward()
    assert max_diff(ref, grads_of(model)) > 1e-4


# --- 3. DDP, 2 gloo processes x 2 accumulation steps == one batch -----------------------------


def ddp_worker(rank, world, port, out_path):
    results = {}
    with gloo_rank_of_one_batch(rank, world, port) as (_, n_tokens):
        for doc_mask in (False, True):  # one process group for both: each spawn costs seconds
            batches = rank_batches(*batch(doc_mask), rank, world, B=2, accum=2)
            model = nn.parallel.DistributedDataParallel(fresh_model(doc_mask))
            loss_sum = accumulate_gradients(model, batches, n_tokens, world, "cpu", torch.float32, doc_mask=doc_mask)
            results[doc_mask] = dict(
                grads=grads_of(model.module),
                loss=all_reduce_sum(loss_sum).item() / n_tokens,
                stepped=weights_after_one_step(model.module),
            )
    torch.save(results, f"{out_path}.{rank}")


def test_ddp_two_ranks_two_micro_steps_match_one_batch(tmp_path):
    out = tmp_path / "ddp.pt"
    mp.spawn(ddp_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    results, other_rank = (torch.load(f"{out}.{rank}", weights_only=True) for rank in (0, 1))
    for doc_mask in (False, True):
        x, y = batch(doc_mask)
        result = results[doc_mask]
        ref, ref_loss = reference_grads(x, y, doc_mask)
        assert_same_grads(ref, result["grads"])
        assert result["loss"] == pytest.approx(ref_loss, rel=1e-6)
        assert_same_updates(
            result["stepped"], reference_steps(x, y, doc_mask), weights_of(fresh_model(doc_mask)), doc_mask
        )
        for name in OPTIMIZERS:  # the replicas stay identical, bit for bit
            assert all(
                torch.equal(result["stepped"][name][k], other_rank[doc_mask]["stepped"][name][k]) for k in ref
            ), (doc_mask, name)
