"""Token-normalized gradient accumulation equals one big batch, for every split (micro-batches on one process,
DDP on 2 gloo ranks of conftest's shared_rank_runs launch, with and without --doc-mask), and so does the update
each optimizer makes of it (AdamW, and Muon with AdamW)."""

import copy
import os

import pytest
import torch
import torch.nn as nn

from shards import EOT, fresh_model, gloo_rank_of_one_batch, grads_of, make_batch, rank_batches, reference_grads
from trainkit.runtime.launch import all_reduce_sum
from train_gpt2 import accumulate_gradients, build_optimizer

# Two fp32 computations of one gradient element differ by their summation order: an element sums at most
# 8 rows x 16 tokens = 128 products, whose recursive sum is off by at most 127 roundings, 127 * 2^-24 = 7.6e-6
# of the products' absolute sum (Higham, Accuracy and Stability, 4.2). The products' absolute sum is the
# element's size where they share a sign (RTOL, rounded up) and, where they cancel, at most the largest
# gradient's order, 1e-1 for these models: ATOL = 7.6e-6 * 1e-1, rounded up.
RTOL, ATOL = 1e-5, 1e-6
U = 2.0**-24  # fp32's unit roundoff
LR, WEIGHT_DECAY, EPS = 1e-2, 0.1, 1e-8  # the update of the comparison: AdamW's LR, decay and eps
MUON = dict(muon_lr=0.02, muon_momentum=0.95)


def assert_same_grads(a, b):
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=ATOL, rtol=RTOL, msg=k)


OPTIMIZERS = {"adamw": {}, "muon": MUON}  # build_optimizer's extra arguments for each


def stepped_weights(model, grads=None, extra=None) -> dict:
    """{name: weight} after one step of build_optimizer(**extra) on a copy of model from grads (None: its .grad)."""
    copied = copy.deepcopy(model)  # (a Parameter's deepcopy leaves its .grad behind)
    for (name, p), original in zip(copied.named_parameters(), model.parameters()):
        p.grad = (original.grad if grads is None else grads[name]).clone()
    build_optimizer(copied, WEIGHT_DECAY, LR, "cpu", **(extra or {})).step()
    return {n: p.detach().clone() for n, p in copied.named_parameters()}


def adamw_bound(g, g_ref, w):
    """How far apart AdamW's first step may put one weight w from the gradients g and g_ref, elementwise.
    That step moves w by LR * g / (|g| + EPS) (its moments hold g and g^2 alone, bias-corrected), whose
    derivative EPS / (|g| + EPS)^2 falls with |g|: between g and g_ref it is at most that at the smaller |g|,
    or 1 / EPS where the two differ in sign (mean value theorem). A gradient near EPS thus turns fp32's
    last-bit differences into 1e-6-scale updates. Each side also rounds: ~10 roundings in the update
    (moments, bias corrections, sqrt, eps, the division, LR), 3 in the weight (the decay, the step)."""
    smaller = torch.minimum(g.abs(), g_ref.abs())
    slope = torch.where(g.sign() == g_ref.sign(), EPS / (smaller + EPS) ** 2, torch.full_like(g, 1 / EPS))
    return LR * slope * (g - g_ref).abs() + 2 * (10 * U * LR + 3 * U * (w.abs() + LR))


def muon_input(g, momentum=MUON["muon_momentum"]):
    """What torch.optim.Muon's first Nesterov step orthogonalizes in bfloat16 (its buffer: zeros.lerp(g, 1 - m))."""
    return g.lerp(torch.zeros_like(g).lerp(g, 1 - momentum), momentum).bfloat16()


