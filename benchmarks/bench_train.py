"""Time this trainer's optimizer step against a straightforward reference loop, change by change.

    python benchmarks/bench_train.py                 # CPU preset on CPU, GPT-2 124M on CUDA
    python benchmarks/bench_train.py --loader        # data loader rows/s and RSS vs shard size
    python benchmarks/bench_train.py --eval          # validation loss: chunked vs full logits, no_grad
    python benchmarks/bench_train.py --lm-head       # one loss chunk's lm_head matmuls: padded vs real rows

Each variant runs in its own process (so peak memory is its own) on the same model, batch and
data, and prints tokens/s, peak memory and the ratio to the reference, and on CPU the model's
FLOP/s (6 per parameter per token plus attention) as a share of this machine's fp32 matmul
(sgemm, 2048^3, measured between the rounds). The variants add one change at a time:

    reference  per-micro-step mean loss / steps, unfused AdamW, full logits, no compile,
               batches loaded between micro-steps (the build-nanogpt loop)
    +fused     fused AdamW (one kernel for the whole update)
    +chunked   lm_head + cross-entropy in row chunks, logits never materialized
    +prefetch  next step's batches prepared on a thread (pinned + non_blocking on CUDA)
    +compile   torch.compile (compile time reported separately)

"ours" is the trainer's own step (train_gpt2.accumulate_gradients + Prefetcher + fused AdamW +
chunked loss), the same code path `python train_gpt2.py` runs.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainkit import cli  # noqa: E402

VARIANTS = ["reference", "+fused", "+chunked", "+prefetch", "+compile"]


def peak_memory_mb(device):
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_variant(variant, args):
    import torch
    import train_gpt2 as tg

    torch.manual_seed(0)
    device = args.device
    device_type = "cuda" if device.startswith("cuda") else "cpu"
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")
    cfg = tg.GPTConfig(**{**tg.MODEL_PRESETS[args.model], "block_size": max(args.seq_len, 256)})
    rows = tg.TokenRows(args.data_dir, "train", args.seq_len)
    loader = tg.StepLoader(rows, args.batch_size, args.accum, 0, 1)
    if variant == "ours":  # everything the trainer does; compile only where the trainer compiles
        variant = "+compile" if args.compile_ours else "+prefetch"
    level = VARIANTS.index(variant)
    model = tg.GPT(cfg).to(device)
    rss_model = peak_memory_mb(device)
    if level >= VARIANTS.index("+fused"):
        optimizer = tg.build_optimizer(model, 0.1, 6e-4, device_type)
    else:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        other = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [dict(params=decay, weight_decay=0.1), dict(params=other, weight_decay=0.0)],
            lr=6e-4,
            betas=(0.9, 0.95),
            eps=1e-8,
            fused=False,
        )
    chunked = level >= VARIANTS.index("+chunked") and (device_type == "cpu" or args.chunk_on_cuda)
    loss_chunk = args.loss_chunk if chunked else 0
    train_model = model
    if level >= VARIANTS.index("+compile"):
        train_model = tg.compile_model(model)  # the trainer's compile (the chunked loss eager)
    prefetcher = (
        tg.Prefetcher(loader, pin_memory=device_type == "cuda") if level >= VARIANTS.index("+prefetch") else None
    )

    def step(s):
        if level < VARIANTS.index("+chunked"):
            # the reference loop: each micro-batch's mean loss divided by the number of steps
            loss_accum = torch.zeros((), device=device)
            for m in range(args.accum):
                x, y = (torch.from_numpy(a).to(device) for a in loader.micro_batch(s, m))
                with torch.autocast(device_type, dtype, enabled=dtype != torch.float32):
                    _, loss = train_model(x, y)
                loss = loss / args.accum
                loss_accum += loss.detach()
                loss.backward()
        else:
            batches, n_tokens = (
                prefetcher.get(s)
                if prefetcher
                else ([loader.micro_batch(s, m) for m in range(args.accum)], loader.step_tokens(s))
            )
            loss_accum = tg.accumulate_gradients(train_model, batches, n_tokens, 1, device, dtype, loss_chunk)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result = (loss_accum.item(), norm.item())
        if device_type == "cuda":
            torch.cuda.synchronize()
        return result

    t0 = time.perf_counter()
    for s in range(args.warmup):
        step(s)
    compile_s = time.perf_counter() - t0 if level >= VARIANTS.index("+compile") else 0.0
    times = []
    for s in range(args.warmup, args.warmup + args.steps):
        t = time.perf_counter()
        step(s)
        times.append(time.perf_counter() - t)
    if prefetcher:
        prefetcher.close()
    tokens = args.batch_size * args.seq_len * args.accum
    dt = float(np.median(times))
    return dict(
        tok_per_s=tokens / dt,
        step_ms=1000 * dt,
        peak_mb=peak_memory_mb(device),
        model_mb=rss_model,
        compile_s=compile_s,
        flops_per_token=tg.flops_per_token(cfg, args.seq_len, model.num_params()),
    )


def sgemm_flops(n=2048, repeats=5):
    """FLOP/s of this machine's fp32 matmul (n x n by n x n, best of repeats), in this process's threads:
    the ceiling a CPU step's model FLOP/s is measured against."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def bench_loader(args):
    """Rows/s and resident memory of the memory-mapped loader, for two shard sizes: anonymous
    memory (ours) must not grow with the shard; mapped file pages are reclaimable page cache."""
    results = []
    for n_tokens in (10_000_000, 100_000_000):
        with tempfile.TemporaryDirectory() as d:
            np.save(
                os.path.join(d, "x_train_000000.npy"),
                np.random.default_rng(0).integers(0, 50257, n_tokens, dtype=np.uint16),
            )
            out = subprocess.run([sys.executable, __file__, "--loader-worker", d], capture_output=True, text=True)
            results.append(dict(shard_tokens=n_tokens, **json.loads(out.stdout.splitlines()[-1])))
    for r in results:
        print(
            f"shard {r['shard_tokens'] / 1e6:5.0f}M tokens | {r['rows_per_s']:10,.0f} rows/s (shuffled, B=64, "
            f"T=1024) | RSS: anonymous {r['anon_mb']:.0f} MB, mapped shard pages {r['file_mb']:.0f} MB"
        )


