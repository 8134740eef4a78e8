"""The CUDA-side choices, tested on CPU (issue 12): MFU per GPU, the peak table, one host sync
per step, fp16 with a GradScaler, the chunked loss in evaluation and under compile, the compile
fallback, activation checkpointing, device validation and benchmarks/gpu_check.py."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import train_gpt2 as tg
from conftest import REPO, torchrun
from shards import make_docs, write_shards

T = 16
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "32"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("shards")
    write_shards(path, make_docs(400, seed=3, vocab=100, max_len=50), shard_size=4000)
    return str(path)


def args_for(data_dir, out_dir, *extra, steps=4, B=4):
    return ["--data-dir", data_dir, "--out-dir", str(out_dir), *TINY, "--seq-len", str(T),
            "--batch-size", str(B), "--total-batch-size", str(8 * T), "--max-steps", str(steps),
            "--warmup-steps", "2", "--max-lr", "1e-2", "--val-every", "0", "--sample-every", "0",
            "--hellaswag-every", "0", "--ckpt-every", "0", *extra]


def train_records(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def run_cli(args, nproc=1, script="train_gpt2.py"):
    launcher = torchrun("--standalone", f"--nproc_per_node={nproc}") if nproc > 1 else [sys.executable]
    return subprocess.run([*launcher, script, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


# --- MFU and throughput ------------------------------------------------------------------------

def test_mfu_under_two_ranks_is_per_gpu(data_dir, tmp_path):
    result = run_cli(args_for(data_dir, tmp_path, "--peak-tflops", "0.001", B=2), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    n_params = tg.GPT(tg.GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=16)).num_params()
    flops_per_token = 6 * n_params + 12 * 2 * 16 * T
    tokens = 8 * T  # all ranks' tokens of one step
    records = train_records(tmp_path)
    assert len(records) == 4
    for r in records:
        dt = r["dt_ms"] / 1000
        assert r["mfu"] == pytest.approx(flops_per_token * tokens / (dt * 2 * 1e9), rel=1e-9)
        assert r["tok_per_s"] == pytest.approx(tokens / dt, rel=1e-9)
        assert r["tok_per_s_per_gpu"] == pytest.approx(tokens / dt / 2, rel=1e-9)
    step_line = next(l for l in result.stdout.splitlines() if l.startswith("step     1/"))
    assert re.search(r"tok/s [\d,]+ \([\d,]+/gpu\) \| mfu [\d.]+%", step_line), step_line
    # the summary's mean leaves out step 0 (compile / warm-up)
    summary = next(l for l in result.stdout.splitlines() if l.startswith("done:"))
    mean_dt = sum(r["dt_ms"] for r in records[1:]) / 3 / 1000
    shown = int(re.search(r"mean ([\d,]+) tok/s", summary).group(1).replace(",", ""))
    assert shown == round(tokens / mean_dt)
    assert "over steps after the first" in summary


def test_no_mfu_on_cpu_without_peak(data_dir, tmp_path):
    assert tg.main(args_for(data_dir, tmp_path, steps=1)) == 0
    assert "mfu" not in train_records(tmp_path)[0]


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
    ("NVIDIA GH200 480GB", 989), ("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835), ("NVIDIA B200", 2250),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100-PCIE-40GB", 312), ("NVIDIA A10", 125), ("NVIDIA A10G", None),
    ("NVIDIA L4", 121), ("NVIDIA L40S", 362), ("NVIDIA L40", 181), ("NVIDIA RTX A6000", 154.8),
    ("NVIDIA GeForce RTX 3090", 71), ("NVIDIA GeForce RTX 3090 Ti", None), ("NVIDIA GeForce RTX 4090", 165.2),
    ("NVIDIA GeForce RTX 4090 D", None), ("NVIDIA GeForce RTX 5090", 209.5), ("Tesla V100-SXM2-16GB", 125),
    ("Tesla V100-PCIE-32GB", 112), ("Tesla V100S-PCIE-32GB", 130), ("Tesla T4", 65),
    ("NVIDIA GeForce GTX 1080 Ti", None), ("Tesla P100-PCIE-16GB", None),
])
def test_peak_table_matches_names_carefully(name, tflops):
    assert tg.peak_flops(name) == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_one_host_sync_per_step(data_dir, tmp_path, monkeypatch):
    """Steps after the first (which creates AdamW's state) read the device once (loss, norm and stop
    flag together) and copy no Python value to the device."""
    counts, inside = [], [False]

    def counting(name, original):
        def wrapper(*args, **kwargs):
            if inside[0]:
                counts[-1].append(name)
            return original(*args, **kwargs)
        return wrapper
    for name in ("item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "tensor", counting("torch.tensor", torch.tensor))
    monkeypatch.setattr(torch.cuda, "synchronize", counting("synchronize", torch.cuda.synchronize))
    original_step = tg.Trainer.train_step

    def train_step(self, step):
        counts.append([])
        inside[0] = True
        try:
            return original_step(self, step)
        finally:
            inside[0] = False
    monkeypatch.setattr(tg.Trainer, "train_step", train_step)
    assert tg.main(args_for(data_dir, tmp_path, "--grad-clip", "1.0", B=2)) == 0
    assert len(counts) == 4
    assert counts[1:] == [["tolist"]] * 3