def assert_same_updates(model, ref_grads):
    """One step of each optimizer from model's gradients puts the weights where the same step from ref_grads
    (the one-batch gradients) puts them. AdamW: within adamw_bound of the gradients' measured difference.
    Muon orthogonalizes in bfloat16, where gradients 1e-11 apart in fp32 round to another value wherever a
    rounding boundary lies between them, and its Newton-Schulz steps spread that across the matrix: those
    roundings are put on ref_grads' side too (after checking that they differ by no more than the gradients
    may), and then the step must give the same weights, bit for bit. The naive mean of micro-batch means
    moves the weights 2e-2 away."""
    grads, start = grads_of(model), {n: p.detach() for n, p in model.named_parameters()}
    matrices = {n for n, p in model.transformer.h.named_parameters(prefix="transformer.h") if p.dim() == 2}
    for name, extra in OPTIMIZERS.items():
        muon = matrices if extra else set()
        aligned = dict(ref_grads)
        for k in muon:
            flipped = muon_input(grads[k]) != muon_input(ref_grads[k])
            torch.testing.assert_close(grads[k][flipped], ref_grads[k][flipped], atol=ATOL, rtol=RTOL, msg=k)
            aligned[k] = torch.where(flipped, grads[k], ref_grads[k])
        stepped, ref_stepped = stepped_weights(model, extra=extra), stepped_weights(model, aligned, extra)
        for k in start:
            if k in muon:
                assert torch.equal(stepped[k], ref_stepped[k]), (name, k)
            else:
                apart, bound = (stepped[k] - ref_stepped[k]).abs(), adamw_bound(grads[k], ref_grads[k], start[k])
                assert (apart <= bound).all(), (name, k, (apart - bound).max().item())
        moved = max((stepped[k] - start[k]).abs().max().item() for k in start)
        assert moved > 5e-3, name  # the step moved the weights: the comparison is not vacuous


# --- 1. a tiny GPT with ignored targets: every split gives the same gradient ------------------


def batch(doc_mask=False):
    """make_batch()'s rows; for --doc-mask with <|endoftext|> in every fifth place or so: several documents a row."""
    x, y = make_batch()
    if doc_mask:
        x[x % 5 == 0] = EOT
    return x, y


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
    if B == 8:  # one micro-step: bit-identical, no scaling op was added
        assert all(torch.equal(g, ref[k]) for k, g in grads_of(model).items())
    assert loss_sum.item() / n_tokens == pytest.approx(ref_loss, rel=1e-6)
    assert_same_updates(model, ref)
    if (B, doc_mask) == (2, False):  # the naive mean of micro-batch means is wrong with ignored targets
        naive = fresh_model()
        for xb, yb in split_rows(x, y, B):
            (naive(torch.from_numpy(xb), torch.from_numpy(yb))[1] / 4).backward()
        assert max((g - ref[k]).abs().max().item() for k, g in grads_of(naive).items()) > 1e-4


# --- 2. DDP, 2 gloo ranks x 2 accumulation steps == one batch ----------------------------------


def rank_cases(folder, data_dir):
    """main on each rank of conftest's shared_rank_runs launch."""
    return [dict(script="test_accumulation", argv=[[folder / "ddp.pt"]] * 2)]


def main(argv):
    """On each rank of a 2-rank launch: DDP's gradients, loss and stepped weights, saved to argv[0].RANK."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {}
    with gloo_rank_of_one_batch(rank, world, os.environ["MASTER_PORT"]) as (_, n_tokens):
        for doc_mask in (False, True):  # one process group for both
            batches = rank_batches(*batch(doc_mask), rank, world, B=2, accum=2)
            model = nn.parallel.DistributedDataParallel(fresh_model(doc_mask))
            loss_sum = accumulate_gradients(model, batches, n_tokens, world, "cpu", torch.float32, doc_mask=doc_mask)
            results[doc_mask] = dict(
                grads=grads_of(model.module),
                loss=all_reduce_sum(loss_sum).item() / n_tokens,
                stepped={name: stepped_weights(model.module, extra=extra) for name, extra in OPTIMIZERS.items()},
            )
    torch.save(results, f"{argv[0]}.{rank}")
    return 0


def test_ddp_two_ranks_two_micro_steps_match_one_batch(shared_rank_runs):
    folder = shared_rank_runs[__name__][0]
    results, other_rank = (torch.load(folder / f"ddp.pt.{rank}", weights_only=True) for rank in (0, 1))
    for doc_mask in (False, True):
        x, y = batch(doc_mask)
        result = results[doc_mask]
        ref, ref_loss = reference_grads(x, y, doc_mask)
        assert_same_grads(ref, result["grads"])
        assert result["loss"] == pytest.approx(ref_loss, rel=1e-6)
        model = fresh_model(doc_mask)  # the replicas' weights before the step, with their gradients
        for name, p in model.named_parameters():
            p.grad = result["grads"][name]
        assert_same_updates(model, ref)
        for name in OPTIMIZERS:  # the replicas stay identical, bit for bit
            assert all(
                torch.equal(result["stepped"][name][k], other_rank[doc_mask]["stepped"][name][k]) for k in ref
            ), (doc_mask, name)
