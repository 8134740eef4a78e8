"""Shared test setup: the repo on sys.path, each module's synthetic shards (data_dir), the finished tiny run, a
tiny run's flags, the scripts run in-process, as programs or on torchrun's ranks, and reading what a run wrote."""

import contextlib
import hashlib
import importlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TEXT_FILE = REPO / "fixtures" / "tinyshakespeare_first4000lines.txt"  # plain text (fixtures/README.md)
HELLASWAG_FILE = REPO / "fixtures" / "hellaswag_val_subset.jsonl"  # 446 validation examples, the first 200 first
sys.path.insert(0, str(REPO))

# One thread per process, in the workers and every command they start: two workers share two cores, where two
# OpenMP threads a process only contend (test_sample + test_hostile: 17% more CPU time, 14% longer)
os.environ.setdefault("OMP_NUM_THREADS", "1")


SHARD_DIRS = {}  # the folders of synthetic shards made in this worker, by their sizes


def shared_shards(tmp_path_factory, **sizes) -> str:
    """tests/shards.py's shard_dir(**sizes), made once per worker: read it, never change it."""
    from shards import shard_dir

    key = tuple(sorted(sizes.items()))
    if key not in SHARD_DIRS:
        SHARD_DIRS[key] = shard_dir(tmp_path_factory, **sizes)
    return SHARD_DIRS[key]


@pytest.fixture(scope="module")
def data_dir(request, tmp_path_factory) -> str:
    """The module's shards, sized by its SHARDS (shard_dir's arguments), shared by the modules of the same SHARDS."""
    return shared_shards(tmp_path_factory, **request.module.SHARDS)


RUN_SHARDS = dict(n_docs=300, seed=3)  # finished_run's data: a module with these SHARDS resumes it on its data_dir


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """THE finished tiny run, trained in-process once per worker: tiny_run_args(RUN_SHARDS' folder, steps=4,
    ckpt_every=2), checkpoints at steps 2 and 4. Read only; a test that changes it takes finished_copy."""
    import train_gpt2

    data = shared_shards(tmp_path_factory, **RUN_SHARDS)
    out = tmp_path_factory.mktemp("finished") / "run"
    with kept_process_state():
        assert train_gpt2.main(tiny_run_args(data, out, steps=4, ckpt_every=2)) == 0
    return out


@pytest.fixture
def finished_copy(finished_run, tmp_path):
    """A copy of finished_run of this test's own, tmp_path/"run", to resume, branch or damage."""
    return Path(shutil.copytree(finished_run, tmp_path / "run", symlinks=False))


TINY_RUN = dict(steps=20, B=4, ckpt_every=10, n_layer=2, n_embd=16, block_size=32, seq_len=16, rows=8)
TINY_RUN.update(warmup=None, val_every=0, sample_every=0, hellaswag_every=0)  # tiny_run_args' defaults


def tiny_run_args(data_dir, out_dir, *extra, **sizes) -> list:
    """The trainer's flags for a tiny run (sizes: TINY_RUN's keys): n_layer blocks n_embd wide, rows of seq_len
    tokens, `rows` rows a step in micro-batches of B, max LR 1e-2 after `warmup` steps (default min(3, steps)); no
    evaluation unless asked (hellaswag_every None: the trainer's default); extra last."""
    assert set(sizes) <= set(TINY_RUN), set(sizes) - set(TINY_RUN)
    s = {**TINY_RUN, **sizes}
    warmup = min(3, s["steps"]) if s["warmup"] is None else s["warmup"]
    flags = (
        f"--n-layer {s['n_layer']} --n-head 2 --n-embd {s['n_embd']} --block-size {s['block_size']} "
        f"--seq-len {s['seq_len']} --batch-size {s['B']} --total-batch-size {s['rows'] * s['seq_len']} "
        f"--max-steps {s['steps']} --warmup-steps {warmup} --max-lr 1e-2 --val-every {s['val_every']} "
        f"--sample-every {s['sample_every']} --ckpt-every {s['ckpt_every']}"
    ).split()
    hellaswag = [] if s["hellaswag_every"] is None else ["--hellaswag-every", str(s["hellaswag_every"])]
    return ["--data-dir", str(data_dir), "--out-dir", str(out_dir), *flags, *hellaswag, *extra]


