"""The CUDA paths of the trainer on the GPU at hand, most important first, in one short lease.

    python benchmarks/gpu_check.py                    # one GPU: at most ~7 minutes from a cold inductor cache
    python benchmarks/gpu_check.py --report DIR       # the report (Markdown + JSON) in DIR (default: $OUT, if set)
    python benchmarks/gpu_check.py --groups 6,7       # what a first lease had to skip, on the next one

Every variant is the real command (`python train_gpt2.py ...`) on one synthetic data set, for a few
steps, in its own process; all of them share one inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR,
FX graph and AOT autograd caches on), so a variant whose graph an earlier one compiled loads it.
In the order a user needs the answers (the group numbers of --groups):

  1. the default path, as users run it: `python train_gpt2.py --model gpt2` (bf16, per-block
     compile, --batch-size auto at the recipe's 524,288 tokens per step): loss drift against an
     eager fp32 reference on the same rows, tok/s, MFU, peak memory, compile seconds (on this path:
     the micro-batch search, whose trials compile) and the micro-batch it chose;
  2. AdamW at one micro-batch (bf16, compiled: the yardstick of 2 and 3) and --optimizer muon
     (its step time against AdamW's);
  3. --doc-mask with FlexAttention, compiled (tok/s against the yardstick's causal attention, loss
     drift against a reference that masks too);
  4. fp16 with the GradScaler, eager;
  5. an out-of-memory forced mid-run (benchmarks/squeeze_memory.py leaves 60% of a step's need free
     before step 2): the step redone at half the micro-batch, with the same losses;
  6. per-block compile against the whole graph and eager (benchmarks/bench_compile.py, one round,
     each from an empty cache: compile seconds, tok/s);
  7. the rest of the matrix, as time allows: bf16 eager, SDPA's document mask, the chunked loss,
     fp16 compiled and with Muon, the micro-batch auto finds on 24 GiB of the GPU, and on several
     visible GPUs torchrun (NCCL) with DDP, --fsdp and Muon.

Groups 2-7 run at --batch-size rows per micro-step (default: what group 1 chose, at most 64), one
micro-step per step. A reference (eager fp32, B/4 rows x 4 micro-steps: the same rows and losses)
runs once per set of loss-changing flags (Muon, --doc-mask) and step size. Each line gives the
largest relative difference of the variant's losses from its reference, tok/s (in all and per GPU)
and MFU (mean over the steps after the first), peak memory, compile seconds (the first step minus
the median of the others) and the micro-batch trained at.

The time budget (--budget-s, default 400 s): a variant starts only if its estimated seconds (the
table below, scaled by how the variants so far kept to theirs) fit in what is left of it; the first
always runs. One still running at the budget + 20 s is stopped. Skipped variants are listed, with
the command that runs them. With --report DIR (or $OUT) the report is rewritten after every variant:
gpu_check.md (the table, the commands, versions, nvidia-smi), gpu_check.json (the same as data), and
logs/ (each command's output). Exit code 1 if a variant failed or drifted beyond its dtype's
tolerance, 2 if a package the check needs is missing (said in the first line).

Without CUDA it runs a CPU subset with a 2-layer model (the same order, groups 1-4 and 7, eager),
which the tests run, so it keeps working.
"""

import datetime
import importlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from trainkit import cli  # noqa: E402

NEEDED = ("numpy", "torch", "tiktoken")  # what the trainer imports beyond the standard library (not `datasets`)
RECIPE_TOKENS = 524288  # GPT-2 124M's tokens per step (the trainer's default --total-batch-size)
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}  # relative, over a few steps
GRACE_S = 20  # a variant still running at the budget + this is stopped
MUON = ["--optimizer", "muon"]
DOC_MASK = ["--doc-mask"]
GROUPS = {
    1: "the default path",
    2: "Muon against AdamW",
    3: "--doc-mask (FlexAttention)",
    4: "fp16 + GradScaler",
    5: "out of memory mid-run",
    6: "per-block compile vs the whole graph",
    7: "the rest of the matrix",
}


