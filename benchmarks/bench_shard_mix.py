"""Does a step need rows from more than one shard? The trainer's shuffle permutes the shards and the
rows within each shard, so a step's rows come from one shard; if shards differ (fineweb.py writes
documents in the order it reads them), the model sees one shard's kind of text for a shard's worth
of steps. This benchmark trains the same model on the same documents laid out two ways:

    in order: the quickstart's shards (the standard library's files in name order, 256K-token shards);
    mixed:    the same documents after the validation shard's, written in a seeded random order,
              so that every shard holds a sample of all of them (what drawing each step's rows
              from every shard would give).

The validation shard is byte-identical in both, and so is the multiset of training tokens. It
prints the validation loss at equal tokens (mean of the seeds), and the training loss's mean
jump at the steps where a new shard begins against its mean step-to-step change elsewhere.

    python benchmarks/bench_shard_mix.py                   # 400 steps x 2,048 tokens, 2 seeds
    python benchmarks/bench_shard_mix.py --steps 100 --seeds 1
"""

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from bench_optimizers import REPO, add_run_flags, mean_curve, train

sys.path.insert(0, REPO)


def make_corpora(root: str, shard_tokens: int) -> dict[str, str]:
    """Both layouts of the standard library's top-level *.py files, one document each."""
    from trainkit.data.tokenizer import get_tokenizer_or_fail

    enc = get_tokenizer_or_fail()
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    docs = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            docs.append(f.read())
    tokens, n_val = 0, 0  # the documents that fill the validation shard stay first, in order
    while tokens < shard_tokens:
        tokens += 1 + len(enc.encode_ordinary(docs[n_val]))
        n_val += 1
    layouts = {"in order": docs, "mixed": docs[:n_val] + random.Random(0).sample(docs[n_val:], len(docs) - n_val)}
    dirs = {}
    for name, layout in layouts.items():
        slug = name.replace(" ", "_")
        with open(os.path.join(root, f"{slug}.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": doc}) + "\n" for doc in layout)
        dirs[name] = os.path.join(root, slug)
        subprocess.run(
            [
                sys.executable,
                "fineweb.py",
                "--files",
                f.name,
                "--shard-size",
                str(shard_tokens),
                "--prefix",
                "stdlib",
                "--out-dir",
                dirs[name],
            ],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
    return dirs


def shard_jump(out_dir: str, data_dir: str, seed: int, args) -> tuple[float, float]:
    """Mean |training loss change| at the steps whose first row is in another shard than the step
    before's (the trainer's own row order says which), and at the other steps."""
    import train_gpt2

    rows = train_gpt2.TokenRows(data_dir, "train", args.seq_len, shuffle=True, seed=seed)
    rows_per_step = args.total_batch_size // args.seq_len
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    shard = [rows.locate(s * rows_per_step)[0] for s in range(len(losses))]
    changes = {True: [], False: []}
    for s in range(2, len(losses)):  # step 0 to 1 is the steepest of all: left out
        changes[shard[s] != shard[s - 1]].append(abs(losses[s] - losses[s - 1]))
    return sum(changes[True]) / max(1, len(changes[True])), sum(changes[False]) / len(changes[False])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    add_run_flags(p, val_every=50)
    p.add_argument("--lr", type=float, default=3e-3, help="--max-lr (the quickstart's)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shard_tokens = 256 * 1024
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        dirs = make_corpora(tmp, shard_tokens)
        runs = {}
        for name, data_dir in dirs.items():
            for seed in args.seeds:
                out = os.path.join(tmp, f"{name.replace(' ', '_')}_{seed}")
                run_args = argparse.Namespace(**{**vars(args), "data_dir": data_dir})
                runs[(name, seed)] = (
                    out,
                    pool.submit(train, run_args, out, "", args.steps, "adamw", args.lr, seed, args.lr),
                )
        curves = {key: future.result() for key, (_, future) in runs.items()}
        jumps = {(name, seed): shard_jump(out, dirs[name], seed, args) for (name, seed), (out, _) in runs.items()}
    print(
        f"--model cpu | {args.steps} steps x {args.total_batch_size} tokens | T={args.seq_len} | lr {args.lr:g} | "
        f"seeds {args.seeds} | 256K-token shards {args.train_args}"
    )
    mean = {name: mean_curve([curves[(name, seed)] for seed in args.seeds]) for name in dirs}
    print(f"  {'tokens':>9s} | " + " | ".join(f"{name + ' val loss (bpb)':>26s}" for name in dirs))
    for i, (t, *_) in enumerate(mean["in order"]):
        print(f"  {t:9,d} | " + " | ".join(f"{mean[n][i][1]:.4f} ({mean[n][i][2]:.4f})".rjust(26) for n in dirs))
    for name in dirs:
        at, elsewhere = (sum(jumps[(name, s)][k] for s in args.seeds) / len(args.seeds) for k in (0, 1))
        print(f"  {name}: train loss moves {at:.3f} at a new shard's first step, {elsewhere:.3f} at other steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
