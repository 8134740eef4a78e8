"""The trainer's torch.compile, one block at a time (device.compile_model), against the whole GPT
compiled as one graph (what the trainer did before) and eager; and when DDP's all-reduces start.

    python benchmarks/bench_compile.py              # CPU preset on CPU (GPT-2 124M on CUDA), 3 rounds
    python benchmarks/bench_compile.py --overlap    # 2 gloo ranks: DDP's all-reduces vs the blocks' backward

Each variant runs in its own process with an empty inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR,
the FX graph and AOT autograd caches off), so every round compiles from scratch. Rounds interleave
the variants and each variant keeps its best round: the host's load swings single runs. Per
variant: the first step's seconds (compile included), compile seconds (the first step minus the
median of the others), tokens/s over the steps after the first, and the largest relative
difference of its losses from eager's (same init, same batches, an AdamW update between steps).

--overlap runs one DDP step per compile variant on 2 gloo ranks and prints, from the start of
backward, when each block's gradients land and when each of DDP's buckets starts its all-reduce
(a comm hook): the backward runs from the last block to the first, so overlap means the first
all-reduce starts before block 0's gradients land.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainkit import cli  # noqa: E402

VARIANTS = ["eager", "graph", "blocks"]  # graph: the whole GPT as one torch.compile graph
NO_CACHE = dict(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")


def build(variant, args):
    """(bare GPT, what the step runs) for a variant, on args.device."""
    import torch
    from trainkit.runtime import kernels
    import train_gpt2 as tg

    torch.manual_seed(0)
    cfg = tg.GPTConfig(**{**tg.MODEL_PRESETS[args.model], **({"n_layer": args.n_layer} if args.n_layer else {})})
    model = tg.GPT(cfg).to(args.device)
    if variant == "graph":  # as the trainer compiled before: the whole GPT, the chunked loss left eager
        model.lm_loss = torch.compiler.disable(kernels.chunked_lm_loss)
        return model, torch.compile(model, backend=args.backend)
    return model, (tg.compile_model(model, backend=args.backend) if variant == "blocks" else model)


def run_variant(variant, args):
    """Train args.steps steps on fixed random batches; prints one JSON line of step times and losses."""
    import torch
    from trainkit.runtime import device
    import train_gpt2 as tg

    device_type = "cuda" if args.device.startswith("cuda") else "cpu"
    dtype = device.resolve_dtype(
        "auto", device_type, torch.cuda.get_device_capability() if device_type == "cuda" else None
    )
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")
    model, step_model = build(variant, args)
    optimizer = tg.build_optimizer(model, 0.1, 6e-4, device_type)
    g = torch.Generator().manual_seed(1)
    batches = [
        tuple(torch.randint(0, 50257, (args.batch_size, args.seq_len), generator=g) for _ in "xy")
        for _ in range(args.steps)
    ]
    n_tokens = args.batch_size * args.seq_len
    times, losses = [], []
    for x, y in batches:
        t = time.perf_counter()
        loss_sum = tg.accumulate_gradients(step_model, [(x, y)], n_tokens, 1, args.device, dtype, args.loss_chunk)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum.item() / n_tokens)  # the host sync: the step is done
        times.append(time.perf_counter() - t)
    print(json.dumps(dict(times=times, losses=losses)))


def bench(args):
    """Interleaved rounds of every variant, each in a fresh process with an empty inductor cache."""
    best = {}
    for r in range(args.rounds):
        for variant in args.variants:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, **NO_CACHE)
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, *args.passthrough]
                result = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if result.returncode:
                sys.exit(f"{variant} failed:\n{result.stderr[-3000:]}")
            out = json.loads(result.stdout.strip().splitlines()[-1])
            later = out["times"][1:]
            run = dict(
                first_s=out["times"][0],
                compile_s=out["times"][0] - statistics.median(later),
                tok_per_s=args.batch_size * args.seq_len / min(later),
                losses=out["losses"],
            )
            print(
                f"round {r + 1} {variant:6s} | first step {run['first_s']:6.1f} s | {run['tok_per_s']:9,.0f} tok/s",
                flush=True,
            )
            b = best.setdefault(variant, run)
            b.update(
                first_s=min(b["first_s"], run["first_s"]),
                compile_s=min(b["compile_s"], run["compile_s"]),
                tok_per_s=max(b["tok_per_s"], run["tok_per_s"]),
            )
    depth = f" with {args.n_layer} blocks" if args.n_layer else ""
    print(
        f"device {args.device} | model {args.model}{depth} | B={args.batch_size} T={args.seq_len} | loss chunk "
        f"{args.loss_chunk} | {args.steps} steps | backend {args.backend} | best of {args.rounds} rounds, "
        f"empty inductor cache"
    )
    ref = best.get("eager")
    for variant, b in best.items():
        drift = max(abs(a - e) / abs(e) for a, e in zip(b["losses"], ref["losses"])) if ref else float("nan")
        ratios = ""
        if "graph" in best and variant not in ("eager", "graph"):
            ratios = (
                f" | compile {best['graph']['compile_s'] / max(b['compile_s'], 1e-9):5.2f}x faster than graph, "
                f"{b['tok_per_s'] / best['graph']['tok_per_s']:.2f}x its tok/s"
            )
        print(
            f"{variant:6s} | first step {b['first_s']:6.1f} s | compile {b['compile_s']:6.1f} s | "
            f"{b['tok_per_s']:9,.0f} tok/s ({b['tok_per_s'] / ref['tok_per_s'] if ref else float('nan'):.2f}x eager) "
            f"| loss drift from eager {drift:.1e}{ratios}"
        )
        b["drift"] = drift
    return best


def overlap_worker(rank, world, port, args):
    """One rank of --overlap: per compile variant, a warm-up step, then one timed DDP step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for variant in ("graph", "blocks"):
        model, step_model = build(variant, args)
        ddp = DDP(step_model)
        events = []

        def comm_hook(state, bucket):
            events.append((time.perf_counter(), f"all-reduce of bucket {bucket.index()} starts"))
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, comm_hook)
        for i, block in enumerate(model.transformer.h):
            for p in block.parameters():
                p.register_post_accumulate_grad_hook(lambda p, i=i: events.append((time.perf_counter(), f"block {i}")))
        x = torch.randint(0, 50257, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):  # the first step compiles
            events.clear()
            _, loss = ddp(x, x, reduction="sum", loss_chunk=args.loss_chunk)
            t0 = time.perf_counter()
            loss.backward()
            t_end = time.perf_counter()
            model.zero_grad(set_to_none=True)
        if rank == 0:
            landed = {}  # a block's gradients have landed when its last parameter's has
            for t, what in events:
                if what.startswith("block"):
                    landed[what] = t
            lines = sorted(
                [(t, f"{what} gradients landed") for what, t in landed.items()]
                + [(t, what) for t, what in events if what.startswith("all-reduce")]
            )
            first_reduce = min(t for t, what in events if what.startswith("all-reduce"))
            print(
                f"{variant}: backward {1000 * (t_end - t0):.1f} ms; the first all-reduce starts "
                f"{1000 * (landed['block 0'] - first_reduce):.1f} ms before block 0's gradients land "
                f"({'overlap' if first_reduce < landed['block 0'] else 'NO overlap'})"
            )
            for t, what in lines:
                print(f"  +{1000 * (t - t0):8.1f} ms  {what}")
    dist.destroy_process_group()