# tiny_run_args' sizes for a run that evaluates: GPT-2's vocabulary (HellaSwag's tokens fit), 4 rows of 32 a step
GPT2_VOCAB_RUN = dict(n_embd=32, block_size=64, seq_len=32, rows=4, warmup=2)


def log_records(out_dir) -> list:
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_records(out_dir) -> list:  # those a trained step wrote
    return [r for r in log_records(out_dir) if "loss" in r]


def trained_steps(out_dir) -> list:
    return [r["step"] for r in train_records(out_dir)]


def losses(out_dir) -> list:
    return [(r["step"], r["loss"]) for r in train_records(out_dir)]


def wait_for_steps(out_dir, n, proc):
    """Until the run proc writes to out_dir has logged n trained steps (wait_for's limits)."""
    logged = lambda: os.path.exists(os.path.join(out_dir, "log.jsonl")) and len(losses(out_dir)) >= n
    wait_for(logged, proc, what=f"{n} steps")


def resume_copy(src, dst, step):
    """What a run killed after checkpoint `step` leaves: that checkpoint and a log that ran past it."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, f"ckpt_{step:07d}.pt"), dst)
    shutil.copy(os.path.join(src, "log.jsonl"), dst)


def with_env(env) -> dict:
    """This process's environment with env's variables set on top (a value None: that variable unset)."""
    merged = {**os.environ, **(env or {})}
    return {key: value for key, value in merged.items() if value is not None}


def run_command(script, *args, cwd=REPO, env=None, timeout=300, **kwargs):
    """`python script args` as a user runs it (script "-c": args[0] is the code), in cwd, env on top (with_env):
    the completed process, its output as text."""
    command = [sys.executable, str(script), *map(str, args)]
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=with_env(env), **kwargs
    )


def start(command, cwd=REPO, env=None, **popen) -> subprocess.Popen:
    """command started in cwd, env on top (with_env), stdout and stderr text pipes unless popen says otherwise."""
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen(command, cwd=cwd, env=with_env(env), text=True, **pipes)


SIGNALS_KEPT = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE)


@contextlib.contextmanager
def kept_process_state():
    """What a script's main may change in this process restored: the current folder, the environment, sys.argv and
    sys.excepthook, the signal handlers, the umask, torch's threads, matmul precision and random state; no
    torch.distributed process group or W&B set-up (which keeps the environment it first read) left behind."""
    cwd, env, argv, hook = os.getcwd(), dict(os.environ), list(sys.argv), sys.excepthook
    handlers = {signum: signal.getsignal(signum) for signum in SIGNALS_KEPT}
    umask = os.umask(0o022)
    os.umask(umask)
    torch = sys.modules.get("torch")
    if torch is not None:
        threads, precision, rng = torch.get_num_threads(), torch.get_float32_matmul_precision(), torch.get_rng_state()
    try:
        yield
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv[:], sys.excepthook = argv, hook
        for signum, handler in handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
        os.umask(umask)
        if torch is not None:
            torch.set_num_threads(threads)
            torch.set_float32_matmul_precision(precision)
            torch.set_rng_state(rng)
        dist = getattr(sys.modules.get("torch"), "distributed", None)
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if hasattr(sys.modules.get("wandb"), "teardown"):  # (the real one: fake_wandb's has none)
            sys.modules["wandb"].teardown()


@pytest.fixture(autouse=True)
def _process_state_restored():
    """Every test leaves the process as it found it (kept_process_state), whatever main it ran in-process."""
    with kept_process_state():
        yield


def run_main(script, *args, cwd=None, env=None):
    """`python script args` run in this process through the script's main(argv), as run_command's completed process
    (output caught at the file descriptors), in cwd (default: the repo), env on top; all restored afterwards."""
    module = importlib.import_module(Path(script).stem)
    argv = [str(a) for a in args]
    environment = with_env(env)  # (read before the clear below: this process's variables, env's on top)
    with kept_process_state(), tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.argv = [str(REPO / script), *argv]
        os.chdir(cwd or REPO)
        os.environ.clear()
        os.environ.update(environment)
        streams, saved = (sys.stdout, sys.stderr), (os.dup(1), os.dup(2))
        for fd, caught, stream in zip((1, 2), (out, err), streams):
            stream.flush()
            os.dup2(caught.fileno(), fd)
        sys.stdout, sys.stderr = (
            io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), errors="backslashreplace", write_through=True)
            for fd in (1, 2)
        )
        try:
            code = module.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) or e.code is None else 1
        finally:
            for fd, saved_fd, stream in zip((1, 2), saved, (sys.stdout, sys.stderr)):
                stream.flush()
                os.dup2(saved_fd, fd)
                os.close(saved_fd)
            sys.stdout, sys.stderr = streams
        out.seek(0)
        err.seek(0)
        texts = [f.read().decode(errors="backslashreplace") for f in (out, err)]
    return subprocess.CompletedProcess([script, *argv], code or 0, *texts)


def assert_one_error_line(result, *fragments):
    """result failed with exit code 2 and one `error:` line on stderr holding every fragment."""
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert all(fragment in lines[0] for fragment in fragments), lines[0]


def assert_refused(result, message):
    """result failed with exit code 2 and stderr exactly the one line `error: message` (so no traceback)."""
    assert (result.returncode, result.stderr) == (2, f"error: {message}\n"), result.stderr[-3000:]


def assert_refused_quietly(result, message):
    """assert_refused(result, message), and nothing on stdout."""
    assert_refused(result, message)
    assert result.stdout == ""


@pytest.fixture
def fake_wandb(monkeypatch):
    """A fresh stand-in for the wandb module: project "no-such-entity" cannot start a run, and the third log() call
    fails as a dead W&B service does."""

    class Run:
        disabled, calls = False, 0

        def log(self, row, step):
            Run.calls += 1
            if Run.calls == 3:
                raise ConnectionError("wandb service process exited")

        def finish(self):
            pass

    def init(project, dir, config):
        if project == "no-such-entity":
            raise RuntimeError("permission denied for entity")
        return Run()

    module = types.ModuleType("wandb")
    module.init, module.Run = init, Run
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def fineweb_parked_after(shard_index: int) -> list:
    """The command prefix of `python fineweb.py` as a program, parked for good once shard shard_index's file is
    written and before the manifest records it (a patch of shard_writer.write_whole, not a hook in fineweb)."""
    code = (
        "import runpy, sys, time\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import trainkit.data.shard_writer as shard_writer\n"
        "write = shard_writer.write_whole\n"
        "def write_then_park(folder, name, *blobs):\n"
        "    write(folder, name, *blobs)\n"
        f"    if name.endswith(('_{shard_index:06d}.npy', '_{shard_index:06d}.bin')):\n"
        "        time.sleep(3600)\n"
        "shard_writer.write_whole = write_then_park\n"
        f"sys.argv[0] = {str(REPO / 'fineweb.py')!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    return [sys.executable, "-c", code]


def tiktoken_cache(folder) -> str:
    """folder made a tiktoken cache that holds r50k_base (bpe/'s file under the sha1 of its URL): no network."""
    from trainkit.data.tokenizer import BPE_URL

    os.makedirs(folder, exist_ok=True)
    shutil.copyfile(
        REPO / "bpe" / "r50k_base.tiktoken", os.path.join(folder, hashlib.sha1(BPE_URL.encode()).hexdigest())
    )
    return str(folder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*launch_args) -> list:
    """The command prefix of a torchrun launch (as a module, so the test's Python runs it)."""
    return [sys.executable, "-m", "torch.distributed.run", *launch_args]


def child_pids(pid) -> list:
    """The processes whose parent is pid (a torchrun's workers), from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(entry))
    return children


def kill_group(proc, signum=signal.SIGKILL, timeout=120):
    """signum to the process group proc leads (start_new_session=True), gone already or not; after SIGKILL, proc
    is reaped and the group's other processes are gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signum)
    if signum == signal.SIGKILL:
        proc.wait(timeout=timeout)
        group_gone(proc.pid, timeout)


def group_gone(pgid, timeout=120):
    """Until no process of group pgid is left (a killed run's workers hold its folder's lock until they end)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"process group {pgid} still there after {timeout} s"
        time.sleep(0.02)


def kill_pids(pids, signum=signal.SIGKILL):
    """signum to each process of pids; one that has exited already (since it was listed) is skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def wait_for(condition, proc, timeout=300, what="the condition"):
    """Poll condition() until it holds; fails, with proc's output, if proc exits first or after timeout seconds
    (generous: importing torch on a loaded 2-core machine takes a minute)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, (f"exited with {proc.returncode} before {what}", proc.communicate())
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.05)


def run_cli(args, nproc=1, script="train_gpt2.py", env=None):
    """`python script args`, or a torchrun of nproc processes, in the repo: run_command's completed process."""
    launcher = torchrun("--standalone", f"--nproc_per_node={nproc}")[1:] if nproc > 1 else []
    return run_command(*launcher, script, *args, env=env)


def tree_hashes(folder, folders=False):
    """{path: sha256} of every file under folder (a link: where it points; with folders, each folder too)."""
    found = {}
    for parent, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = os.path.join(parent, name)
            key = os.path.relpath(path, folder)
            if os.path.islink(path):
                found[key] = "-> " + os.readlink(path)
            elif os.path.isdir(path):
                if folders:
                    found[key] = "folder"
            else:
                with open(path, "rb") as f:
                    found[key] = hashlib.sha256(f.read()).hexdigest()
    return found


def interrupt_when_blocked(proc, fifo, timeout=120):
    """Ctrl-C for proc once it has the fifo open for reading, then the read ended (empty: another thread may have
    taken the signal, leaving the main thread in the read): (stdout, stderr)."""
    writer = None
    try:
        deadline = time.time() + timeout
        while writer is None and time.time() < deadline:
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        os.close(writer)
        writer = None
        return proc.communicate(timeout=60)
    finally:
        if writer is not None:
            os.close(writer)
        if proc.poll() is None:
            proc.kill()


def spread_gpt(config, seed: int):
    """Our GPT in eval mode with an N(0, 1) token embedding: spread logits keep a multiple-choice example's
    endings from nearly tying."""
    import torch
    from train_gpt2 import GPT

    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():
        model.transformer.wte.weight.normal_(0.0, 1.0)
    return model.eval()


def write_checkpoint(model, path) -> str:
    """model as a train_gpt2.py checkpoint (weights and config only) at path."""
    import dataclasses
    from trainkit.runfiles.checkpoints import save_checkpoint

    save_checkpoint(str(path), {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config)})
    return str(path)


