"""This checkout's trainer against itself at other git revisions: same command, same data, side by side.

    python benchmarks/bench_revision.py 7d59674              # CPU preset: 4 x 128, B=8, T=128, 2,048 tokens a step
    python benchmarks/bench_revision.py 01f7116 7d59674 --threads 2 --rounds 3
    python benchmarks/bench_revision.py 7d59674 --model gpt2 --batch-size 4 --seq-len 256 --steps 4
    python benchmarks/bench_revision.py 7d59674 --compile --warmup 2
    python benchmarks/bench_revision.py 7d59674 --parts      # where a step's time goes, per part, in each

Each revision is checked out with `git worktree add --detach` into a temporary folder, removed
afterwards; "this" is the working tree the script runs from, uncommitted changes included. Every
round runs `python train_gpt2.py` of each tree as a whole process, one after another (interleaved,
every other round in reverse order: load from elsewhere hits all alike), on the same synthetic
shards and flags. A run's figure is the
median of its steps after the first --warmup (log.jsonl's dt_ms) and the peak memory the trainer
prints (peak RSS on CPU, CUDA's allocated peak); each tree keeps its best round. Run it before
closing a change to the model, the loss, the loader or the step: the reference loops of
bench_train.py swing more from run to run than such a change moves.

--parts times the parts of the trainer's own step (train_gpt2.accumulate_gradients, the Prefetcher,
the fused AdamW) in each tree: data (the wait for the prefetched batches), forward (embeddings and
blocks), lm_head + loss (forward and backward; the chunked loss computes its gradients in its
forward), backward (blocks and embeddings) and optimizer (norm, clipping, update, zeroing). On CPU the
operations are synchronous, so wall-clock marks from hooks at the final LayerNorm split them exactly.
"""

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from trainkit import cli  # noqa: E402

PARTS = ["data", "forward", "lm_head + loss", "backward", "optimizer"]


@contextlib.contextmanager
def revision_trees(refs):
    """{label: source folder}: this checkout, then each ref checked out in a temporary worktree."""
    trees = {"this": REPO}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for ref in refs:
                path = os.path.join(tmp, ref.replace("/", "_"))
                subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-q", path, ref], check=True)
                trees[ref] = path
            yield trees
        finally:
            for path in trees.values():
                if path != REPO:
                    subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", path], check=False)


def write_shards(data_dir, tokens):
    rng = np.random.default_rng(0)
    for split, n in (("train", tokens), ("val", 4096)):
        np.save(os.path.join(data_dir, f"bench_{split}_000000.npy"), rng.integers(0, 50257, n, dtype=np.uint16))


def train_command(tree, data_dir, out_dir, args):
    cmd = [
        sys.executable,
        os.path.join(tree, "train_gpt2.py"),
        "--data-dir",
        data_dir,
        "--out-dir",
        out_dir,
        "--model",
        args.model,
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--total-batch-size",
        str(args.batch_size * args.seq_len * args.accum),
        "--max-steps",
        str(args.warmup + args.steps),
        "--warmup-steps",
        "1",
        "--val-every",
        "0",
        "--sample-every",
        "0",
        "--hellaswag-every",
        "0",
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--compile" if args.compile else "--no-compile",
    ]
    return cmd + args.train_args.split()


def run_trainer(tree, data_dir, args):
    """{step_ms, tok_per_s, peak_gib} of one whole run of tree's trainer, or None if it failed."""
    with tempfile.TemporaryDirectory() as out_dir:
        out = subprocess.run(train_command(tree, data_dir, out_dir, args), capture_output=True, text=True, cwd=tree)
        if out.returncode:
            print(f"{tree}: failed\n{out.stdout[-1000:]}{out.stderr[-2000:]}", flush=True)
            return None
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            step_ms = [r["dt_ms"] for r in map(json.loads, f) if "dt_ms" in r]
    dt = float(np.median(step_ms[args.warmup :])) / 1000
    peak = re.search(r"peak memory ([\d.]+) GiB", out.stdout)
    return dict(
        step_ms=1000 * dt,
        tok_per_s=args.batch_size * args.seq_len * args.accum / dt,
        peak_gib=float(peak.group(1)) if peak else float("nan"),
    )