def train(group, name, est_s, dtype="bfloat16", compile=True, chunk=0, nproc=1, extra=(), **more) -> dict:
    """One trainer variant. dtype/compile/chunk None: the trainer's default (not passed). batch: "auto",
    or None for --batch-size; total: None for one micro-step of each rank, "recipe" for the trainer's default."""
    return dict(
        kind="train",
        group=group,
        name=name,
        est_s=est_s,
        dtype=dtype,
        compile=compile,
        chunk=chunk,
        nproc=nproc,
        extra=list(extra),
        **more,
    )


def plan(cuda: bool, n_gpus: int, compile_on_cpu: bool = False) -> list[dict]:
    """The variants in the order they run. est_s: estimated seconds on one H100 from a cold inductor
    cache, a first reference included (docs/performance.md: how they were estimated)."""
    if not cuda:  # eager, a 2-layer model; the default path's step is the others' (one reference for both)
        out = [
            train(
                1,
                "default path: --batch-size auto (CPU: bf16, eager)",
                10,
                batch="auto",
                compile=False,
                chunk=64,
                baseline=True,
            ),
            train(2, "--optimizer muon", 10, compile=False, chunk=64, extra=MUON),
            train(3, "--doc-mask", 10, compile=False, extra=DOC_MASK),
            train(4, "fp16 + GradScaler", 10, dtype="float16", compile=False),
            train(
                7,
                "fp32 --activation-checkpointing",
                10,
                dtype="float32",
                compile=False,
                chunk=64,
                extra=["--activation-checkpointing"],
            ),
        ]
        if compile_on_cpu:
            out.append(train(7, "fp32 compiled", 60, dtype="float32", chunk=64))
        return out
    out = [
        train(
            1,
            "default path: --model gpt2, 524,288 tok/step",
            150,
            dtype=None,
            compile=None,
            chunk=None,
            total="recipe",
            batch="auto",
            steps="recipe",
        ),
        train(2, "AdamW bf16 compiled (the yardstick)", 40, baseline=True),
        train(2, "--optimizer muon bf16 compiled", 35, extra=MUON),
        train(3, "--doc-mask FlexAttention compiled", 70, extra=DOC_MASK),
        train(4, "fp16 + GradScaler eager", 15, dtype="float16", compile=False),
        train(5, "out of memory before step 2 (bf16 compiled)", 50, squeeze=["--squeeze", "2:60%"]),
        dict(kind="bench_compile", group=6, name="bench_compile.py: blocks vs graph vs eager", est_s=110),
        train(7, "bf16 eager", 15, compile=False),
        train(7, "--doc-mask SDPA compiled", 45, extra=DOC_MASK, env={"DOC_MASK_KERNEL": "sdpa"}),
        train(7, "bf16 compiled, chunked loss", 40, chunk=8192),
        train(7, "--optimizer muon fp16 eager", 20, dtype="float16", compile=False, extra=MUON),
        train(
            7,
            "--batch-size auto on 24 GiB of the GPU",
            90,
            dtype=None,
            compile=None,
            chunk=None,
            total="recipe",
            batch="auto",
            steps=1,
            squeeze=["--squeeze", f"{24 * 1024}MiB"],
        ),
        train(7, "fp16 compiled", 40, dtype="float16"),
        train(7, "--doc-mask SDPA eager", 20, compile=False, extra=DOC_MASK),
        train(7, "bf16 eager, chunked loss", 15, compile=False, chunk=8192),
        train(7, "fp16 eager, chunked loss", 15, dtype="float16", compile=False, chunk=8192),
        train(7, "fp16 compiled, chunked loss", 40, dtype="float16", chunk=8192),
    ]
    if n_gpus > 1:
        out += [
            train(7, f"bf16 compiled, torchrun x{n_gpus}", 60, nproc=n_gpus),
            train(7, f"fp16 compiled, torchrun x{n_gpus}", 60, dtype="float16", nproc=n_gpus),
            train(7, f"--fsdp bf16 compiled, torchrun x{n_gpus}", 60, nproc=n_gpus, extra=["--fsdp"]),
            train(7, f"--optimizer muon bf16 compiled, torchrun x{n_gpus}", 60, nproc=n_gpus, extra=MUON),
        ]
    return out