@pytest.fixture(scope="module")
def model(request):
    """The module's spread_gpt(CONFIG, SPREAD_SEED), the model its HellaSwag scores are computed from."""
    return spread_gpt(request.module.CONFIG, seed=request.module.SPREAD_SEED)


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory):
    """model as a checkpoint file (weights and config only)."""
    return write_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "tiny.pt")


def tiny_hf(vocab_size=50257, n_positions=32, seed=0, **overrides):
    """A Hugging Face GPT2LMHeadModel of 2 layers 32 wide, random LayerNorms too, in eval mode."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    fields = dict(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0)
    fields.update(embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new", bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(GPT2Config(**{**fields, **overrides})).eval()
    with torch.no_grad():  # random LayerNorm affine too, so a swapped weight/bias shows
        for name, p in model.named_parameters():
            if ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def not_gpt2_folder(path, kind):
    """A folder that GPT2LMHeadModel.from_pretrained loads without an error, as random weights."""
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    sizes = dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    if kind in ("bert", "llama"):
        model, config = (BertModel, BertConfig) if kind == "bert" else (LlamaForCausalLM, LlamaConfig)
        model(config(**sizes)).save_pretrained(path)
    else:
        tiny_hf(vocab_size=100).save_pretrained(str(path))
        weights = load_file(path / "model.safetensors")
        if kind == "gpt2 without layer 1":
            weights = {k: v for k, v in weights.items() if ".h.1." not in k}
        else:  # "gpt2 with a shorter position table"
            weights["transformer.wpe.weight"] = weights["transformer.wpe.weight"][:16].clone()
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


NOT_GPT2 = {
    "bert": "its config.json describes a 'bert' model, not GPT-2",
    "llama": "its config.json describes a 'llama' model, not GPT-2",
    "gpt2 without layer 1": "tensors missing from its weights (transformer.h.1.attn.c_attn.bias, "
    "transformer.h.1.attn.c_attn.weight, ...; 12 in all) would be random; is it a complete GPT-2?",
    "gpt2 with a shorter position table": "tensors of another shape than its config.json gives "
    "(transformer.wpe.weight; 1 in all)",
}


# The files of longest wall time (summed --durations, two workers on the 2-core machine) start first, so that the
# two workers end together (xdist's loadfile hands out the files of most tests first); the rest follow as collected
LONGEST_FILES = """test_slurm test_fsdp test_hf_interop test_resilience test_ranks test_train_faults test_readme
test_lm_eval test_quickstart test_gpu_paths test_train_cli test_hostile test_hellaswag test_shard_scan test_sample
test_run_tracking test_out_dir test_output""".split()


def pytest_configure(config):
    slurm = "slurm: jobs under a real Slurm that the test starts (test_slurm.py, minutes; -m 'not slurm' skips them)"
    config.addinivalue_line("markers", slurm)
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: hand out the files in the order collected
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """LONGEST_FILES' tests first, in that order; each file's tests stay together and in their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


