"""The CUDA-side choices, tested on CPU: MFU per GPU, the peak table, one host sync per step, fp16 with a
GradScaler, the chunked loss in evaluation and under compile, the compile fallback, activation checkpointing,
device validation and benchmarks/gpu_check.py."""

import dataclasses
import json
import os
import re
import shlex
import sys
import types

import pytest
import torch

from trainkit.runfiles import checkpoints
from trainkit.runtime import device as precision, kernels, launch, throughput
import train_gpt2 as tg
from benchmarks import gpu_check
from conftest import assert_refused, losses, resume_copy, run_command, run_main, tiny_run_args, train_records
from shards import TINY, fresh_model, grads_of, loss_and_grads, make_batch, reference_grads

T = 16
SHARDS = dict(n_docs=400, seed=3, vocab=100)


def args_for(data_dir, out_dir, *extra, steps=4, B=4):
    return tiny_run_args(data_dir, out_dir, *extra, steps=steps, B=B, ckpt_every=0, seq_len=T, warmup=2)


# --- MFU and throughput ------------------------------------------------------------------------
def rank_cases(folder, data_dir):
    """2 gloo ranks x 2 micro-steps of 2 rows, fp16, with --peak-tflops."""
    args = args_for(data_dir, folder, "--peak-tflops", "0.001", "--dtype", "float16", B=2)
    return [dict(script="train_gpt2", argv=[args, args])]


def test_two_fp16_ranks_log_mfu_per_gpu_and_the_losses_of_one_batch(data_dir, tmp_path, shared_rank_runs):
    """rank_cases' run (through shared_rank_runs) against one process of 8-row micro-batches, which (on CPU,
    without --peak-tflops) logs no MFU."""
    out_dir, [ranks] = shared_rank_runs[__name__]
    stdout = ranks[0].stdout  # rank 0's, the one that prints
    n_params = tg.GPT(tg.GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=16)).num_params()
    flops_per_token = 6 * n_params + 12 * 2 * 16 * T
    tokens = 8 * T  # all ranks' tokens of one step
    records = train_records(out_dir)
    assert len(records) == 4
    for r in records:
        dt, logged = r["dt_ms"] / 1000, (r["mfu"], r["tok_per_s"], r["tok_per_s_per_gpu"])
        assert logged == pytest.approx(
            (flops_per_token * tokens / (dt * 2 * 1e9), tokens / dt, tokens / dt / 2), rel=1e-9
        )
    step_line = next(line for line in stdout.splitlines() if line.startswith("step     1/"))
    assert re.search(r"tok/s [\d,]+ \([\d,]+/rank\) \| mfu [\d.]+%", step_line), step_line
    # the summary's mean leaves out step 0 (compile / warm-up)
    summary = next(line for line in stdout.splitlines() if line.startswith("done:"))
    mean_dt = sum(r["dt_ms"] for r in records[1:]) / 3 / 1000
    shown = int(re.search(r"mean ([\d,]+) tok/s", summary).group(1).replace(",", ""))
    assert (shown, "over steps after the first" in summary) == (round(tokens / mean_dt), True)
    assert tg.main(args_for(data_dir, tmp_path, "--dtype", "float16", B=8)) == 0  # 8 rows x 1 micro-step
    assert not any("mfu" in r for r in train_records(tmp_path))
    one, ddp = [r["loss"] for r in train_records(tmp_path)], [r["loss"] for r in records]
    assert len(one) == 4 and ddp == pytest.approx(one, rel=2e-3)
    assert ddp != pytest.approx([one[0]] * 4, rel=2e-3)  # the losses move: the comparison is not vacuous


# (GPU name, its dense bf16 TFLOPS; "-": a name of no entry, not to be taken for the one it starts with)
PEAKS = """NVIDIA H100 80GB HBM3 989; NVIDIA H100 PCIe 756; NVIDIA H100 NVL 835; NVIDIA GH200 480GB 989;
NVIDIA H200 989; NVIDIA H200 NVL 835; NVIDIA B200 2250; NVIDIA A100-SXM4-80GB 312; NVIDIA A100-PCIE-40GB 312;
NVIDIA A10 125; NVIDIA A10G -; NVIDIA L4 121; NVIDIA L40S 362; NVIDIA L40 181; NVIDIA RTX A6000 154.8;
NVIDIA GeForce RTX 3090 71; NVIDIA GeForce RTX 3090 Ti -; NVIDIA GeForce RTX 4090 165.2;
NVIDIA GeForce RTX 4090 D -; NVIDIA GeForce RTX 5090 209.5; Tesla V100-SXM2-16GB 125; Tesla V100-PCIE-32GB 112;
Tesla V100S-PCIE-32GB 130; Tesla T4 65; NVIDIA GeForce GTX 1080 Ti -; Tesla P100-PCIE-16GB -"""


