"""Shared test setup: the repo on sys.path, the data the repository ships in fixtures/ (the GPT-2 BPE in bpe/)."""
import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEXT_FILE = REPO / "fixtures" / "tinyshakespeare_first4000lines.txt"  # plain text (fixtures/README.md)
HELLASWAG_FILE = REPO / "fixtures" / "hellaswag_val_subset.jsonl"  # 446 validation examples, the first 200 first
sys.path.insert(0, str(REPO))

# One thread per process, in the test workers and every command they start: the suite runs two
# workers (and their subprocesses) side by side on two cores, where two OpenMP threads per process
# only contend (measured on test_sample + test_hostile: 17% more CPU time, 14% longer)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def tiktoken_cache(folder) -> str:
    """folder made a tiktoken cache that holds r50k_base: bpe/'s file under the name tiktoken gives
    its download (the sha1 of the URL), so tiktoken's own loader reads it and never the network."""
    import hashlib
    import shutil
    from trainkit.tokenizer import BPE_URL
    os.makedirs(folder, exist_ok=True)
    shutil.copyfile(REPO / "bpe" / "r50k_base.tiktoken", os.path.join(folder, hashlib.sha1(BPE_URL.encode()).hexdigest()))
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
    """signum to the process group proc leads (started with start_new_session=True); a group whose
    processes have all exited already is no error. After SIGKILL, proc is reaped (its exit code set)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signum)
    if signum == signal.SIGKILL:
        proc.wait(timeout=timeout)


def kill_pids(pids, signum=signal.SIGKILL):
    """signum to each process of pids; one that has exited already is skipped (on a busy machine a
    worker may end between being listed and being signalled)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def wait_for(condition, proc, timeout=300, what="the condition"):
    """Poll condition() until it holds; fails, with proc's output, if proc exits first or if timeout
    seconds pass (generous: a subprocess that imports torch on a loaded 2-core machine takes a minute)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, (f"exited with {proc.returncode} before {what}", proc.communicate())
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.05)


def run_cli(args, nproc=1, script="train_gpt2.py", env=None):
    """`python script args`, or a torchrun of nproc processes, in the repo: the completed process
    with its output as text. env: variables to set on top of this process's environment."""
    launcher = torchrun("--standalone", f"--nproc_per_node={nproc}") if nproc > 1 else [sys.executable]
    return subprocess.run([*launcher, script, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def tree_hashes(folder):
    """{path: sha256} of every file under folder (symbolic links as where they point): what a refused
    run must leave byte-identical."""
    found = {}
    for parent, dirs, names in os.walk(folder):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(parent, d))]:
            path = os.path.join(parent, name)
            key = os.path.relpath(path, folder)
            found[key] = ("-> " + os.readlink(path)) if os.path.islink(path) else \
                hashlib.sha256(open(path, "rb").read()).hexdigest()
    return found


def interrupt_when_blocked(proc, fifo, timeout=120):
    """Ctrl-C for proc once it blocks reading the fifo (our open for writing succeeds once it has
    the fifo open for reading), then (stdout, stderr). After the signal the read is ended (empty):
    another thread of the process may have taken the signal, leaving the main thread in the read."""
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
    """Our GPT in eval mode with an N(0, 1) token embedding: GPT-2's init gives near-uniform
    logits, and spread ones keep the endings of a multiple-choice example from nearly tying."""
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
    from trainkit.checkpoints import save_checkpoint
    save_checkpoint(str(path), {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config)})
    return str(path)