def main(argv=None) -> dict | None:
    """The benchmark's best figures per variant (None for --overlap and --worker)."""
    p = cli.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--overlap", action="store_true", help="DDP on 2 gloo ranks: all-reduce starts vs the blocks")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--model", default=None, help="a train_gpt2.py preset (default: cpu on CPU, gpt2 on CUDA)")
    p.add_argument("--n-layer", type=int, help="blocks (default: the preset's); the graph's compile grows with it")
    p.add_argument("--batch-size", type=int, default=None, help="default: 8 on CPU, 16 on CUDA")
    p.add_argument("--seq-len", type=int, default=None, help="default: 256 on CPU, 1024 on CUDA")
    p.add_argument("--loss-chunk", type=int, default=None, help="default: the trainer's (128 on CPU, 0 on CUDA)")
    p.add_argument("--steps", type=int, default=5, help="steps per variant; the first compiles")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument(
        "--json", metavar="PATH", help="also write the best figures per variant to PATH (gpu_check.py reads it)"
    )
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.overlap
    args.device = args.device or ("cuda" if cuda else "cpu")
    on_cuda = args.device.startswith("cuda")
    args.model = args.model or ("gpt2" if on_cuda else "cpu")
    args.batch_size = args.batch_size or (16 if on_cuda else 8)
    args.seq_len = args.seq_len or (1024 if on_cuda else 256)
    args.loss_chunk = args.loss_chunk if args.loss_chunk is not None else (0 if on_cuda else 128)
    args.variants = args.variants.split(",")
    if set(args.variants) - set(VARIANTS):
        p.error(f"--variants: expected some of {', '.join(VARIANTS)}")
    args.passthrough = [
        f"--device={args.device}",
        f"--model={args.model}",
        f"--n-layer={args.n_layer or 0}",
        f"--batch-size={args.batch_size}",
        f"--seq-len={args.seq_len}",
        f"--loss-chunk={args.loss_chunk}",
        f"--steps={args.steps}",
        f"--backend={args.backend}",
    ]
    if args.worker:
        return run_variant(args.worker, args)
    if args.overlap:
        import socket
        import torch.multiprocessing as mp

        with socket.socket() as s:  # a free port for the process group
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        print(
            f"DDP on 2 gloo ranks | model {args.model} | B={args.batch_size} T={args.seq_len} | backend {args.backend}"
        )
        mp.spawn(overlap_worker, args=(2, port, args), nprocs=2, join=True)
        return
    best = bench(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(best, f)
    return best


if __name__ == "__main__":
    main()
