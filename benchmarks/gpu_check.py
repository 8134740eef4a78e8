"""The CUDA matrix in one command, for the day a GPU is there; a CPU subset everywhere else.

    python benchmarks/gpu_check.py                   # CUDA: GPT-2 124M, B=64, T=1024; CPU: a tiny model
    python benchmarks/gpu_check.py --steps 10 --batch-size 32

Each variant is the real command (`python train_gpt2.py ...`, or torchrun over every visible GPU)
on the same synthetic shards, for a few steps of one micro-batch per GPU. Per variant it prints:
the largest relative difference of its losses from the eager fp32 reference (the same rows:
the reference runs B/4 rows x 4 accumulation steps, which logs the same losses and fits in
memory), tok/s in total and per GPU and MFU (mean over the steps after the first), peak memory
and compile time (step 0's time minus the median of the others). Exit code 1 if a variant
fails or its losses drift beyond the tolerance of its dtype.

    CUDA: bf16 and fp16 x compile on/off x chunked/full loss on one GPU; bf16 compiled with
          --batch-size auto, and with a step that runs out of memory (benchmarks/squeeze_memory.py
          leaves 60% of a step's need free before step 2: the step is redone at half the
          micro-batch); bf16 compiled and fp16 eager with --optimizer muon; then bf16 and fp16
          compiled on all visible GPUs (torchrun, NCCL), bf16 compiled with --fsdp, and bf16
          compiled with --optimizer muon; --doc-mask (bf16, full logits) with FlexAttention
          (compiled), SDPA's mask compiled (DOC_MASK_KERNEL=sdpa) and SDPA's mask eager, with their
          tok/s as ratios to plain causal attention compiled. Then the micro-batch --batch-size auto
          finds for the model at the recipe's 524,288 tokens per step, on the whole GPU and on 24 GiB
          of it (a consumer card).
          Last, benchmarks/bench_compile.py: the trainer's compile (one block at a time) against
          the whole GPT compiled as one graph and eager, at B=16, from an empty inductor cache
          (compile seconds, tok/s, loss drift; a drift beyond bf16's tolerance fails).
    CPU:  a 2-layer model with a 512-token vocabulary: bf16 chunked, fp16 full logits, fp32 with
          activation checkpointing, bf16 with --batch-size auto, fp16 on 2 gloo ranks, fp16 with
          --optimizer muon; no compile (inductor on CPU takes 20-40 s per variant; --compile adds it)
Each line ends with the micro-batch the run trained at (auto: what it chose; after an
out-of-memory: the size it went on with). A variant with --optimizer muon is compared with an
eager fp32 reference that runs Muon too, one with --doc-mask with a reference that masks too.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import cli  # noqa: E402
RECIPE_TOKENS = 524288  # GPT-2 124M's tokens per step (the trainer's default --total-batch-size)
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}  # relative, over a few steps
MUON = ["--optimizer", "muon"]
DOC_MASK = ["--doc-mask"]


def variants(cuda: bool, n_gpus: int, compile_on_cpu: bool) -> list[dict]:
    """name, dtype, compile, loss chunk (0: full logits), processes, extra flags, environment."""
    if cuda:
        out = [dict(dtype=dtype, compile=compile, chunk=chunk, nproc=1)
               for dtype in ("bfloat16", "float16") for compile in (True, False) for chunk in (0, 8192)]
        out.append(dict(dtype="bfloat16", compile=True, chunk=0, nproc=1, extra=["--batch-size", "auto"]))
        out.append(dict(dtype="bfloat16", compile=True, chunk=0, nproc=1, squeeze=["--squeeze", "2:60%"]))
        out += [dict(dtype="bfloat16", compile=True, chunk=0, nproc=1, extra=MUON),  # Muon's step time and memory
                dict(dtype="float16", compile=False, chunk=0, nproc=1, extra=MUON)]  # with the GradScaler
        out += [dict(dtype="bfloat16", compile=True, chunk=0, nproc=1, extra=DOC_MASK, kernel="flex"),
                dict(dtype="bfloat16", compile=True, chunk=0, nproc=1, extra=DOC_MASK, kernel="sdpa",
                     env={"DOC_MASK_KERNEL": "sdpa"}),
                dict(dtype="bfloat16", compile=False, chunk=0, nproc=1, extra=DOC_MASK, kernel="sdpa")]
        if n_gpus > 1:
            out += [dict(dtype=dtype, compile=True, chunk=0, nproc=n_gpus) for dtype in ("bfloat16", "float16")]
            out.append(dict(dtype="bfloat16", compile=True, chunk=0, nproc=n_gpus, extra=["--fsdp"]))  # vs DDP
            out.append(dict(dtype="bfloat16", compile=True, chunk=0, nproc=n_gpus, extra=MUON))
    else:
        out = [dict(dtype="bfloat16", compile=False, chunk=64, nproc=1),
               dict(dtype="float16", compile=False, chunk=0, nproc=1),
               dict(dtype="float32", compile=False, chunk=64, nproc=1, extra=["--activation-checkpointing"]),
               dict(dtype="bfloat16", compile=False, chunk=64, nproc=1, extra=["--batch-size", "auto"]),
               dict(dtype="float16", compile=False, chunk=64, nproc=2),
               dict(dtype="float16", compile=False, chunk=64, nproc=1, extra=MUON)]
        if compile_on_cpu:
            out.append(dict(dtype="float32", compile=True, chunk=64, nproc=1))
    for v in out:
        v["name"] = (f"{v['dtype']:8s} {'compile' if v['compile'] else 'eager':7s} "
                     f"{'chunk ' + str(v['chunk']) if v['chunk'] else 'full logits':11s} x{v['nproc']}"
                     + (" " + " ".join(v.get("extra", [])) if v.get("extra") else "")
                     + (" out of memory at step 2" if v.get("squeeze") else "")
                     + (f" ({v['kernel']})" if v.get("kernel") else ""))
    return out


def run_variant(v: dict, args, data_dir: str, out_dir: str, batch_size: int, accum: int = 1) -> dict:
    """Run one variant's command; its losses, speed and memory from log.jsonl and the summary line."""
    launcher = [sys.executable]
    if v["nproc"] > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={v['nproc']}"]
    # squeeze_memory.py runs the trainer in its process and takes the GPU's free memory away before a step
    script = ["benchmarks/squeeze_memory.py", *v["squeeze"], "--"] if "squeeze" in v else ["train_gpt2.py"]
    total = v.get("total", batch_size * accum * args.seq_len * v["nproc"])  # accum micro-steps per step
    cmd = [*launcher, *script, "--data-dir", data_dir, "--out-dir", out_dir, *args.model_flags,
           "--seq-len", str(args.seq_len), "--batch-size", str(batch_size), "--total-batch-size", str(total),
           "--max-steps", str(args.steps), "--warmup-steps", "2", "--val-every", "0", "--sample-every", "0",
           "--hellaswag-every", "0", "--ckpt-every", "0", "--dtype", v["dtype"], "--loss-chunk", str(v["chunk"]),
           "--compile" if v["compile"] else "--no-compile", *v.get("extra", [])]
    if args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **v.get("env", {})})
    if result.returncode:
        return dict(error=(result.stderr.strip().splitlines() or ["exit code %d" % result.returncode])[-1])
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    records = [r for r in logged if "loss" in r]
    later = records[1:] or records
    dts = [r["dt_ms"] / 1000 for r in later]
    summary = next(line for line in result.stdout.splitlines() if line.startswith("done:"))
    memory = re.search(r"peak memory ([\d.]+ GiB \w+)", summary).group(1)
    mfu = [r["mfu"] for r in later if "mfu" in r]
    sizes = [r["batch_size"] for r in logged if r.get("event") == "batch_size"]  # auto's choice, out-of-memory's
    return dict(micro_batch="B=" + "->".join(str(b) for b in [batch_size] * ("squeeze" in v) + sizes) if sizes else "",
                auto_line=next((line for line in result.stdout.splitlines() if line.startswith("--batch-size auto")), ""),
                losses=[r["loss"] for r in records], tok_per_s=statistics.mean(r["tok_per_s"] for r in later),
                tok_per_s_per_gpu=statistics.mean(r["tok_per_s_per_gpu"] for r in later),
                mfu=statistics.mean(mfu) if mfu else None, memory=memory,
                compile_s=records[0]["dt_ms"] / 1000 - statistics.median(dts) if v["compile"] else None)