def step_parts(args):
    """Milliseconds per part of one step (median over --steps after --warmup) of the trainer whose
    modules are on sys.path (run in a subprocess per tree)."""
    import torch
    import train_gpt2 as tg

    torch.manual_seed(0)
    device_type = "cuda" if args.device.startswith("cuda") else "cpu"
    dtype = {
        "auto": torch.bfloat16 if device_type == "cuda" else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[args.dtype]
    cfg = tg.GPTConfig(**{**tg.MODEL_PRESETS[args.model], "block_size": max(args.seq_len, 256)})
    model = tg.GPT(cfg).to(args.device)
    optimizer = (
        tg.build_optimizer(model, 0.1, 6e-4, device_type)
        if hasattr(tg, "build_optimizer")
        else model.configure_optimizers(0.1, 6e-4, device_type)
    )  # before 9925424: a GPT method
    loader = tg.StepLoader(
        tg.TokenRows(args.data_dir, "train", args.seq_len, shuffle=True, seed=0), args.batch_size, args.accum, 0, 1
    )
    prefetcher = tg.Prefetcher(loader, pin_memory=device_type == "cuda")
    loss_chunk = tg.CPU_LOSS_CHUNK if device_type == "cpu" else 0
    train_model = tg.compile_model(model) if args.compile else model
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    marks = []  # (part that just ended, time)

    def mark(part):
        sync()
        marks.append((part, time.perf_counter()))

    def hidden_states_done(module, inputs, h):  # forward reached the final LayerNorm: lm_head + loss next
        mark("forward")
        if h.requires_grad:  # its gradient arrives when the lm_head + loss backward is done
            h.register_hook(lambda grad: mark("lm_head + loss"))

    model.transformer.ln_f.register_forward_hook(hidden_states_done)
    original_backward = torch.Tensor.backward

    def backward(tensor, *a, **kw):  # the loss's forward ends where its backward starts
        mark("lm_head + loss")
        original_backward(tensor, *a, **kw)
        mark("backward")

    times = {part: [] for part in PARTS}
    for s in range(args.warmup + args.steps):
        marks.clear()
        mark("start")
        batches, n_tokens = prefetcher.get(s)
        mark("data")
        torch.Tensor.backward = backward
        try:
            loss = tg.accumulate_gradients(train_model, batches, n_tokens, 1, args.device, dtype, loss_chunk)
        finally:
            torch.Tensor.backward = original_backward
        mark("-")  # accumulate_gradients' last bookkeeping: not a part
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item(), norm.item()
        mark("optimizer")
        if s >= args.warmup:
            step = {part: 0.0 for part in PARTS}
            for (_, t0), (part, t1) in zip(marks, marks[1:]):
                if part in step:
                    step[part] += t1 - t0
            for part in PARTS:
                times[part].append(1000 * step[part])
    prefetcher.close()
    return {part: float(np.median(ms)) for part, ms in times.items()}


def print_parts(best, args):
    labels = list(best)
    print(f"per part of a step, ms (median of {args.steps} steps, best of {args.rounds} rounds per part):")
    print("| part | " + " | ".join(labels) + " |")
    print("| --- |" + " --- |" * len(labels))
    total = {label: sum(best[label].values()) for label in labels}
    for part in PARTS:
        print(
            f"| {part} | "
            + " | ".join(f"{best[label][part]:.1f} ({100 * best[label][part] / total[label]:.0f}%)" for label in labels)
            + " |"
        )
    print("| step | " + " | ".join(f"**{total[label]:.1f}**" for label in labels) + " |")


def main():
    p = cli.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("refs", nargs="*", help="git revisions to compare this checkout with")
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="cpu", help="preset (default cpu: 4 layers x 128)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per micro-step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row")
    p.add_argument("--accum", type=int, default=2, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved runs of every tree; best counts")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the runs (default: as set)")
    p.add_argument("--dtype", default="auto", help="the trainer's --dtype")
    p.add_argument("--compile", action="store_true", help="the trainer's --compile (else --no-compile)")
    p.add_argument("--train-args", default="", help="more flags for train_gpt2.py, as one string")
    p.add_argument("--parts", action="store_true", help="time the parts of a step in each tree instead")
    p.add_argument("--parts-worker", help=argparse.SUPPRESS)
    p.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.parts_worker:  # the tree's own modules, trainkit's cli included, not this checkout's
        sys.path[:] = [args.parts_worker] + [path for path in sys.path if path != REPO]
        for name in [name for name in sys.modules if name == "trainkit" or name.startswith("trainkit.")]:
            sys.modules.pop(name)
        print(json.dumps(step_parts(args)))
        return
    for ref in args.refs:
        if subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--verify", "-q", f"{ref}^{{commit}}"], capture_output=True
        ).returncode:
            p.error(f"{ref} is not a commit of the git repository at {REPO}")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stopped, it still removes its worktrees
    with revision_trees(args.refs) as trees, tempfile.TemporaryDirectory() as data_dir:
        write_shards(data_dir, args.batch_size * args.seq_len * args.accum * (args.warmup + args.steps + 2))
        print(
            f"device {args.device} | model {args.model} | B={args.batch_size} T={args.seq_len} accum={args.accum} "
            f"| compile {args.compile} | OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} | "
            f"median of {args.steps} steps after {args.warmup} | best of {args.rounds} rounds | "
            f"load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        best = {}
        for i in range(args.rounds):
            # every other round in reverse order: a load that rises or falls during a round favours no tree
            for label, tree in list(trees.items())[:: -1 if i % 2 else 1]:
                if args.parts:
                    out = subprocess.run(
                        [sys.executable, __file__, *sys.argv[1:], "--parts-worker", tree, "--data-dir", data_dir],
                        capture_output=True,
                        text=True,
                        cwd=tree,
                    )
                    if out.returncode:
                        print(f"{label}: failed\n{out.stderr[-2000:]}", flush=True)
                        continue
                    r = json.loads(out.stdout.splitlines()[-1])
                    best[label] = {k: min(v, best.get(label, r)[k]) for k, v in r.items()}
                    continue
                r = run_trainer(tree, data_dir, args)
                if r:  # each run as it ends: a long benchmark on a busy machine shows its spread
                    print(
                        f"round {i + 1}: {label:10s} {r['tok_per_s']:8,.0f} tok/s | load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
                if r and (label not in best or r["tok_per_s"] > best[label]["tok_per_s"]):
                    best[label] = r
        print(f"load {os.getloadavg()[0]:.1f} at the end")
        if args.parts:
            return print_parts(best, args)
        if "this" not in best:
            return
        for label, r in best.items():
            print(
                f"{label:10s} | {r['tok_per_s']:8,.0f} tok/s | step {r['step_ms']:8.1f} ms | peak memory "
                f"{r['peak_gib']:.2f} GiB | this / {label}: {best['this']['tok_per_s'] / r['tok_per_s']:.3f}x tok/s, "
                f"{best['this']['peak_gib'] / r['peak_gib']:.3f}x memory",
                flush=True,
            )


if __name__ == "__main__":
    main()
