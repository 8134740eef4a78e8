"""--fsdp (FSDP2) on 2 ranks of conftest's shared_rank_runs launch: the exact token-normalized gradient with half the
state per rank, checkpoints any mode resumes, evaluation that matches one process (every split's loss under --fsdp:
test_train_cli; SIGTERM: test_resilience)."""

import os
import re

import numpy as np
import pytest
import torch
import torch.nn as nn

from trainkit.runfiles import checkpoints
from trainkit import cli
from trainkit.runtime import device, launch
from trainkit.runfiles.run_folder import OutDirLock
import train_gpt2 as tg
from conftest import HELLASWAG_FILE, assert_refused, log_records, resume_copy, run_main, tiny_run_args
from shards import fresh_model, gloo_rank_of_one_batch, make_batch, reference_grads

SHARDS = dict(n_docs=500, seed=3)


def run_args(data_dir, out_dir, *extra, B=2, val_steps=1):
    """A tiny model with GPT-2's vocabulary (for HellaSwag and samples), 20 steps, evaluated every 10."""
    evals = ["--val-steps", str(val_steps), "--hellaswag-limit", "4", "--hellaswag-file", str(HELLASWAG_FILE)]
    return tiny_run_args(data_dir, out_dir, *evals, *extra, B=B, val_every=10, sample_every=10, hellaswag_every=10)


def rank_cases(folder, data_dir):
    """The step of every mode (main), FSDP's run, and one resuming its checkpoint 10 and later log (resume_copy's)."""
    fsdp, resumed = folder / "fsdp", folder / "fsdp2"
    return [
        dict(script="test_fsdp", argv=[[folder / "step.pt"]] * 2),
        dict(script="train_gpt2", argv=[["--fsdp", *run_args(data_dir, fsdp)]] * 2),
        dict(
            script="train_gpt2",
            argv=[["--fsdp", *run_args(data_dir, resumed, "--resume")]] * 2,
            copy=[(fsdp / name, resumed / name) for name in ("ckpt_0000010.pt", "log.jsonl")],
        ),
    ]


# --- the gradient of a step and what one rank holds, in a 2-process gloo group ---------------


def failing_backend(graph, example_inputs):
    raise RuntimeError("no compiler here")


def fsdp_after_failed_compile(d, batches, n_tokens, world):
    """An FSDP model whose compiled blocks failed in the first step, back to eager as the trainer does."""
    model = device.shard_model(
        fresh_model(), d, torch.float32, lambda block: torch.compile(block, backend=failing_backend)
    )
    with pytest.raises(Exception, match="no compiler here"):
        tg.accumulate_gradients(model, batches, n_tokens, world, "cpu", torch.float32)
    model.zero_grad(set_to_none=True)
    device.uncompile_blocks(model)
    return model