def report(v: dict, r: dict, ref_losses: list[float]) -> bool:
    """Print one variant's line; True if it ran and its losses agree with the reference."""
    if "error" in r:
        print(f"{v['name']:48s} | FAILED: {r['error']}", flush=True)
        return False
    drift = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses))
    ok = drift <= TOLERANCE[v["dtype"]] and len(r["losses"]) == len(ref_losses)
    if v.get("squeeze") and "->" not in r["micro_batch"]:
        r["micro_batch"], ok = "no out-of-memory happened", False
    mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] is not None else "    -"
    compile_s = f"{r['compile_s']:6.1f}s" if r["compile_s"] is not None else "      -"
    print(f"{v['name']:48s} | loss drift {drift:.1e} {'ok  ' if ok else 'HIGH'} | {r['tok_per_s']:10,.0f} tok/s "
          f"({r['tok_per_s_per_gpu']:9,.0f}/gpu) | mfu {mfu} | peak {r['memory']:14s} | compile {compile_s}"
          + (f" | {r['micro_batch']}" if r["micro_batch"] else ""), flush=True)
    return ok


def main(argv=None) -> int:
    import torch
    cuda = torch.cuda.is_available()
    p = cli.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6 if cuda else 4, help="optimizer steps per variant")
    p.add_argument("--batch-size", type=int, default=64 if cuda else 4, help="rows per GPU (one micro-step)")
    p.add_argument("--seq-len", type=int, default=1024 if cuda else 32)
    p.add_argument("--peak-tflops", type=float, help="peak of one device for MFU (default: the trainer's table)")
    p.add_argument("--compile", action="store_true", help="on CPU, add a compiled variant (20-40 s)")
    args = p.parse_args(argv)
    vocab = 50257 if cuda else 512
    args.model_flags = ["--model", "gpt2"] if cuda else ["--n-layer", "2", "--n-head", "2", "--n-embd", "32",
                                                          "--block-size", str(args.seq_len), "--vocab-size", "512"]
    n_gpus = torch.cuda.device_count() if cuda else 0
    matrix = variants(cuda, n_gpus, args.compile)
    max_nproc = max(v["nproc"] for v in matrix)
    if args.batch_size % 4:
        p.error("--batch-size must be a multiple of 4 (the reference splits it in 4)")
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = os.path.join(tmp, "data")
        os.makedirs(data_dir)
        n_tokens = max((args.steps + 1) * args.batch_size * max_nproc * args.seq_len, 2 * RECIPE_TOKENS * cuda) + 1
        for split in ("train", "val"):  # synthetic GPT-2 token ids: speed and agreement, not learning
            tokens = np.random.default_rng(0).integers(0, vocab, n_tokens, dtype=np.uint16)
            if cuda:  # documents of ~300 tokens on average (FineWeb-Edu's are longer): --doc-mask's case
                tokens[np.random.default_rng(1).random(n_tokens) < 1 / 300] = 50256
            np.save(os.path.join(data_dir, f"synth_{split}_000000.npy"), tokens)
        print(f"{'CUDA: ' + torch.cuda.get_device_name() + f' x{n_gpus}' if cuda else 'CPU subset (no CUDA)'} | "
              f"{' '.join(args.model_flags)} | B={args.batch_size} T={args.seq_len} | {args.steps} steps", flush=True)
        ok, refs, results = True, {}, {}
        for i, v in enumerate(matrix):
            # flags that change the losses: the reference runs them too
            loss_flags = ((MUON if MUON[-1] in v.get("extra", []) else [])
                          + (DOC_MASK if v.get("extra") == DOC_MASK else []))
            key = (v["nproc"], *loss_flags)
            if key not in refs:  # one process, B/4 rows x 4·nproc micro-steps: the same rows
                ref_v = dict(dtype="float32", compile=False, chunk=0, nproc=1, extra=loss_flags)
                refs[key] = run_variant(ref_v, args, data_dir, os.path.join(tmp, "ref" + "_".join(map(str, key))),
                                        args.batch_size // 4, 4 * v["nproc"])
            ref = refs[key]
            if "error" in ref:
                print(f"eager fp32 reference for x{v['nproc']} {' '.join(loss_flags)}: FAILED: {ref['error']}")
                return 1
            results[v["name"]] = run_variant(v, args, data_dir, os.path.join(tmp, f"run{i}"), args.batch_size)
            ok &= report(v, results[v["name"]], ref["losses"])
        print_doc_mask_ratios(matrix, results)
        if cuda:  # what --batch-size auto finds for the model at the recipe's batch, on all and on 24 GiB of the GPU
            for name, squeeze in (("the whole GPU", None), ("24 GiB of it", ["--squeeze", f"{24 * 1024}MiB"])):
                v = dict(dtype="bfloat16", compile=True, chunk=0, nproc=1, extra=["--batch-size", "auto"],
                         total=RECIPE_TOKENS, **(dict(squeeze=squeeze) if squeeze else {}))
                r = run_variant(v, argparse.Namespace(**{**vars(args), "steps": 1}), data_dir,
                                os.path.join(tmp, f"recipe_{len(name)}"), args.batch_size)
                print(f"{' '.join(args.model_flags)} at {RECIPE_TOKENS:,} tokens/step on {name}: "
                      f"{r.get('auto_line') or 'FAILED: ' + r.get('error', '?')}", flush=True)
                ok &= "error" not in r
    if cuda:  # per-block compile vs the whole graph: seconds to compile and tok/s
        import bench_compile  # (beside this file, on sys.path as the script's folder)
        best = bench_compile.main(["--rounds", "2", "--steps", str(args.steps)])
        ok &= all(b["drift"] <= TOLERANCE["bfloat16"] for b in best.values())
    return 0 if ok else 1


def print_doc_mask_ratios(matrix: list[dict], results: dict):
    """tok/s of each --doc-mask kernel over plain causal attention's (bf16, compiled, full logits)."""
    plain = next((results[v["name"]] for v in matrix if v["dtype"] == "bfloat16" and v["compile"]
                  and not v["chunk"] and v["nproc"] == 1 and not v.get("extra") and "squeeze" not in v), None)
    for v in matrix:
        r = results.get(v["name"], {})
        if v.get("extra") == DOC_MASK and plain and "error" not in plain and "error" not in r:
            print(f"--doc-mask {v['kernel']:4s} {'compiled' if v['compile'] else 'eager':8s}: "
                  f"{r['tok_per_s'] / plain['tok_per_s']:.2f}x the tok/s of causal attention compiled", flush=True)


if __name__ == "__main__":
    sys.exit(main())
