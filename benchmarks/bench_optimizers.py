"""AdamW vs Muon (--optimizer muon) at equal tokens: validation loss on the same rows, each optimizer
at its best LR from a short sweep, over several seeds; and the tokens Muon needs to reach AdamW's
final validation loss, as a fraction of AdamW's.

    python benchmarks/bench_optimizers.py                         # quickstart's CPU run: 100 steps x 2,048 tokens
    python benchmarks/bench_optimizers.py --steps 400 --jobs 1    # a longer budget, one run at a time
    python benchmarks/bench_optimizers.py --train-args="--doc-mask"  # any trainer flags, given to every run
    python benchmarks/bench_optimizers.py --corpus defs --steps 1000 --sweep-steps 100 ...  # docs/optimizers.md's 2M tokens
    python benchmarks/bench_optimizers.py --step-cost --model gpt2    # what one optimizer step costs, time and state

Every run is the real command (`python train_gpt2.py --model cpu ...`) on the same shards (by default
the Python standard library's sources, tokenized by fineweb.py as quickstart.sh does), with the same
schedule (warmup, cosine to 10%), batch and seed set. First each LR of the sweep trains with the first
seed (Muon's runs with AdamW, on the embeddings, LayerNorms and biases, at --max-lr); the LR with the
lowest final validation loss is each optimizer's best. Then AdamW's best trains with the other seeds,
and Muon's best with every seed, its AdamW part at AdamW's best LR (in the CPU preset the embedding
is 6.4M of the 7.3M parameters: Muon's runs must not lose on it). The validation loss is read every --val-every steps from each run's log.jsonl; "tokens to reach"
interpolates linearly between those points of the seed-mean curve.
"""

import argparse
import glob
import json
import os
import random
import re
import subprocess
import sys
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",")]