@pytest.mark.parametrize("name,tflops", [entry.strip().rsplit(" ", 1) for entry in PEAKS.split(";")])
def test_peak_table_matches_names_carefully(name, tflops):
    assert throughput.peak_flops(name) == (None if tflops == "-" else pytest.approx(float(tflops) * 1e12))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_one_host_sync_per_step(data_dir, tmp_path, monkeypatch, dtype):
    """Steps after the first (which creates AdamW's state) read the device once (loss, norm and stop
    flag together) and copy no Python value to the device."""
    counts, original_step = [[]], tg.Trainer.train_step  # the calls before a step, a step's, after it, ...

    def counting(name, original):
        def wrapper(*args, **kwargs):
            counts[-1].append(name)
            return original(*args, **kwargs)

        return wrapper

    for owner, names in [(torch.Tensor, ["item", "tolist"]), (torch, ["tensor"]), (torch.cuda, ["synchronize"])]:
        for name in names:
            monkeypatch.setattr(owner, name, counting(name, getattr(owner, name)))

    def train_step(self, step):
        counts.append([])
        try:
            return original_step(self, step)
        finally:
            counts.append([])

    monkeypatch.setattr(tg.Trainer, "train_step", train_step)
    assert tg.main(args_for(data_dir, tmp_path, "--grad-clip", "1.0", "--dtype", dtype, B=2)) == 0
    steps = counts[1::2]
    assert (len(steps), steps[1:]) == (4, [["tolist"]] * 3)


# --- fp16 with a GradScaler ---------------------------------------------------------------------
def fp16_grads(B, loss_chunk=0):
    """Unscaled gradients of the 8-row batch split into micro-batches of B rows, fp16 autocast + GradScaler."""
    model, scaler, (x, y) = fresh_model(), torch.amp.GradScaler("cpu"), make_batch()
    optimizer = tg.build_optimizer(model, 0.0, 1e-3, "cpu")
    batches, n_tokens = [(x[i : i + B], y[i : i + B]) for i in range(0, 8, B)], int((y != -1).sum())
    loss_sum = tg.accumulate_gradients(model, batches, n_tokens, 1, "cpu", torch.float16, loss_chunk, scaler)
    scaler.unscale_(optimizer)
    return grads_of(model), loss_sum.item() / n_tokens