def bench_eval(args):
    """Validation's forward under no_grad: full logits, the chunked loss, and the chunked loss made
    to do its gradient work as it did before it checked for no_grad (interleaved rounds, best of each)."""
    import torch
    from trainkit.runtime import kernels
    import train_gpt2 as tg

    torch.manual_seed(0)
    cfg = tg.GPTConfig(**tg.MODEL_PRESETS[args.model])
    model = tg.GPT(cfg).to(args.device).eval()
    x = torch.randint(0, 50257, (args.batch_size, args.seq_len), device=args.device)
    grad_work = kernels.ChunkedLinearCrossEntropy.apply  # the gradient path, whatever the grad mode
    variants = dict(
        full=(0, kernels.chunked_lm_loss),
        chunked=(args.loss_chunk, kernels.chunked_lm_loss),
        chunked_grad_work=(args.loss_chunk, grad_work),
    )
    best, losses = {}, {}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, (chunk, loss_fn) in variants.items():
                model.lm_loss = loss_fn  # the instance's loss function, as compile_model sets it
                t = time.perf_counter()
                _, loss = model(x, x, reduction="sum", loss_chunk=chunk)
                losses[name] = loss.item()
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    print(
        f"device {args.device} | model {args.model} | B={args.batch_size} T={args.seq_len} | no_grad forward "
        f"+ loss, best of {args.rounds} | chunk {args.loss_chunk} rows"
    )
    for name, dt in best.items():
        print(f"{name:18s} | {1000 * dt:8.1f} ms | {best['full'] / dt:.2f}x full logits | loss {losses[name]:.6f}")


def bench_lm_head(args):
    """One loss chunk's three lm_head matmuls (logits, input gradient, weight gradient, as
    chunked_loss does them) against the padded weight's 50304 rows and its first 50257, in fp32:
    interleaved rounds, the best of each."""
    import torch
    import train_gpt2 as tg

    torch.manual_seed(0)
    C = tg.MODEL_PRESETS[args.model]["n_embd"]
    weight, h = torch.randn(50304, C) * 0.02, torch.randn(args.loss_chunk, C)
    grad_w = torch.zeros(50304, C)
    variants = {"50304 rows (padded)": (weight, grad_w), "50257 rows (real)": (weight[:50257], grad_w[:50257])}
    best = {}
    for _ in range(args.rounds):
        for name, (w, gw) in variants.items():
            for _ in range(5):
                t = time.perf_counter()
                logits = h @ w.t()
                logits @ w
                gw.addmm_(logits.t(), h)
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    print(
        f"lm_head of one {args.loss_chunk}-row chunk, n_embd {C} ({args.model}), {torch.get_num_threads()} threads, "
        f"best of {args.rounds} rounds x 5 | load {os.getloadavg()[0]:.1f}"
    )
    padded = best["50304 rows (padded)"]
    for name, dt in best.items():
        print(f"{name:20s} | {1000 * dt:7.2f} ms | {dt / padded:.3f}x the padded shape's time")


def loader_worker(data_dir):
    import train_gpt2 as tg

    rows = tg.TokenRows(data_dir, "train", 1024, shuffle=True, seed=0)
    t = time.perf_counter()
    n = 0
    while time.perf_counter() - t < 3:
        rows.batch(n, 64)
        n += 64
    rate = n / (time.perf_counter() - t)
    with open("/proc/self/status") as f:  # anonymous memory is ours; file pages are the OS page cache
        status = dict(line.split(":", 1) for line in f)
    kb = lambda key: int(status[key].split()[0]) / 1024
    print(json.dumps(dict(rows_per_s=rate, anon_mb=kb("RssAnon"), file_mb=kb("RssFile"))))


