"""How each start-up and I/O cost grows with the work, from 100M to 10B tokens (not a test).

The real job reads ~100 shards of 100M tokens (FineWeb-Edu sample-10BT). This builds synthetic
llm.c .bin shards of --shard-tokens tokens (random ids, an <|endoftext|> every ~1,000 tokens on
average), writes --real-files of them and makes each size's folder of hard links to those files
(10 x 200 MB stand in for 20 GB), with no manifest.json, as llm.c's and other tools' shards come.
Then, for every size x mode (plain, --align-docs, --doc-mask), the trainer with the CPU preset
(7M parameters, --max-steps 1) is launched twice on the same data, each time into a fresh
--out-dir with the same cache folder (XDG_CACHE_HOME): the first launch meets the data for the
first time, the second is what a resume or a requeued job pays. Measured from outside the
trainer: seconds from launch to its "step 0" line, and the largest anonymous (private:
RssAnon) and file-backed (RssFile: the mapped shards' pages, shared with the page cache)
memory of the process, sampled every 20 ms from /proc; beside them, the peak memory the
trainer itself reports. Then checkpoint save and load time and size for the gpt2 and
gpt2-medium shapes (weights and AdamW state, on CPU), HellaSwag examples per second
(benchmarks/bench_hellaswag.py) and fineweb.py tokens per second on one worker
(benchmarks/bench_fineweb.py, --fineweb-mb of text).

The 10B/1B ratio column flags (<-- tokens) a cost that grows like the tokens (ratio >= 5) where
it should grow like the shards or not at all (second launch, memory).

    python benchmarks/bench_scale.py                                  # 100M / 1B / 10B tokens, everything
    python benchmarks/bench_scale.py --sizes 100M,1B --skip ckpt,fineweb
    python benchmarks/bench_scale.py --trainer-root /tmp/old-checkout  # the same table for another checkout

Needs --real-files x --shard-tokens x 2 bytes of disk (2 GB by default) under --work-dir, removed
at the end unless --keep. Timings on a shared machine are noisy: compare rows of one run.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
EOT = 50256
BIN_MAGIC, BIN_VERSION, BIN_HEADER_INTS = 20240520, 1, 256
MODES = {"plain": [], "align-docs": ["--align-docs"], "doc-mask": ["--doc-mask"]}


def tokens_arg(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMB]?)", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: a token count like 100M or 10B")
    return int(float(m[1]) * {"": 1, "K": 10**3, "M": 10**6, "B": 10**9}[m[2]])


def label(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def write_bin(path: Path, tokens: np.ndarray):
    header = np.zeros(BIN_HEADER_INTS, dtype="<i4")
    header[:3] = BIN_MAGIC, BIN_VERSION, tokens.size
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def synthetic_tokens(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, EOT, size=n, dtype=np.uint16)
    tokens[rng.integers(0, n, size=n // 1000)] = EOT  # documents of ~1,000 tokens, FineWeb-Edu's average
    tokens[0] = EOT
    return tokens


def make_folders(work: Path, sizes: list[int], shard_tokens: int, real_files: int) -> dict[int, Path]:
    """One folder per size: ceil(size / shard_tokens) train shards (hard links to real_files files)
    and one small val shard."""
    real = work / "real"
    real.mkdir(parents=True, exist_ok=True)
    needed = min(real_files, max(-(-s // shard_tokens) for s in sizes))
    for i in range(needed):
        path = real / f"shard_{i:03d}.bin"
        if not path.exists():
            write_bin(path, synthetic_tokens(shard_tokens, seed=i))
    val = real / "val.bin"
    if not val.exists():
        write_bin(val, synthetic_tokens(1 << 20, seed=10**6))
    folders = {}
    for size in sizes:
        folder = work / f"data_{label(size)}"
        if not folder.exists():
            folder.mkdir()
            for i in range(-(-size // shard_tokens)):
                os.link(real / f"shard_{i % needed:03d}.bin", folder / f"synthetic_train_{i:06d}.bin")
            os.link(val, folder / "synthetic_val_000000.bin")
        folders[size] = folder
    return folders


def proc_status_kb(pid: int, keys=("RssAnon", "RssFile")) -> dict[str, int]:
    values = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in keys:
                    values[key] = int(rest.split()[0])
    except (OSError, ValueError):
        pass
    return values


def launch(trainer_root: Path, data: Path, out_dir: Path, cache: Path, mode: list[str], timeout: float) -> dict:
    """One trainer launch: seconds to its "step 0" line, peak RssAnon / RssFile (GiB) sampled from
    /proc, the peak memory it reports, and its start-up progress lines."""
    cmd = [
        sys.executable,
        str(trainer_root / "train_gpt2.py"),
        "--model",
        "cpu",
        "--data-dir",
        str(data),
        "--out-dir",
        str(out_dir),
        "--max-steps",
        "1",
        "--batch-size",
        "4",
        "--total-batch-size",
        "1024",
        "--val-every",
        "0",
        "--hellaswag-every",
        "0",
        "--sample-every",
        "0",
        "--ckpt-every",
        "0",
        "--device",
        "cpu",
        "--no-compile",
        *mode,
    ]
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=trainer_root)
    peaks = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            for key, kb in proc_status_kb(proc.pid).items():
                peaks[key] = max(peaks[key], kb)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    first_step, reported, lines = None, None, []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    for line in proc.stdout:
        lines.append(line.rstrip())
        if first_step is None and re.match(r"step\s+0\b", line.strip()):
            first_step = time.perf_counter() - t0
        m = re.search(r"peak memory (.*)$", line)
        if m:
            reported = m[1].strip()
    proc.wait()
    timer.cancel()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        print("\n".join(lines[-15:]), file=sys.stderr)
    return dict(
        first_step=first_step,
        rc=proc.returncode,
        anon=peaks["RssAnon"] / 2**20,
        file=peaks["RssFile"] / 2**20,
        reported=reported or "-",
        progress=[ln for ln in lines if re.search(r"\d+/\d+", ln) and "step" not in ln[:6]],
    )


def ratio_cell(values: dict[int, float], sizes: list[int], grows_like_shards: bool) -> str:
    """10B/1B (the two largest sizes) and a flag where a cost grows like the tokens."""
    big = [s for s in sizes if values.get(s)]
    if len(big) < 2:
        return "-"
    a, b = values[big[-2]], values[big[-1]]
    r = b / a
    flag = " <-- tokens" if grows_like_shards and r >= 0.5 * big[-1] / big[-2] else ""
    return f"{r:.1f}x{flag}"


def bench_launches(args, folders) -> list[str]:
    rows = [
        f"| mode | measure | {' | '.join(label(s) for s in args.sizes)} | "
        f"{label(args.sizes[-1])}/{label(args.sizes[-2]) if len(args.sizes) > 1 else '-'} |",
        "| --- | --- |" + " --- |" * (len(args.sizes) + 1),
    ]
    for mode in args.modes:
        results = {}
        for size in args.sizes:
            cache = Path(tempfile.mkdtemp(dir=args.work_dir, prefix="cache_"))
            runs = []
            for launch_no in (1, 2):
                out = Path(tempfile.mkdtemp(dir=args.work_dir, prefix="out_"))
                r = launch(args.trainer_root, folders[size], out, cache, MODES[mode], args.timeout)
                shutil.rmtree(out, ignore_errors=True)
                runs.append(r)
                print(
                    f"  {mode:10s} {label(size):>5s} launch {launch_no}: step 0 at "
                    f"{r['first_step'] if r['first_step'] is None else round(r['first_step'], 1)} s, "
                    f"anon {r['anon']:.2f} GiB, file {r['file']:.2f} GiB, reported {r['reported']}, rc {r['rc']}",
                    flush=True,
                )
                for line in r["progress"][:3]:
                    print(f"      | {line[:150]}", flush=True)
            shutil.rmtree(cache, ignore_errors=True)
            results[size] = runs
        measures = [
            ("first launch: s to step 0", lambda r: r[0]["first_step"], True),
            ("second launch: s to step 0", lambda r: r[1]["first_step"], True),
            ("peak private memory (RssAnon), GiB", lambda r: max(x["anon"] for x in r), True),
            ("peak mapped file pages (RssFile), GiB", lambda r: max(x["file"] for x in r), False),
        ]
        for name, get, flagged in measures:
            values = {s: get(results[s]) for s in args.sizes}
            cells = [f"{values[s]:.2f}" if values[s] is not None else "failed" for s in args.sizes]
            rows.append(f"| {mode} | {name} | {' | '.join(cells)} | {ratio_cell(values, args.sizes, flagged)} |")
        cells = [results[s][1]["reported"] for s in args.sizes]
        rows.append(f"| {mode} | peak memory the trainer reports (2nd launch) | {' | '.join(cells)} | |")
    return rows


CKPT_SHAPES = {"gpt2": dict(n_layer=12, n_head=12, n_embd=768), "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024)}


def bench_checkpoints(args) -> list[str]:
    """Save and load time and size of a checkpoint of each shape: weights and AdamW's two moments."""
    code = r"""
import sys, time, os, torch
sys.path.insert(0, sys.argv[1])
from train_gpt2 import GPT, GPTConfig
from trainkit.runfiles.checkpoints import full_state, save_checkpoint, load_checkpoint
cfg = GPTConfig(block_size=1024, vocab_size=50304, **eval(sys.argv[2]))
model = GPT(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for p in model.parameters():
    p.grad = torch.zeros_like(p)
opt.step()
params = sum(p.numel() for p in model.parameters())
model_state, optim_state = full_state(model, opt)
state = dict(model=model_state, optimizer=optim_state, step=1, model_config=cfg.__dict__)
path = os.path.join(sys.argv[3], "ckpt_000001.pt")
t = time.perf_counter(); save_checkpoint(path, state); save = time.perf_counter() - t
size = os.path.getsize(path)
del state, model_state, optim_state
t = time.perf_counter(); load_checkpoint(path); load = time.perf_counter() - t
print(f"RESULT {params} {save:.2f} {load:.2f} {size}")
"""
    rows = ["| shape | parameters | save s | load s | size GB | save s per 100M params |", "| --- |" + " --- |" * 5]
    for shape in args.ckpt_shapes:
        folder = Path(tempfile.mkdtemp(dir=args.work_dir, prefix="ckpt_"))
        out = subprocess.run(
            [sys.executable, "-c", code, str(args.trainer_root), repr(CKPT_SHAPES[shape]), str(folder)],
            capture_output=True,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        shutil.rmtree(folder, ignore_errors=True)
        m = re.search(r"RESULT (\d+) ([\d.]+) ([\d.]+) (\d+)", out.stdout)
        if not m:
            rows.append(f"| {shape} | failed: {(out.stderr.strip().splitlines() or ['?'])[-1][:100]} | | | | |")
            continue
        params, save, load, size = int(m[1]), float(m[2]), float(m[3]), int(m[4])
        rows.append(
            f"| {shape} | {params / 1e6:.0f}M | {save:.1f} | {load:.1f} | {size / 1e9:.2f} | "
            f"{save / params * 1e8:.2f} |"
        )
        print(f"  checkpoint {shape}: {rows[-1]}", flush=True)
    return rows


def bench_script(args, script: str, script_args: list[str], env_extra=None) -> str:
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *script_args],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {})),
    )
    return (out.stdout + out.stderr).strip()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100M,1B,10B", help="token counts of the train folders")
    p.add_argument("--shard-tokens", type=tokens_arg, default=10**8)
    p.add_argument("--real-files", type=int, default=10, help="distinct shard files; the rest are hard links")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--ckpt-shapes", default="gpt2,gpt2-medium")
    p.add_argument("--hellaswag-examples", type=int, default=200)
    p.add_argument("--fineweb-mb", type=int, default=1000, help="MB of text for fineweb.py (the issue's 1 GB)")
    p.add_argument("--skip", default="", help="comma-separated: launches,ckpt,hellaswag,fineweb")
    p.add_argument("--trainer-root", type=Path, default=REPO, help="the checkout whose trainer is launched")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench_scale")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one launch may take")
    p.add_argument("--keep", action="store_true", help="keep the synthetic shards for the next run")
    args = p.parse_args()
    args.sizes = sorted(tokens_arg(s) for s in args.sizes.split(","))
    args.modes = [m for m in args.modes.split(",") if m]
    args.ckpt_shapes = [s for s in args.ckpt_shapes.split(",") if s]
    skip = set(args.skip.split(","))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"trainer: {args.trainer_root}; work dir {args.work_dir}; load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} cores (timings on a shared machine are noisy)",
        flush=True,
    )
    report = []
    try:
        if "launches" not in skip:
            t = time.perf_counter()
            folders = make_folders(args.work_dir, args.sizes, args.shard_tokens, args.real_files)
            print(f"synthetic shards ready in {time.perf_counter() - t:.0f} s", flush=True)
            report += ["", "start-up and memory, CPU preset, --max-steps 1:", *bench_launches(args, folders)]
        if "ckpt" not in skip:
            report += ["", "checkpoints (weights + AdamW state, CPU):", *bench_checkpoints(args)]
        if "hellaswag" not in skip:
            out = bench_script(
                args,
                "bench_hellaswag.py",
                ["--examples", str(args.hellaswag_examples), "--batch-sizes", "16", "--repeats", "1", "--threads", "1"],
            )
            report += ["", "HellaSwag (bench_hellaswag.py, 4 x 128 model, 1 thread):", *out.splitlines()[-6:]]
        if "fineweb" not in skip:
            out = bench_script(
                args,
                "bench_fineweb.py",
                ["--workers", "1", "--repeats", "1", "--corpus", "pages"],
                {"BENCH_MB": str(args.fineweb_mb)},
            )
            report += [
                "",
                f"fineweb.py, one worker, {args.fineweb_mb} MB of text (bench_fineweb.py):",
                *out.splitlines()[-8:],
            ]
    finally:
        if not args.keep:
            shutil.rmtree(args.work_dir, ignore_errors=True)
    print("\n".join(report))


if __name__ == "__main__":
    main()