# --- running a command within the budget -----------------------------------------------------------


def run_command(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str, str]:
    """(exit code, or None if stopped at the timeout; stdout; stderr). The command runs in its own
    process group, which is killed whole (torchrun's workers, bench_compile's) at the timeout or if
    this process is interrupted: nothing is left holding the GPU."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


class Budget:
    """Starts a variant only if its estimate, scaled by how the finished ones kept to theirs, fits in what
    is left of budget_s (the first always starts); gives each command until budget_s + GRACE_S."""

    def __init__(self, budget_s: float):
        self.budget_s, self.t0, self.estimated, self.took = budget_s, time.monotonic(), 0.0, 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def expected(self, est_s: float) -> float:
        scale = min(3.0, max(0.5, self.took / self.estimated)) if self.estimated else 1.0
        return est_s * scale

    def allows(self, est_s: float) -> bool:
        return not self.estimated or self.elapsed() + self.expected(est_s) <= self.budget_s

    def timeout(self) -> float:
        left = self.budget_s + GRACE_S - self.elapsed()
        return left if self.estimated else max(left, 120.0)  # (under a tiny budget the first variant still runs)

    def record(self, est_s: float, took_s: float):
        self.estimated, self.took = self.estimated + est_s, self.took + took_s


# --- one trainer variant -----------------------------------------------------------------------------


def train_command(v: dict, args, data_dir: str, out_dir: str, B: int, ref: bool = False) -> list[str]:
    """The variant's command; ref: its eager fp32 reference (B/4 rows x 4 micro-steps per rank: the same rows)."""
    launcher = [sys.executable]
    if v["nproc"] > 1 and not ref:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={v['nproc']}"]
    # squeeze_memory.py runs the trainer in its process and takes the GPU's free memory away before a step
    script = ["benchmarks/squeeze_memory.py", *v["squeeze"], "--"] if "squeeze" in v and not ref else ["train_gpt2.py"]
    cmd = [
        *launcher,
        *script,
        "--data-dir",
        data_dir,
        "--out-dir",
        out_dir,
        *args.model_flags,
        "--max-steps",
        str(steps_of(v, args)),
        "--warmup-steps",
        "2",
        "--val-every",
        "0",
        "--sample-every",
        "0",
        "--hellaswag-every",
        "0",
        "--ckpt-every",
        "0",
    ]
    rows = RECIPE_TOKENS // args.seq_len if v.get("total") == "recipe" else B * v["nproc"]
    if v.get("total") != "recipe":
        cmd += ["--total-batch-size", str(rows * args.seq_len)]
    if ref:
        ref_rows = max(1, B // 4)
        return cmd + [
            "--batch-size",
            str(ref_rows if rows % ref_rows == 0 else 1),
            "--dtype",
            "float32",
            "--no-compile",
            "--loss-chunk",
            "0",
            *loss_flags(v),
        ]
    if v.get("batch") != "auto" or not args.cuda:  # (auto is the default on CUDA only)
        cmd += ["--batch-size", str(B) if v.get("batch") != "auto" else "auto"]
    cmd += ["--dtype", v["dtype"]] if v["dtype"] else []
    cmd += [] if v["compile"] is None else ["--compile" if v["compile"] else "--no-compile"]
    cmd += ["--loss-chunk", str(v["chunk"])] if v["chunk"] is not None else []
    cmd += v["extra"]
    if args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    return cmd


def steps_of(v: dict, args) -> int:
    return {"recipe": args.recipe_steps, None: args.steps}.get(v.get("steps"), v.get("steps"))


def loss_flags(v: dict) -> list[str]:
    """The variant's flags that change its losses: its reference runs them too."""
    return [*(MUON if MUON[-1] in v["extra"] else []), *(DOC_MASK if DOC_MASK[0] in v["extra"] else [])]


def parse_run(stdout: str, out_dir: str, compiled: bool) -> dict:
    """Losses, speed, memory and micro-batch of a finished trainer run, from its log.jsonl and summary."""
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    records = [r for r in logged if "loss" in r]
    later = records[1:] or records
    dts = [r["dt_ms"] / 1000 for r in later]
    summary = next(line for line in stdout.splitlines() if line.startswith("done:"))
    header = re.search(r"dtype (\w+) \| compile (\w+)", stdout)
    mfu = [r["mfu"] for r in later if "mfu" in r]
    sizes = [r for r in logged if r.get("event") == "batch_size"]  # auto's choice, an out-of-memory's
    return dict(
        losses=[r["loss"] for r in records],
        tok_per_s=statistics.mean(r["tok_per_s"] for r in later),
        tok_per_s_per_gpu=statistics.mean(r["tok_per_s_per_gpu"] for r in later),
        step_ms=1000 * statistics.mean(dts),
        mfu=statistics.mean(mfu) if mfu else None,
        memory=re.search(r"peak memory ([\d.]+ GiB \w+)", summary).group(1),
        compile_s=records[0]["dt_ms"] / 1000 - statistics.median(dts) if compiled and len(records) > 1 else None,
        search_s=next((r["search_s"] for r in sizes if "search_s" in r), None),
        sizes=[r["batch_size"] for r in sizes],
        dtype=header.group(1) if header else None,
        compiled=header.group(2) == "True" if header else compiled,
        auto_line=next((line for line in stdout.splitlines() if line.startswith("--batch-size auto")), None),
    )


def read_run(returncode: int | None, stdout: str, stderr: str, out_dir: str, compiled: bool) -> dict:
    """parse_run of a run that ended well, else {error: its first error line}."""
    if returncode != 0:
        return dict(error=first_error(returncode, stderr))
    try:
        return parse_run(stdout, out_dir, compiled)
    except (OSError, StopIteration, ValueError, AttributeError) as e:
        return dict(error=f"its log or summary line is not as expected: {e!r}")


def first_error(returncode, stderr: str) -> str:
    if returncode is None:
        return "stopped at the time limit"
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return next(
        (line for line in lines if line.startswith("error:")), lines[-1] if lines else f"exit code {returncode}"
    )


class Check:
    """The run of the plan: references, variants, the budget and the report."""

    def __init__(self, args, cuda: bool, n_gpus: int, tmp: str):
        self.args, self.cuda, self.tmp = args, cuda, tmp
        self.data_dir = os.path.join(tmp, "data")
        self.refs, self.rows, self.B = {}, [], args.batch_size
        self.budget = Budget(args.budget_s)
        self.env = {
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"),
            "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
            "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
        }  # one cache, empty at the start, for every variant
        self.report = Report(args.report, self.describe(cuda, n_gpus))
        self.log_index = 0

    def describe(self, cuda: bool, n_gpus: int) -> dict:
        import torch

        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        try:
            smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout if cuda else ""
        except OSError as e:
            smi = f"nvidia-smi: {e}"
        return dict(
            device=f"{torch.cuda.get_device_name()} x{n_gpus}" if cuda else "CPU (no CUDA)",
            versions=dict(
                python=sys.version.split()[0],
                torch=torch.__version__,
                cuda=torch.version.cuda,
                triton=triton_version,
                cudnn=torch.backends.cudnn.version() if cuda else None,
            ),
            nvidia_smi=smi,
            budget_s=self.args.budget_s,
            command=shlex.join([sys.executable, *sys.argv]),
            started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        )

    def run_logged(self, name: str, cmd: list[str], env: dict) -> tuple[int | None, str, str]:
        """run_command, its output kept under the report's logs/."""
        returncode, out, err = run_command(cmd, {**self.env, **env}, self.budget.timeout())
        self.log_index += 1
        self.report.keep_log(
            f"{self.log_index:02d}_{re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_')}.log",
            f"$ {shlex.join(cmd)}\n# exit code {returncode}\n{out}\n# stderr\n{err}",
        )
        return returncode, out, err

    def reference(self, v: dict, B: int) -> tuple[dict, list[str]]:
        """The eager fp32 reference of v's rows and loss-changing flags (run once per such set)."""
        rows = "recipe" if v.get("total") == "recipe" else B * v["nproc"]
        key = (rows, *loss_flags(v))
        if key not in self.refs:
            out_dir = os.path.join(self.tmp, "ref_" + "_".join(map(str, key)).replace("-", ""))
            cmd = train_command(v, self.args, self.data_dir, out_dir, B, ref=True)
            self.refs[key] = (
                read_run(*self.run_logged("reference " + " ".join(map(str, key)), cmd, {}), out_dir, False),
                cmd,
            )
        return self.refs[key]

    def run_train(self, v: dict, index: int) -> dict:
        B = self.B
        ref, ref_cmd = self.reference(v, B)
        row = dict(group=v["group"], name=v["name"], flags=v["extra"], nproc=v["nproc"], commands=[shlex.join(ref_cmd)])
        if "error" in ref:
            return dict(row, status="FAILED", error="reference: " + ref["error"])
        out_dir = os.path.join(self.tmp, f"run{index}")
        cmd = train_command(v, self.args, self.data_dir, out_dir, B)
        row["commands"].append(shlex.join(cmd))
        r = read_run(*self.run_logged(v["name"], cmd, v.get("env", {})), out_dir, v["compile"] is not False)
        if "error" in r:
            return dict(row, status="FAILED", error=r["error"])
        drift = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
        dtype = r["dtype"] or v["dtype"]
        steps = steps_of(v, self.args)  # (a reference may run more steps than the variant: the same rows first)
        ok = drift <= TOLERANCE[dtype] and len(r["losses"]) == steps <= len(ref["losses"])
        trained_at = ([] if v.get("batch") == "auto" else [B]) + r["sizes"]
        row.update(
            status="ok" if ok else "DRIFT",
            drift=drift,
            tolerance=TOLERANCE[dtype],
            dtype=dtype,
            compiled=r["compiled"],
            tok_per_s=r["tok_per_s"],
            tok_per_s_per_gpu=r["tok_per_s_per_gpu"],
            mfu=r["mfu"],
            memory=r["memory"],
            compile_s=r["compile_s"],
            search_s=r["search_s"],
            step_ms=r["step_ms"],
            micro_batch="->".join(map(str, trained_at)),
            losses=r["losses"],
            ref_losses=ref["losses"],
            notes=[r["auto_line"]] if r["auto_line"] else [],
        )
        if "squeeze" in v and v.get("batch") != "auto" and len(trained_at) < 2:
            row.update(status="FAILED", error="no out-of-memory happened")
        if v.get("steps") == "recipe" and r["sizes"] and not self.args.batch_size_given:
            self.B = min(r["sizes"][-1], 64)  # groups 2-7 at the graph's micro-batch: its compile is cached
        return row

    def run_bench_compile(self, v: dict) -> list[dict]:
        path = os.path.join(self.tmp, "bench_compile.json")
        cmd = [
            sys.executable,
            "benchmarks/bench_compile.py",
            "--rounds",
            "1",
            "--steps",
            str(self.args.steps),
            "--json",
            path,
        ]
        returncode, out, err = self.run_logged(v["name"], cmd, {})
        if returncode != 0:
            return [
                dict(
                    group=6,
                    name=v["name"],
                    commands=[shlex.join(cmd)],
                    status="FAILED",
                    error=first_error(returncode, err),
                )
            ]
        with open(path) as f:
            best = json.load(f)
        return [
            dict(
                group=6,
                name=f"bench_compile.py {variant} (B=16, empty cache)",
                commands=[shlex.join(cmd)],
                status="ok" if b["drift"] <= TOLERANCE["bfloat16"] else "DRIFT",
                drift=b["drift"],
                tolerance=TOLERANCE["bfloat16"],
                tok_per_s=b["tok_per_s"],
                tok_per_s_per_gpu=b["tok_per_s"],
                compile_s=b["compile_s"] if variant != "eager" else None,
                notes=[f"first step {b['first_s']:.1f} s"],
            )
            for variant, b in best.items()
        ]

    def run(self, matrix: list[dict]) -> bool:
        """Every variant the budget allows, in order; the report after each. True if all that ran are ok."""
        self.report.update(rows=self.rows, skipped=[v["name"] for v in matrix], finished=False)
        for i, v in enumerate(matrix):
            if not self.budget.allows(v["est_s"]):
                skipped = matrix[i:]
                groups = ",".join(sorted({str(s["group"]) for s in skipped}, key=int))
                print(
                    f"budget: {self.budget.elapsed():.0f} of {self.args.budget_s:.0f} s used; not started "
                    f"({len(skipped)}): " + "; ".join(s["name"] for s in skipped),
                    flush=True,
                )
                print(f"  run them on another lease: python benchmarks/gpu_check.py --groups {groups}", flush=True)
                self.report.update(
                    skipped=[s["name"] for s in skipped],
                    skipped_command=f"python benchmarks/gpu_check.py --groups {groups}",
                )
                break
            self.report.update(running=v["name"])
            t = time.monotonic()
            new_rows = self.run_bench_compile(v) if v["kind"] == "bench_compile" else [self.run_train(v, i)]
            took = time.monotonic() - t
            self.budget.record(v["est_s"], took)
            for row in new_rows:
                row.update(wall_s=took, est_s=v["est_s"])
                print_row(row)
                self.rows.append(row)
            add_ratios(self.rows, matrix)
            self.report.update(
                rows=self.rows, skipped=[s["name"] for s in matrix[i + 1 :]], elapsed_s=round(self.budget.elapsed(), 1)
            )
        self.report.update(running=None, finished=True, elapsed_s=round(self.budget.elapsed(), 1))
        print(
            f"{self.budget.elapsed():.0f} s in all" + (f"; report in {self.args.report}" if self.args.report else ""),
            flush=True,
        )
        return all(row["status"] == "ok" for row in self.rows)


def add_ratios(rows: list[dict], matrix: list[dict]):
    """Muon's step time and --doc-mask's tok/s against the yardstick's (AdamW, causal attention, same shape)."""
    baseline_name = next((v["name"] for v in matrix if v.get("baseline")), None)
    base = next((r for r in rows if r["name"] == baseline_name and "tok_per_s" in r), None)
    for row in rows:
        if base is None or row is base or "tok_per_s" not in row or row.get("nproc") != 1:
            continue
        if MUON[-1] in row["flags"] and (row["dtype"], row["compiled"]) == (base["dtype"], base["compiled"]):
            row["vs_adamw"] = (
                f"step {row['step_ms']:.0f} ms vs AdamW's {base['step_ms']:.0f} ms "
                f"({row['step_ms'] / base['step_ms']:.2f}x)"
            )
        if DOC_MASK[0] in row["flags"]:
            row["vs_causal"] = f"{row['tok_per_s'] / base['tok_per_s']:.2f}x the tok/s of causal attention"


def fmt(row: dict, key: str, spec: str, default: str = "-") -> str:
    return format(row[key], spec) if row.get(key) is not None else default


def print_row(row: dict):
    if row["status"] == "FAILED":
        print(f"[{row['group']}] {row['name']:48s} | FAILED: {row['error']}", flush=True)
        return
    mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "-"
    print(
        f"[{row['group']}] {row['name']:48s} | loss drift {row['drift']:.1e} {'ok  ' if row['status'] == 'ok' else 'HIGH'}"
        f" | {row['tok_per_s']:10,.0f} tok/s ({row['tok_per_s_per_gpu']:9,.0f}/gpu) | mfu {mfu:>5s} | peak "
        f"{row.get('memory') or '-':14s} | compile {fmt(row, 'compile_s', '6.1f')}s"
        + (f" | auto search {row['search_s']:.1f}s" if row.get("search_s") is not None else "")
        + (f" | B={row['micro_batch']}" if row.get("micro_batch") else "")
        + f" | {row['wall_s']:.0f}s wall",
        flush=True,
    )


# --- the report ----------------------------------------------------------------------------------------


class Report:
    """gpu_check.md and gpu_check.json in a folder, rewritten whole (and atomically) after every
    variant, so that what ran is there however the lease ends; each command's output under logs/."""

    def __init__(self, folder: str | None, info: dict):
        self.folder, self.data = folder, info
        if folder:
            os.makedirs(os.path.join(folder, "logs"), exist_ok=True)

    def keep_log(self, name: str, text: str):
        if self.folder:
            write_atomically(os.path.join(self.folder, "logs", name), text)

    def update(self, **fields):
        self.data.update(fields)
        if self.folder:
            write_atomically(os.path.join(self.folder, "gpu_check.json"), json.dumps(self.data, indent=1))
            write_atomically(os.path.join(self.folder, "gpu_check.md"), markdown(self.data))


def write_atomically(path: str, text: str):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def markdown(d: dict) -> str:
    """The report as Markdown, to paste into docs/performance.md's GPU section as it is."""
    v = d["versions"]
    lines = [
        f"### gpu_check on {d['device']}, {d['started']}",
        "",
        f"torch {v['torch']}, CUDA {v['cuda']}, Triton {v['triton']}, cuDNN {v['cudnn']}, Python {v['python']}; "
        f"budget {d['budget_s']:.0f} s, {d.get('elapsed_s', 0):.0f} s used"
        + ("" if d.get("finished") else " (still running, or cut off)"),
        "",
        "| # | variant | result | loss drift | tok/s | tok/s/GPU | MFU | peak memory | compile s | micro-batch "
        "| step ms | wall s |",
        "|" + " --- |" * 12,
    ]
    for r in d["rows"]:
        result = r["status"] + (f": {r['error']}" if r.get("error") else "")
        lines.append(
            f"| {r['group']} | {r['name']} | {result} | {fmt(r, 'drift', '.1e')} | {fmt(r, 'tok_per_s', ',.0f')} "
            f"| {fmt(r, 'tok_per_s_per_gpu', ',.0f')} | "
            + (f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-")
            + f" | {r.get('memory') or '-'} | {fmt(r, 'compile_s', '.1f')}"
            + (f" (auto search {r['search_s']:.1f})" if r.get("search_s") is not None else "")
            + f" | {r.get('micro_batch') or '-'} | {fmt(r, 'step_ms', '.0f')} | {r['wall_s']:.0f} |"
        )
    notes = [
        f"- [{r['group']}] {r['name']}: {note}"
        for r in d["rows"]
        for note in [*r.get("notes", []), r.get("vs_adamw"), r.get("vs_causal")]
        if note
    ]
    if notes:
        lines += ["", *notes]
    if d.get("running"):
        lines += ["", f"Running when this was written: {d['running']}"]
    if d["skipped"]:
        lines += [
            "",
            "Not run (the time budget, or the lease ended first): "
            + "; ".join(d["skipped"])
            + (f". On another lease: `{d['skipped_command']}`" if d.get("skipped_command") else ""),
        ]
    lines += ["", f"Command: `{d['command']}`. Each variant's commands (the reference first):", "", "```"]
    lines += [c for r in d["rows"] for c in r.get("commands", [])] + ["```"]
    if d["nvidia_smi"]:
        lines += ["", "```", d["nvidia_smi"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


# --- main ----------------------------------------------------------------------------------------------


def missing_packages(names) -> list[str]:
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def main(argv=None) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--budget-s",
        type=float,
        default=400,
        help="start no variant that would end past this many seconds "
        "(estimated); one running at this + 20 s is stopped (default 400: one lease of 7 minutes)",
    )
    p.add_argument(
        "--report",
        default=os.environ.get("OUT") or None,
        metavar="DIR",
        help="write gpu_check.md, gpu_check.json and logs/ to DIR (default: $OUT if set)",
    )
    p.add_argument("--groups", default="1,2,3,4,5,6,7", help="which of the numbered groups to run (default: all)")
    p.add_argument("--steps", type=int, help="optimizer steps per variant of groups 2-7 (default 5 on CUDA, 3 on CPU)")
    p.add_argument("--recipe-steps", type=int, default=3, help="steps of the default path at 524,288 tokens each")
    p.add_argument(
        "--batch-size",
        type=int,
        help="rows per micro-step of groups 2-7 (default: what group 1 chose, at most 64; 4 on CPU)",
    )
    p.add_argument("--seq-len", type=int, help="default 1024 on CUDA, 32 on CPU")
    p.add_argument("--peak-tflops", type=float, help="peak of one device for MFU (default: the trainer's table)")
    p.add_argument("--compile", action="store_true", help="on CPU, add a compiled variant (20-40 s)")
    args = p.parse_args(argv)
    missing = missing_packages(NEEDED)
    if not missing:
        import torch

        missing = missing_packages(["triton"]) if torch.cuda.is_available() else []
    if missing:  # the first line: nothing has run
        print(f"gpu_check: missing {', '.join(missing)}: pip install {' '.join(missing)}", flush=True)
        return 2
    try:
        groups = {int(g) for g in args.groups.split(",")}
    except ValueError:
        groups = set()
    if not groups or groups - set(GROUPS):
        p.error(f"--groups {args.groups}: expected numbers from 1 to 7, comma-separated")
    import numpy as np

    cuda = args.cuda = torch.cuda.is_available()
    args.batch_size_given = args.batch_size is not None
    args.batch_size = args.batch_size or (64 if cuda else 4)
    args.steps = args.steps or (5 if cuda else 3)
    args.seq_len = args.seq_len or (1024 if cuda else 32)
    if cuda and args.seq_len != 1024:
        p.error("--seq-len: the default path runs the recipe's rows of 1024 tokens on CUDA")
    vocab = 50257 if cuda else 512
    args.model_flags = (
        ["--model", "gpt2"]
        if cuda
        else [
            "--n-layer",
            "2",
            "--n-head",
            "2",
            "--n-embd",
            "32",
            "--block-size",
            str(args.seq_len),
            "--vocab-size",
            "512",
            "--seq-len",
            str(args.seq_len),
        ]
    )
    n_gpus = torch.cuda.device_count() if cuda else 0
    matrix = [v for v in plan(cuda, n_gpus, args.compile) if v["group"] in groups]
    with tempfile.TemporaryDirectory() as tmp:
        check = Check(args, cuda, n_gpus, tmp)
        os.makedirs(check.data_dir)
        max_rows = max(64, args.batch_size) * max(v.get("nproc", 1) for v in matrix)
        n_tokens = max((args.steps + 1) * max_rows * args.seq_len, (args.recipe_steps + 1) * RECIPE_TOKENS * cuda) + 1
        for split in ("train", "val"):  # synthetic GPT-2 token ids: speed and agreement, not learning
            tokens = np.random.default_rng(0).integers(0, vocab, n_tokens, dtype=np.uint16)
            if cuda:  # documents of ~300 tokens on average (FineWeb-Edu's are longer): --doc-mask's case
                tokens[np.random.default_rng(1).random(n_tokens) < 1 / 300] = 50256
            np.save(os.path.join(check.data_dir, f"synth_{split}_000000.npy"), tokens)
        print(
            f"{check.report.data['device']} | {' '.join(args.model_flags)} | groups {args.groups} | B={args.batch_size} "
            f"T={args.seq_len} | {args.steps} steps | budget {args.budget_s:.0f} s",
            flush=True,
        )
        ok = check.run(matrix)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