# Scripts run as programs (runpy, run_name "__main__") one after another in ONE new interpreter, torch imported once:
# each case afresh, the repository's modules unloaded, its own argv, environment, current folder and output files,
# SIGINT and sys.excepthook as at start.
AS_PROGRAMS = r"""
import io, json, os, runpy, signal, sys, tempfile, traceback
cases, watch, report = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
repo = os.getcwd()
ours = {"trainkit", *(name[:-3] for name in os.listdir(repo) if name.endswith(".py"))}
streams, results = (sys.stdout, sys.stderr), []

def target(kind, caught):
    if kind == "full":
        return os.open("/dev/full", os.O_WRONLY)
    if kind == "left":  # a pipe whose reader has left, as after `| head -1`
        reader, writer = os.pipe()
        os.close(reader)
        return writer
    return os.dup(caught.fileno())

for case in cases:
    for name in [m for m in sys.modules if m.split(".")[0] in ours]:
        del sys.modules[name]
    env = dict(os.environ)
    os.environ.update({k: v for k, v in case.get("env", {}).items() if v is not None})
    for k in [k for k, v in case.get("env", {}).items() if v is None]:
        os.environ.pop(k, None)
    if case.get("cwd") == "deleted":
        os.chdir(tempfile.mkdtemp())
        os.rmdir(os.getcwd())
    else:
        os.chdir(case.get("cwd") or repo)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.excepthook = sys.__excepthook__
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    fd_out = target(case.get("stdout"), out)
    fd_err = fd_out if case.get("stderr") == "stdout" else target(case.get("stderr"), err)
    saved = os.dup(1), os.dup(2)
    os.dup2(fd_out, 1)
    os.dup2(fd_err, 2)
    encoding = case.get("encoding", "utf-8")
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding=encoding)
    sys.stderr = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding=encoding, errors="backslashreplace",
        line_buffering=True,
    )
    argv, code = case["argv"], 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            script = os.path.join(repo, argv[0])  # as `python SCRIPT` names it: relative in the repo only
            sys.argv = [script if case.get("cwd") else argv[0], *argv[1:]]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) or e.code is None else print(e.code, file=sys.stderr) or 1
    except BaseException:
        code = 1
        try:
            traceback.print_exc()
        except OSError:  # a stderr that fails too
            pass
    for stream in (sys.stdout, sys.stderr):  # as the interpreter's exit flushes them: a failure is exit code 120
        try:
            stream.flush()
        except Exception as e:
            code = 120
            os.write(2, f"Exception ignored on flushing {stream}: {e!r}\n".encode())
    own = sys.modules.get(os.path.basename(argv[0]).removesuffix(".py"))
    loaded = sorted(m for m in watch if m in sys.modules)
    sys.stdout, sys.stderr = streams
    for fd, saved_fd in zip((1, 2), saved):
        os.dup2(saved_fd, fd)
        os.close(saved_fd)
    for fd in {fd_out, fd_err}:
        os.close(fd)
    os.chdir(repo)
    os.environ.clear()
    os.environ.update(env)
    texts = []
    for f in (out, err):
        f.seek(0)
        texts.append(f.read().decode(errors="backslashreplace"))
    results.append([code or 0, *texts, loaded, own and own.__name__])
with open(report, "w") as f:
    json.dump(results, f)
"""