def ensure_data(data_dir: str, corpus: str):
    """Token shards of the standard library's sources, made once. quickstart: its top-level *.py files,
    one document each (the quickstart's data, 2.1M tokens). defs: every *.py file of the library and its
    packages, cut before each top-level def/class into 13,605 documents (15.3M tokens; median 525 bytes,
    mean 1,126 tokens, so rows of T=256 hold document boundaries, as FineWeb-Edu's ~1,000-token
    documents do in rows of T=1024), written in a seeded random order so that the documents packed
    into a row are unrelated, as FineWeb-Edu's are."""
    if os.path.isdir(data_dir):
        return
    stdlib = os.path.dirname(os.__file__)
    if corpus == "quickstart":
        source = ["--files", f"{stdlib}/*.py", "--doc-per-file", "--shard-size", "256K", "--prefix", "stdlib"]
    else:
        files = sorted(f for f in glob.glob(f"{stdlib}/**/*.py", recursive=True) if "site-packages" not in f)
        docs = []
        for path in files:
            with open(path, encoding="utf-8", errors="replace") as f:
                docs += [d for d in re.split(r"\n\n(?=@|def |class |async def )", f.read()) if d.strip()]
        random.Random(0).shuffle(docs)
        jsonl = data_dir.rstrip("/") + ".jsonl"
        with open(jsonl, "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        source = ["--files", jsonl, "--shard-size", "1M", "--prefix", "defs"]
    subprocess.run([sys.executable, "fineweb.py", *source, "--out-dir", data_dir], cwd=REPO, check=True)


def train(
    args, out_dir: str, variant: str, steps: int, optimizer: str, lr: float, seed: int, adamw_lr: float
) -> list[tuple[int, float, float]]:
    """One run (or a finished one found in out_dir); its (tokens seen, val loss, val bpb) points."""
    log = os.path.join(out_dir, "log.jsonl")

    def points():
        with open(log) as f:
            return [
                (r["step"] * args.total_batch_size, r["val_loss"], r.get("val_bpb", float("nan")))
                for r in map(json.loads, f)
                if "val_loss" in r
            ]

    if os.path.isfile(log):
        finished = points()
        if finished and finished[-1][0] == steps * args.total_batch_size:
            return finished
        shutil.rmtree(out_dir)
    cmd = [
        sys.executable,
        "train_gpt2.py",
        "--model",
        "cpu",
        "--data-dir",
        args.data_dir,
        "--out-dir",
        out_dir,
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--total-batch-size",
        str(args.total_batch_size),
        "--max-steps",
        str(steps),
        "--warmup-steps",
        str(args.warmup_steps),
        "--val-every",
        str(args.val_every),
        "--val-steps",
        str(args.val_steps),
        "--sample-every",
        "0",
        "--hellaswag-every",
        "0",
        "--ckpt-every",
        "0",
        "--seed",
        str(seed),
        "--optimizer",
        optimizer,
        *args.train_args.split(),
        *variant.split(),
    ]
    cmd += ["--max-lr", str(lr)] if optimizer == "adamw" else ["--max-lr", str(adamw_lr), "--muon-lr", str(lr)]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{' '.join(cmd)} failed: {result.stderr.strip().splitlines()[-1:]}")
    return points()


def mean_curve(curves: list) -> list[tuple[int, float, float]]:
    """The seed-mean of several runs' (tokens, val loss, val bpb) points."""
    return [
        (points[0][0], *(sum(column) / len(points) for column in list(zip(*points))[1:])) for points in zip(*curves)
    ]


def tokens_to_reach(curve: list[tuple[int, float, float]], target: float) -> float | None:
    """The first token count at which the curve's val loss (linear between its points) is at or below target."""
    for (t0, v0, _), (t1, v1, _) in zip(curve, curve[1:]):
        if v1 <= target:
            return t1 if v0 == v1 else t0 + (t1 - t0) * (v0 - target) / (v0 - v1)
    return None


def step_cost(model_name: str, rounds: int) -> int:
    """Time of one optimizer.step() (the best of rounds, AdamW and Muon interleaved) on the same
    gradients, and the bytes of optimizer state, for a GPT of the preset's shape."""
    import time
    import torch

    sys.path.insert(0, REPO)
    import train_gpt2 as tg

    model = tg.GPT(tg.GPTConfig(**tg.MODEL_PRESETS[model_name]))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizers = {
        "adamw": tg.build_optimizer(model, 0.1, 6e-4, "cpu"),
        "muon": tg.build_optimizer(model, 0.1, 6e-4, "cpu", muon_lr=0.02),
    }
    best = dict.fromkeys(optimizers, float("inf"))
    for _ in range(rounds):
        for name, optimizer in optimizers.items():
            t0 = time.perf_counter()
            optimizer.step()
            best[name] = min(best[name], time.perf_counter() - t0)
    state = {
        name: sum(t.numel() * t.element_size() for s in o.state.values() for t in s.values() if t.dim())
        for name, o in optimizers.items()
    }
    print(
        f"--model {model_name} ({model.num_params(without_positions=False) / 1e6:.1f}M params), CPU, "
        f"{torch.get_num_threads()} threads, best of {rounds}"
    )
    for name in optimizers:
        print(
            f"  {name:5s} step {1000 * best[name]:8.1f} ms ({best[name] / best['adamw']:.2f}x) | "
            f"state {state[name] / 2**20:7.1f} MiB ({state[name] / state['adamw']:.2f}x)"
        )
    return 0


def add_run_flags(p: argparse.ArgumentParser, val_every: int):
    """The flags train() reads besides the data: the shape of every run, the seeds, runs at a time."""
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--total-batch-size", type=int, default=2048)
    p.add_argument("--val-every", type=int, default=val_every)
    p.add_argument("--val-steps", type=int, default=8)
    p.add_argument("--seeds", type=lambda s: [int(v) for v in s.split(",")], default=[1337, 1338])
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (each one thread)")
    p.add_argument("--train-args", default="", help="more trainer flags for every run, e.g. --train-args=--doc-mask")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--corpus",
        choices=["quickstart", "defs"],
        default="quickstart",
        help="the data made when --data-dir is missing (see ensure_data)",
    )
    p.add_argument("--data-dir", help="token shards (default: data/stdlib for quickstart, data/stdlib_defs for defs)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps of the final runs")
    p.add_argument("--sweep-steps", type=int, help="optimizer steps of the LR sweep's runs (default: --steps)")
    add_run_flags(p, val_every=10)
    p.add_argument("--adamw-lrs", type=floats, default=floats("1.5e-3,3e-3,6e-3"), help="AdamW's --max-lr sweep")
    p.add_argument("--muon-lrs", type=floats, default=floats("0.01,0.02,0.04"), help="Muon's --muon-lr sweep")
    p.add_argument(
        "--max-lr",
        type=float,
        default=3e-3,
        help="AdamW's LR inside Muon's sweep runs (quickstart's; the final runs use AdamW's best)",
    )
    p.add_argument(
        "--also-with",
        default="",
        help="repeat the final runs with these trainer flags added, at the "
        "sweep's best LRs (the sweep runs without them), e.g. --also-with=--doc-mask",
    )
    p.add_argument("--json", help="also write every curve here")
    p.add_argument("--runs-dir", help="keep the runs here (default: a temporary folder); finished ones are reused")
    p.add_argument("--step-cost", action="store_true", help="only time one optimizer step of each (no training)")
    p.add_argument("--model", default="cpu", help="--step-cost: the preset whose shape to time")
    p.add_argument("--rounds", type=int, default=5, help="--step-cost: steps of each, interleaved")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.step_cost:
        return step_cost(args.model, args.rounds)
    args.data_dir = args.data_dir or os.path.join(
        REPO, "data", "stdlib" if args.corpus == "quickstart" else "stdlib_defs"
    )
    ensure_data(args.data_dir, args.corpus)
    sweep_steps = args.sweep_steps or args.steps
    variants = ["", args.also_with] if args.also_with else [""]
    sweeps = {"adamw": args.adamw_lrs, "muon": args.muon_lrs}
    curves = {}  # (variant, steps, optimizer, lr, seed, AdamW's lr) -> [(tokens, val loss, val bpb)]

    def sweep_key(opt, lr):
        return "", sweep_steps, opt, lr, args.seeds[0], lr if opt == "adamw" else args.max_lr

    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:

        def run_all(keys):
            futures = {
                key: pool.submit(train, args, os.path.join(args.runs_dir or tmp, run_name(key)), *key)
                for key in keys
                if key not in curves
            }
            curves.update({key: f.result() for key, f in futures.items()})

        run_all([sweep_key(opt, lr) for opt, lrs in sweeps.items() for lr in lrs])
        best = {opt: min(lrs, key=lambda lr: curves[sweep_key(opt, lr)][-1][1]) for opt, lrs in sweeps.items()}
        finals = {
            (variant, opt): [(variant, args.steps, opt, best[opt], seed, best["adamw"]) for seed in args.seeds]
            for variant in variants
            for opt in sweeps
        }
        run_all([key for keys in finals.values() for key in keys])

    tokens = args.steps * args.total_batch_size
    print(
        f"--model cpu | {args.steps} steps x {args.total_batch_size} tokens = {tokens:,} tokens | "
        f"T={args.seq_len} | seeds {args.seeds} | {args.data_dir} {args.train_args}"
    )
    print(f"\nsweep ({sweep_steps} steps, seed {args.seeds[0]}; Muon's AdamW part at {args.max_lr:g}): final val loss")
    for opt, lrs in sweeps.items():
        print(
            f"  {opt:5s} "
            + " | ".join(
                f"lr {lr:g}: {curves[sweep_key(opt, lr)][-1][1]:.4f}" + (" *" if lr == best[opt] else "") for lr in lrs
            )
        )
    mean = {final: mean_curve([curves[key] for key in keys]) for final, keys in finals.items()}
    for variant in variants:
        print(
            f"\n{variant or 'as given'}: val loss at equal tokens (best LRs, Muon's AdamW part at "
            f"{best['adamw']:g}; mean of {len(args.seeds)} seeds, each seed in brackets; val bpb of the mean)"
        )
        print(f"  {'tokens':>9s} | " + " | ".join(f"{opt + ' lr ' + format(best[opt], 'g'):>37s}" for opt in sweeps))
        for i, (t, *_) in enumerate(mean[(variant, "adamw")]):
            cells = [
                f"{mean[(variant, opt)][i][1]:.4f} ["
                + " ".join(f"{curves[key][i][1]:.3f}" for key in finals[(variant, opt)])
                + f"] bpb {mean[(variant, opt)][i][2]:.4f}"
                for opt in sweeps
            ]
            print(f"  {t:9,d} | " + " | ".join(f"{cell:>37s}" for cell in cells))
    target = mean[("", "adamw")][-1][1]
    print(f"\ntokens to reach AdamW's final val loss {target:.4f} (its {tokens:,} tokens, {variants[0] or 'as given'})")
    for final, curve in mean.items():
        reached = tokens_to_reach(curve, target)
        print(
            f"  {' '.join(final[0].split() + [final[1]]):>20s}: final val loss {curve[-1][1]:.4f}, bpb {curve[-1][2]:.4f}; "
            + (
                f"reaches it at {reached:,.0f} tokens ({reached / tokens:.2f}x)"
                if reached is not None
                else "does not reach it"
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(best=best, curves={run_name(k): v for k, v in curves.items()}), f)
    return 0


def run_name(key) -> str:
    """A run's folder name: its variant's flags without dashes, steps, optimizer, LR, seed, AdamW's LR."""
    variant, *rest = key
    return "_".join(variant.replace("-", "").split() + [str(v) for v in rest])


if __name__ == "__main__":
    sys.exit(main())