def worst_relative_error(grads, ref):
    """max over parameters of |grad - ref| / |ref| (norms of the whole tensor)."""
    return max(((grads[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)


@pytest.mark.parametrize("B,loss_chunk", [(4, 0), (2, 0), (1, 0), (2, 10)])
def test_fp16_accumulation_equals_one_batch(B, loss_chunk):
    one, one_loss = fp16_grads(8)
    split, split_loss = fp16_grads(B, loss_chunk)
    ref, ref_loss = reference_grads(*make_batch())
    # fp16 keeps 11 bits (2^-11 = 4.9e-4): measured 3.5e-4 to 4.2e-4 from one fp16 batch, 1.4e-3 from fp32
    assert worst_relative_error(split, one) < 2e-3
    assert worst_relative_error(split, ref) < 5e-3
    assert split_loss == pytest.approx(one_loss, rel=2e-3) and one_loss == pytest.approx(ref_loss, rel=2e-3)


def test_fp16_without_token_normalization_would_be_caught():
    """The tolerance above is tight enough to see an accumulation mistake: the per-micro-batch mean / 4."""
    ref, _ = reference_grads(*make_batch())
    model, (x, y) = fresh_model(), make_batch()
    for i in range(0, 8, 2):
        with torch.autocast("cpu", dtype=torch.float16):
            _, loss = model(x[i : i + 2], y[i : i + 2])
        (loss / 4).backward()
    assert worst_relative_error(grads_of(model), ref) > 0.1  # measured 1.6


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fp16_overflow_is_skipped_and_a_resume_after_it_is_bit_exact(data_dir, tmp_path, monkeypatch, optimizer):
    """An inf in step 2's gradients (--skip-nonfinite 0): the step is skipped and logged, the scaler backs off
    once, the run goes on; a resume from its step-3 checkpoint trains what it trained, bit for bit."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    original, calls = tg.accumulate_gradients, []

    def overflowing(model, *args, **kwargs):  # step 2's gradients get an inf (its loss stays finite)
        loss = original(model, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        return loss

    monkeypatch.setattr(tg, "accumulate_gradients", overflowing)
    fp16 = ("--dtype", "float16", "--ckpt-every", "3", "--optimizer", optimizer)
    result = run_main("train_gpt2.py", *args_for(data_dir, straight, *fp16, steps=6))  # the flag, as users give it
    assert (result.returncode, "dtype float16" in result.stdout) == (0, True), result.stderr[-3000:]
    monkeypatch.undo()
    records = train_records(straight)
    assert [r.get("skipped") for r in records] == [None, None, "overflow", None, None, None]
    assert all(r["loss"] == r["loss"] for r in records)
    resume_copy(straight, resumed, 3)
    assert tg.main(args_for(data_dir, resumed, *fp16, "--resume", steps=6)) == 0
    assert losses(resumed) == losses(straight)
    a, b = (checkpoints.load_checkpoint(str(d / "ckpt_0000006.pt")) for d in (straight, resumed))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["scaler"] == b["scaler"] and a["scaler"]["scale"] == 2.0**16 * 0.5  # the scaler backed off once
    assert set(a["optimizer"]) == ({"adamw", "muon"} if optimizer == "muon" else {"state", "param_groups"})


def test_auto_dtype_is_fp16_below_ampere():
    picked = [precision.resolve_dtype("auto", "cuda", capability) for capability in [(7, 5), (7, 0), (8, 0), (9, 0)]]
    assert picked == [torch.float16] * 2 + [torch.bfloat16] * 2
    assert precision.resolve_dtype("auto", "cpu") == torch.float32


# --- the chunked loss in evaluation and under torch.compile ---------------------------------------
def test_chunked_loss_under_no_grad_does_no_gradient_work(monkeypatch):
    model, (x, y) = fresh_model().eval(), make_batch()
    with torch.no_grad():
        _, full = model(x, y, reduction="sum")
        monkeypatch.setattr(kernels.ChunkedLinearCrossEntropy, "forward", None)  # the gradient path would fail
        _, chunked = model(x, y, reduction="sum", loss_chunk=10)
    assert not chunked.requires_grad
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=0)
    calls = []
    fake = lambda *args, want_grad: calls.append(want_grad) or (torch.zeros(()), None, None)
    monkeypatch.setattr(kernels, "chunked_loss_and_grads", fake)
    with torch.no_grad():
        model(x, y, loss_chunk=10)
    assert calls == [False]
    with pytest.raises(TypeError):  # with grad enabled the loss goes through the patched-out forward
        model(x, y, loss_chunk=10)


def compiled_graphs(n_layer, loss_chunk):
    """Node counts of the FX graphs torch.compile traces for a forward + backward of the tiny GPT
    (compile_model: one block at a time), whose loss is eager's."""
    sizes = []

    def counting_backend(gm, example_inputs):
        sizes.append(sum(len(m.graph.nodes) for m in gm.modules() if hasattr(m, "graph")))  # with subgraphs
        return gm.forward

    eager_and_compiled = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(1)
        model = tg.GPT(dataclasses.replace(TINY, n_layer=n_layer))
        model = tg.compile_model(model, backend=counting_backend) if compiled else model
        _, loss = model(*make_batch(), reduction="sum", loss_chunk=loss_chunk)
        eager_and_compiled.append(loss.item())
    loss.backward()
    torch._dynamo.reset()
    assert eager_and_compiled[1] == pytest.approx(eager_and_compiled[0], rel=1e-6)
    return sizes


def test_compile_traces_one_block_for_every_block_and_keeps_the_chunk_loop_out():
    block_graph = compiled_graphs(2, 64)  # 2 chunks of the 128 rows
    assert len(block_graph) == 1  # the second block reuses the first one's code: no recompile
    assert compiled_graphs(4, 64) == block_graph  # nor a third and a fourth
    assert compiled_graphs(2, 4) == block_graph  # 32 chunks: the chunk loop is not in a graph
    with_full_loss = compiled_graphs(4, 0)  # full logits: lm_head + cross-entropy compiled after the blocks
    assert len(with_full_loss) == 2 and with_full_loss[0] == block_graph[0]


# --- compile that falls back, activation checkpointing, devices -----------------------------------
@pytest.mark.parametrize(
    "requested,device,capability,platform,triton,expected",
    [
        (None, "cuda", (8, 0), "linux", True, (True, None)),
        (None, "cuda", (7, 0), "linux", True, (True, None)),  # V100: Triton runs there
        (None, "cuda", (6, 1), "linux", True, (False, "compute capability 6.1 < 7.0, which Triton needs")),
        (True, "cuda", (6, 0), "linux", True, (False, "compute capability 6.0 < 7.0, which Triton needs")),
        (None, "cuda", (8, 6), "win32", False, (False, "Triton is not installed (pip install triton-windows)")),
        (None, "cuda", (9, 0), "linux", False, (False, "Triton is not installed (pip install triton)")),
        (False, "cuda", (9, 0), "linux", True, (False, None)),
        (None, "cpu", None, "linux", False, (False, None)),
        (True, "cpu", None, "linux", False, (True, None)),  # inductor's CPU backend needs no Triton
        (None, "mps", None, "darwin", False, (False, None)),
    ],
)
def test_compile_decision(requested, device, capability, platform, triton, expected):
    assert precision.compile_decision(requested, device, capability, platform, triton) == expected


def test_a_failing_compile_and_activation_checkpointing_train_as_eager_does(data_dir, tmp_path, monkeypatch, capsys):
    """A compile that fails falls back to eager, with one line; --activation-checkpointing (the flag as users
    give it, through run_main) recomputes the same activations: both log eager's losses; the same gradients."""

    def failing_backend(gm, example_inputs):
        raise RuntimeError("Cannot find a working triton installation\nmore detail")

    result = run_main("train_gpt2.py", *args_for(data_dir, tmp_path / "ckpt", "--activation-checkpointing", B=2))
    assert result.returncode == 0, result.stderr[-3000:]
    monkeypatch.setattr(tg, "compile_model", lambda model: torch.compile(model, backend=failing_backend))
    torch._dynamo.reset()
    assert tg.main(args_for(data_dir, tmp_path / "fallback", "--compile", B=2)) == 0
    out = capsys.readouterr().out
    assert out.count("compile failed, continuing without it") == 1
    assert "Cannot find a working triton installation" in out and "more detail" not in out
    assert tg.main(args_for(data_dir, tmp_path / "eager", "--no-compile", B=2)) == 0
    assert losses(tmp_path / "fallback") == losses(tmp_path / "ckpt") == losses(tmp_path / "eager")
    grads = []
    for checkpointing in (False, True):  # bit for bit
        model = fresh_model()
        model.activation_checkpointing = checkpointing
        grads.append(loss_and_grads(model, lambda: model(*make_batch())[1])[1])
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


@pytest.mark.parametrize("device", ["foo", "mps", "cuda:x"])
def test_unknown_or_missing_device_is_one_line(data_dir, tmp_path, device):
    message = f"--device {device}: expected auto, cpu, cuda, cuda:N or mps"
    if device == "mps":
        message = "--device mps asked for, but torch sees no MPS device (Apple silicon, macOS 12.3+)"
    assert_refused(run_main("train_gpt2.py", *args_for(data_dir, tmp_path, "--device", device)), message)
    assert not os.path.exists(tmp_path / "log.jsonl")


def test_auto_device_picks_mps_when_there_is_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert launch.resolve_device("auto") == "mps"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert launch.resolve_device("auto") == "cpu"


# --- benchmarks/gpu_check.py ------------------------------------------------------------------------
def test_gpu_check_runs_in_the_lease_order():
    """On one GPU: the default path as users run it first, then the groups in the issue's order, the
    multi-GPU variants last; on estimates, groups 1-5 fit the default budget."""
    matrix = gpu_check.plan(cuda=True, n_gpus=1)
    assert [v["group"] for v in matrix] == sorted(v["group"] for v in matrix)
    assert "; ".join(v["name"] for v in matrix[:7]) == (
        "default path: --model gpt2, 524,288 tok/step; AdamW bf16 compiled (the yardstick); --optimizer muon bf16 "
        "compiled; --doc-mask FlexAttention compiled; fp16 + GradScaler eager; out of memory before step 2 (bf16 "
        "compiled); bench_compile.py: blocks vs graph vs eager"
    )
    args = types.SimpleNamespace(
        steps=5, recipe_steps=3, seq_len=1024, model_flags=["--model", "gpt2"], peak_tflops=None, cuda=True
    )
    default = gpu_check.train_command(matrix[0], args, "D", "O", 64)
    assert shlex.join(default[1:]) == (
        "train_gpt2.py --data-dir D --out-dir O --model gpt2 --max-steps 3 --warmup-steps 2 --val-every 0 "
        "--sample-every 0 --hellaswag-every 0 --ckpt-every 0"
    )  # bf16, compile, --batch-size auto, 524,288 tokens: the defaults
    reference = gpu_check.train_command(matrix[0], args, "D", "O", 64, ref=True)
    assert shlex.join(reference[-7:]) == "--batch-size 16 --dtype float32 --no-compile --loss-chunk 0"
    # (32 micro-steps, same rows)
    assert sum(v["est_s"] for v in matrix if v["group"] <= 5) <= 400
    on_two = gpu_check.plan(cuda=True, n_gpus=2)
    assert on_two[: len(matrix)] == matrix and {v["nproc"] for v in on_two[len(matrix) :]} == {2}


def test_gpu_check_runs_its_cpu_subset(tmp_path, monkeypatch, capsys):
    """The CPU subset, in the lease's order, without `datasets`; the report in $OUT. The trainer commands
    run in-process; the budget test below runs the script and its commands as processes."""

    def in_process(cmd, env, timeout):  # gpu_check's run_command: each trainer command through main here
        assert cmd[:2] == [sys.executable, "train_gpt2.py"], cmd
        result = run_main("train_gpt2.py", *cmd[2:], env=env)
        return result.returncode, result.stdout, result.stderr

    monkeypatch.setattr(gpu_check, "run_command", in_process)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not on the lent GPU machine
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(sys, "argv", ["benchmarks/gpu_check.py", "--steps", "2"])
    assert gpu_check.main(sys.argv[1:]) == 0
    stdout = capsys.readouterr().out
    lines = [line for line in stdout.splitlines() if "| loss drift" in line]
    assert [line[:4] for line in lines] == ["[1] ", "[2] ", "[3] ", "[4] ", "[7] "], stdout
    assert all(" ok " in line and "tok/s" in line and "GiB private" in line for line in lines), stdout
    assert "--batch-size auto" in lines[0] and "| B=4 |" in lines[0]  # a step's 4 rows fit
    assert "--optimizer muon" in lines[1] and "--doc-mask" in lines[2] and "--activation-checkpointing" in lines[4]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = [(r["group"], r["status"]) for r in report["rows"]]
    assert (report["finished"], report["skipped"], rows) == (True, [], [(g, "ok") for g in [1, 2, 3, 4, 7]])
    assert report["rows"][1]["vs_adamw"].startswith("step ") and "causal attention" in report["rows"][2]["vs_causal"]
    commands = [c for r in report["rows"] for c in r["commands"]]
    assert all(c.startswith(sys.executable + " train_gpt2.py --data-dir ") for c in commands)
    markdown = (tmp_path / "gpu_check.md").read_text()
    table = [line for line in markdown.splitlines() if re.match(r"\| \d \|", line)]
    assert [line.split(" | ")[1] for line in table] == [r["name"] for r in report["rows"]]
    assert f"torch {torch.__version__}" in markdown and "--steps 2" in markdown
    assert len(os.listdir(tmp_path / "logs")) == 8  # 5 variants, 3 references (AdamW's, Muon's, --doc-mask's)


def test_gpu_check_budget_stops_after_the_first_variant(tmp_path):
    """As a program: its commands as processes, CUDA hidden."""
    args = ("--steps", "2", "--budget-s", "0", "--report", tmp_path)
    result = run_command("benchmarks/gpu_check.py", *args, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=600)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-3000:]
    assert [line[:4] for line in out.splitlines() if "| loss drift" in line] == ["[1] "]
    assert "not started (4): --optimizer muon; --doc-mask; fp16 + GradScaler; fp32 --activation-checkpointing" in out
    assert "run them on another lease: python benchmarks/gpu_check.py --groups 2,3,4,7" in out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["group"] for r in report["rows"]] == [1] and len(report["skipped"]) == 4 and report["finished"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "Not run (the time budget, or the lease ended first): --optimizer muon;" in markdown


def test_gpu_check_names_a_missing_package_first(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    assert gpu_check.main([]) == 2
    assert capsys.readouterr().out.splitlines()[0] == "gpu_check: missing tiktoken: pip install tiktoken"