def ddp_with_compiled_blocks(events: list):
    """DDP around compile_model's GPT with one-parameter buckets; events gets, in order, "all-reduce"
    when a bucket's all-reduce starts and "block i" when a gradient of block i lands."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = fresh_model()
    ddp = nn.parallel.DistributedDataParallel(tg.compile_model(model, backend="aot_eager"), bucket_cap_mb=1e-6)
    ddp.register_comm_hook(
        None, lambda state, bucket: events.append("all-reduce") or default_hooks.allreduce_hook(state, bucket)
    )
    for i, block in enumerate(model.transformer.h):
        for p in block.parameters():
            p.register_post_accumulate_grad_hook(lambda p, i=i: events.append(f"block {i}"))
    ddp(*make_batch())[1].backward()  # DDP's first synced backward reduces one bucket, then rebuilds them
    model.zero_grad(set_to_none=True)
    events.clear()
    return ddp


def main(argv):
    """On each rank of a 2-rank launch: one step of every mode; rank 0 saves the results to argv[0]."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with gloo_rank_of_one_batch(rank, world, os.environ["MASTER_PORT"]) as (batches, n_tokens):
        d = launch.Dist(rank=rank, world_size=world, device="cpu")
        results, events = {}, []
        models = dict(
            ddp=lambda: nn.parallel.DistributedDataParallel(fresh_model()),
            ddp_compiled=lambda: ddp_with_compiled_blocks(events),
            fsdp=lambda: device.shard_model(fresh_model(), d, torch.float32),
            fsdp_compiled=lambda: device.shard_model(
                fresh_model(), d, torch.float32, lambda block: torch.compile(block, backend="eager")
            ),
            fsdp_eager_again=lambda: fsdp_after_failed_compile(d, batches, n_tokens, world),
        )
        for mode, make_model in models.items():
            model = make_model()
            bare = checkpoints.unwrap_model(model)
            optimizer = tg.build_optimizer(bare, 0.1, 1e-3, "cpu")
            loss_sum = tg.accumulate_gradients(model, batches, n_tokens, world, "cpu", torch.float32)
            norm = tg.clip_gradients(bare, 0.0, optimizer)  # the norm, unclipped
            grads = {
                n.replace("._orig_mod", ""): p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                for n, p in bare.named_parameters()
            }  # names without compile's wrapper
            optimizer.step()
            state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
            held = dict(params=list(bare.parameters()), grads=[p.grad for p in bare.parameters()], optimizer=state)
            results[mode] = dict(
                grads=grads,
                norm=norm,
                loss=launch.all_reduce_sum(loss_sum).item() / n_tokens,
                bytes={kind: sum(device.local_part(t).nbytes for t in tensors) for kind, tensors in held.items()},
                state_keys=list(checkpoints.full_state(model, optimizer)[0]),
            )
        results["ddp_compiled"]["events"] = events
        if rank == 0:
            torch.save(results, argv[0])
    return 0