def run_as_programs(cases, watch=(), timeout=600) -> list:
    """Each case run as a program, in turn, in ONE new interpreter (AS_PROGRAMS): a dict of argv ([script, *args],
    the script relative to the repo; or ["-c", code, *args]) and optionally env (on top; None unsets), cwd (default
    the repo; "deleted": deleted under the program), stdout and stderr (default caught; "full": /dev/full; "left": a
    pipe whose reader has left; stderr "stdout": stdout's file) and encoding (as PYTHONIOENCODING). Per case a
    CompletedProcess (an exception: exit code 1 and its traceback) with .loaded, the modules of watch imported by
    then, and .own, the __name__ of a module the script's own name gives (None: no second copy)."""
    with tempfile.TemporaryDirectory() as folder:
        report = os.path.join(folder, "report.json")
        proc = run_command("-c", AS_PROGRAMS, json.dumps(cases), json.dumps(list(watch)), report, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(report) as f:
            results = json.load(f)
    completed = []
    for case, (code, out, err, loaded, own) in zip(cases, results):
        result = subprocess.CompletedProcess(case["argv"], code, out, err)
        result.loaded, result.own = loaded, own
        completed.append(result)
    return completed


# Each rank of ONE torchrun launch runs several command lines in turn through run_main, as `torchrun SCRIPT ARGS`
# would run each: each case its own process group (a store on a port rank 0 takes just before the case: torchrun's
# store holds the first group's keys), its rank's argv and current folder, its output caught.
MAINS_ON_RANKS = r"""
import json, os, shutil, sys, time, traceback
tests, cases, report = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
sys.path.insert(0, tests)
from conftest import free_port, run_main
rank, results = int(os.environ["RANK"]), []

def port_of_case(i):  # rank 0 takes a free port just before the case and tells the others through a file
    path = f"{report}.port{i}"
    if rank == 0:
        with open(path + ".tmp", "w") as f:
            f.write(str(free_port()))
        os.rename(path + ".tmp", path)
    deadline = time.monotonic() + 600
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"no port from rank 0 for case {i}"
        time.sleep(0.05)
    with open(path) as f:
        return f.read()

for i, case in enumerate(cases):
    env = dict(TORCHELASTIC_USE_AGENT_STORE="False", MASTER_PORT=port_of_case(i))
    for src, dst in case["copy"] if rank == 0 else ():  # the others wait for rank 0 in the group's set-up
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy(src, dst)
    try:
        result = run_main(case["script"] + ".py", *case["argv"][rank], cwd=case["cwd"][rank], env=env)
        results.append([result.returncode, result.stdout, result.stderr])
    except BaseException:  # (a main that raised: exit code 1 and its traceback, as a process would end)
        results.append([1, "", traceback.format_exc()])
with open(f"{report}.{rank}", "w") as f:
    json.dump(results, f)
"""


def run_on_ranks(cases, nproc=2, timeout=600) -> list:
    """Each case, a dict of script (a module of the repo: "train_gpt2"), argv (one list per rank) and optionally cwd
    (one folder per rank; default the repo) and copy ([src, dst] files rank 0 copies first), run in turn on every
    rank of ONE torchrun launch of nproc processes (MAINS_ON_RANKS): per case, each rank's CompletedProcess."""
    with tempfile.TemporaryDirectory() as folder:
        proc = start_on_ranks(cases, os.path.join(folder, "report"), nproc)
        try:
            _, err = proc.communicate(timeout=timeout)
        finally:
            proc.kill()  # (gone already unless the timeout passed)
        assert proc.returncode == 0, err[-3000:]
        return ranks_report(os.path.join(folder, "report"), nproc)


# The shard-scan cases' data (test_shard_scan, and test_ranks' two ranks splitting the first scan)
SCAN_T = 16


def documents(n_tokens: int, seed: int):
    """n_tokens of small ids with an <|endoftext|> opening a document every ~40 tokens."""
    import numpy as np
    from shards import EOT

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 64, n_tokens).astype(np.uint16)
    tokens[rng.integers(0, n_tokens, n_tokens // 40)] = EOT
    tokens[0] = EOT
    return tokens


def scan_args(data_dir, out_dir) -> list:
    """Two steps of 8 rows of --align-docs (4 rows x 2 ranks, or x 2 micro-steps on one) of a 1-layer model."""
    one_layer = dict(steps=2, B=4, ckpt_every=0, n_layer=1, block_size=16, seq_len=SCAN_T, rows=8)
    return tiny_run_args(data_dir, out_dir, "--align-docs", **one_layer)


def step_losses(stdout: str) -> list:
    return re.findall(r"^step\s+\d+/\d+ \| loss (\S+)", stdout, re.MULTILINE)


def kept_scans(cache_home) -> list:
    """The names of the scans kept under cache_home, each without its shard's key."""
    folder = os.path.join(cache_home, "gpt2-trainer", "shards")
    return sorted(re.sub(r"^\w+-\w+", "", name) for name in os.listdir(folder)) if os.path.isdir(folder) else []


def checkpoint_hashes(out_dir) -> dict:
    """{path under out_dir: sha256} of every checkpoint there, each checked to load (its stored sha256 verified)
    as the step its name gives."""
    from trainkit.runfiles import checkpoints

    found = {
        path: sha for path, sha in tree_hashes(out_dir).items() if checkpoints.CKPT_NAME.fullmatch(Path(path).name)
    }
    for path in found:
        assert checkpoints.load_checkpoint(os.path.join(out_dir, path))["step"] == checkpoints.checkpoint_step(path)
    return found


@pytest.fixture(scope="session")
def shared_rank_runs(request, tmp_path_factory) -> dict:
    """{module name: (its folder, run_on_ranks' results of its rank_cases)} for each collected module that defines
    rank_cases(folder, data_dir of its SHARDS or None) -> run_on_ranks' cases (a case's script may be the module, for
    its own main on the ranks), all in ONE torchrun launch per suite run: the first xdist worker to ask launches it
    under a lock in the folder the workers share, the others read what it wrote. Every rank of every case exits 0."""
    import fcntl

    modules = {item.module.__name__: item.module for item in request.session.items}
    modules = {name: m for name, m in sorted(modules.items()) if hasattr(m, "rank_cases")}
    xdist = "PYTEST_XDIST_WORKER" in os.environ
    root = tmp_path_factory.getbasetemp().parent if xdist else tmp_path_factory.getbasetemp()
    done = root / "shared_rank_runs.json"
    with open(root / "shared_rank_runs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            folder, cases, owners = root / "shared_rank_runs", [], []
            for name, module in modules.items():
                sizes = getattr(module, "SHARDS", None)
                data = sizes and shared_shards(tmp_path_factory, **sizes)
                (folder / name).mkdir(parents=True, exist_ok=True)
                own = module.rank_cases(folder / name, data)
                cases += own
                owners += [name] * len(own)
            found = {name: [str(folder / name), []] for name in modules}
            for name, ranks in zip(owners, run_on_ranks(cases)):
                assert [r.returncode for r in ranks] == [0] * len(ranks), "".join(r.stderr[-3000:] for r in ranks)
                found[name][1].append([[r.args, r.returncode, r.stdout, r.stderr] for r in ranks])
            done.with_suffix(".tmp").write_text(json.dumps(found))
            done.with_suffix(".tmp").rename(done)
        found = json.loads(done.read_text())
    return {
        name: (Path(folder), [[subprocess.CompletedProcess(*rank) for rank in ranks] for ranks in results])
        for name, (folder, results) in found.items()
    }


def start_on_ranks(cases, report, nproc=2, **popen) -> subprocess.Popen:
    """run_on_ranks' launch of cases, started (start's Popen, popen passed on) rather than waited for: to signal
    its ranks while a case runs. Each rank writes its results to f"{report}.{rank}": read them with ranks_report."""
    cases = [
        {
            **case,
            "argv": [[str(a) for a in argv] for argv in case["argv"]],
            "cwd": [str(cwd) for cwd in case.get("cwd", [REPO] * nproc)],
            "copy": [[str(src), str(dst)] for src, dst in case.get("copy", [])],
        }
        for case in cases
    ]
    launch = torchrun("--standalone", f"--nproc_per_node={nproc}", "--no-python")
    command = [*launch, sys.executable, "-c", MAINS_ON_RANKS, str(REPO / "tests"), json.dumps(cases), str(report)]
    return start(command, **popen)


def ranks_report(report, nproc=2) -> list:
    """Per case of an ended start_on_ranks launch, each rank's CompletedProcess (exit code, stdout, stderr)."""
    per_rank = []
    for rank in range(nproc):
        with open(f"{report}.{rank}") as f:
            per_rank.append(json.load(f))
    return [[subprocess.CompletedProcess([], *result) for result in case] for case in zip(*per_rank)]