def main():
    p = cli.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--model", default=None, help="preset (default: cpu on CPU, gpt2 on CUDA)")
    p.add_argument("--batch-size", type=int, default=None, help="rows per micro-step (default 8 CPU, 16 CUDA)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 256 CPU, 1024 CUDA)")
    p.add_argument("--accum", type=int, default=2, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (compilation happens here)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every variant; best counts")
    p.add_argument("--variants", default=",".join(VARIANTS + ["ours"]), help="comma-separated subset")
    p.add_argument("--chunk-on-cuda", action="store_true", help="also use the chunked loss on CUDA")
    p.add_argument(
        "--loss-chunk",
        type=int,
        default=None,
        help="rows per chunk of the chunked loss (default: the trainer's CPU default)",
    )
    p.add_argument(
        "--compile-ours",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile in 'ours' (default: as the trainer does, on CUDA only)",
    )
    p.add_argument("--loader", action="store_true", help="benchmark the data loader instead")
    p.add_argument("--eval", action="store_true", help="benchmark validation's no_grad loss instead")
    p.add_argument("--lm-head", action="store_true", help="benchmark one loss chunk's lm_head matmuls instead")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--loader-worker", help=argparse.SUPPRESS)
    p.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.loader_worker:
        return loader_worker(args.loader_worker)
    if args.loader:
        return bench_loader(args)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = args.device.startswith("cuda")
    args.model = args.model or ("gpt2" if cuda else "cpu")
    args.batch_size = args.batch_size or (16 if cuda or args.eval else 8)
    args.seq_len = args.seq_len or (1024 if cuda else 256)
    if args.compile_ours is None:
        args.compile_ours = cuda
    if args.loss_chunk is None:
        import train_gpt2

        args.loss_chunk = train_gpt2.CPU_LOSS_CHUNK
    if args.worker:
        print(json.dumps(run_variant(args.worker, args)))
        return
    if args.eval:
        return bench_eval(args)
    if args.lm_head:
        return bench_lm_head(args)
    with tempfile.TemporaryDirectory() as data_dir:
        tokens = args.batch_size * args.seq_len * args.accum * (args.warmup + args.steps + 2)
        np.save(
            os.path.join(data_dir, "bench_train_000000.npy"),
            np.random.default_rng(0).integers(0, 50257, tokens, dtype=np.uint16),
        )
        print(
            f"device {args.device} | model {args.model} | B={args.batch_size} T={args.seq_len} "
            f"accum={args.accum} | {torch.get_num_threads()} threads | median of {args.steps} steps"
        )
        best, sgemm = {}, 0.0
        for _ in range(args.rounds):  # interleaved rounds, best of each: load from elsewhere hits all alike
            sgemm = max(sgemm, sgemm_flops()) if not cuda else sgemm
            for variant in args.variants.split(","):
                r = run_worker(variant, data_dir, args)
                if r and (variant not in best or r["tok_per_s"] > best[variant]["tok_per_s"]):
                    best[variant] = r
        ref = best.get("reference") or next(iter(best.values()))
        for variant, r in best.items():
            extra = f" | compile {r['compile_s']:.1f}s" if r["compile_s"] else ""
            if sgemm:  # model FLOPs (6 per parameter per token + attention) per second, against the matmul's
                extra += f" | {100 * r['flops_per_token'] * r['tok_per_s'] / sgemm:.0f}% of sgemm"
            print(
                f"{variant:10s} | {r['tok_per_s']:10,.0f} tok/s ({r['tok_per_s'] / ref['tok_per_s']:.2f}x) | "
                f"step {r['step_ms']:8.1f} ms | peak mem {r['peak_mb']:7.0f} MB ({r['peak_mb'] / ref['peak_mb']:.2f}x, "
                f"above model {r['peak_mb'] - r['model_mb']:6.0f} MB){extra}",
                flush=True,
            )
        if sgemm:
            print(
                f"sgemm (fp32 2048^3 matmul, best of {5 * args.rounds}): {sgemm / 1e9:.1f} GFLOP/s | load "
                f"{os.getloadavg()[0]:.1f}"
            )


def run_worker(variant, data_dir, args):
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--data-dir",
        data_dir,
        "--device",
        args.device,
        "--model",
        args.model,
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--accum",
        str(args.accum),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--loss-chunk",
        str(args.loss_chunk),
        "--compile-ours" if args.compile_ours else "--no-compile-ours",
    ]
    if args.chunk_on_cuda:
        cmd.append("--chunk-on-cuda")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        print(f"{variant}: failed\n{out.stderr[-2000:]}")
        return None
    return json.loads(out.stdout.splitlines()[-1])


if __name__ == "__main__":
    main()