def test_fsdp_step_gradient_is_the_one_batch_gradient_and_a_rank_holds_half(shared_rank_runs):
    """Every mode of main (2 ranks x 2 micro-steps) against the gradient of one batch of the same 8 rows."""
    results = torch.load(shared_rank_runs[__name__][0] / "step.pt", weights_only=True)
    ref, ref_loss = reference_grads(*make_batch())
    ref_norm = torch.nn.utils.get_total_norm(list(ref.values()))
    for mode in ("ddp", "ddp_compiled", "fsdp", "fsdp_compiled", "fsdp_eager_again"):
        assert sorted(results[mode]["state_keys"]) == sorted(fresh_model().state_dict())  # no _orig_mod.
        assert results[mode]["grads"].keys() == ref.keys()
        for name, grad in ref.items():
            torch.testing.assert_close(results[mode]["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=f"{mode} {name}")
        assert results[mode]["norm"].item() == pytest.approx(ref_norm.item(), rel=1e-6)
        assert results[mode]["loss"] == pytest.approx(ref_loss, rel=1e-6)
    # with compiled blocks DDP still overlaps: the backward runs block 1 then block 0, and block 1's
    # gradients start their all-reduce before block 0's land (none in the first micro-step: no_sync)
    events = results["ddp_compiled"]["events"]
    per_backward = sum(1 for _ in fresh_model().transformer.h.parameters())
    assert "all-reduce" not in events[:per_backward]
    last = events[per_backward:]
    assert "all-reduce" in last[last.index("block 1") : last.index("block 0")], last
    ddp, fsdp = results["ddp"]["bytes"], results["fsdp"]["bytes"]
    assert ddp["grads"] == ddp["params"] and ddp["optimizer"] >= 2 * ddp["params"]  # AdamW: 2 moments
    for kind in ddp:
        assert 0.45 < fsdp[kind] / ddp[kind] < 0.55, (kind, fsdp, ddp)


# --- through the command line ----------------------------------------------------------------


def test_fsdp_checkpoints_resume_in_any_mode_and_evaluation_matches_one_process(
    data_dir, tmp_path, capsys, shared_rank_runs
):
    folder, results = shared_rank_runs[__name__]
    log_of = lambda out_dir, key: [(r["step"], r[key]) for r in log_records(out_dir) if key in r]
    ckpt = lambda out_dir, step: checkpoints.load_checkpoint(os.path.join(out_dir, f"ckpt_{step:07d}.pt"))
    fsdp_out, resumed_out = (ranks[0].stdout for ranks in results[1:])  # rank 0's, the one that prints
    single, fsdp, fsdp_resumed, single_resumed = tmp_path / "single", folder / "fsdp", folder / "fsdp2", tmp_path / "s2"
    # 4 val rows either way: 2 rows x 2 batches on one process, 2 rows x 1 batch x 2 ranks
    assert tg.main(run_args(data_dir, single, val_steps=2)) == 0
    single_out = capsys.readouterr().out
    assert "world 2 | fsdp" in fsdp_out and "world 2 | fsdp" in resumed_out
    # every rank took part in evaluation: the same numbers and texts as one process
    for key in ("loss", "val_loss", "hellaswag_acc"):
        (steps_a, a), (steps_b, b) = zip(*log_of(single, key)), zip(*log_of(fsdp, key))
        assert steps_a == steps_b
        np.testing.assert_allclose(b, a, rtol=2e-5, err_msg=key)
    assert [s for s, _ in log_of(fsdp, "val_loss")] == [0, 10, 20]
    samples = [re.findall(r"^sample: .*$", out, flags=re.M) for out in (fsdp_out, single_out)]
    assert len(samples[0]) == 8 and samples[0] == samples[1]

    # the checkpoint is the one a single process writes: full, unprefixed, numbered optimizer state
    a, b = ckpt(fsdp, 10), ckpt(single, 10)
    assert a["model"].keys() == b["model"].keys()
    for key, value in a["model"].items():
        torch.testing.assert_close(value, b["model"][key], atol=1e-4, rtol=1e-3, msg=key)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    a, b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert a.keys() == b.keys()
    for index, state in a.items():
        assert {k: (v.shape, v.dtype, v.device) for k, v in state.items()} == {
            k: (v.shape, v.dtype, v.device) for k, v in b[index].items()
        }

    # FSDP resumes its own checkpoint exactly; one process continues it with the same losses
    resume_copy(fsdp, single_resumed, 10)
    assert log_of(fsdp_resumed, "loss") == log_of(fsdp, "loss")
    a, b = ckpt(fsdp, 20)["model"], ckpt(fsdp_resumed, 20)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert tg.main(run_args(data_dir, single_resumed, "--resume", B=4)) == 0
    (steps_a, a), (steps_b, b) = zip(*log_of(fsdp, "loss")), zip(*log_of(single_resumed, "loss"))
    assert steps_a == steps_b == tuple(range(20))
    np.testing.assert_allclose(b, a, rtol=2e-5)


def test_fsdp_without_torchrun_or_with_float16_is_refused_before_any_work(data_dir, tmp_path):
    """float16: each rank's GradScaler would see only its own shard's overflows (checked before any process group)."""
    args = ["--data-dir", data_dir, "--out-dir", str(tmp_path), "--model", "cpu", "--fsdp"]
    assert_refused(
        run_main("train_gpt2.py", *args),
        "--fsdp shards the model over the processes of a torchrun launch and needs at least 2; with one process drop "
        "--fsdp (it would hold the whole model anyway)",
    )
    flags = "--batch-size 4 --total-batch-size 2048 --dtype float16 --device cpu".split()
    run = tg.RunConfig(**vars(tg.build_parser().parse_args([*args, *flags])))
    with pytest.raises(cli.UserError, match="--fsdp does not support float16"):
        tg.resolve_launch(run, launch.Dist(rank=0, world_size=2), OutDirLock(str(tmp_path)))
    assert not os.listdir(tmp_path)
