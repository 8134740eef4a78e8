"""Shared test setup: the repo on sys.path, offline BPE and data from ../shared."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO))

if "TIKTOKEN_CACHE_DIR" not in os.environ and (SHARED / "tiktoken_cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED / "tiktoken_cache")


@pytest.fixture
def shared_data():
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip("../shared/data is not present")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*launch_args) -> list:
    """The command prefix of a torchrun launch (as a module, so the test's Python runs it)."""
    return [sys.executable, "-m", "torch.distributed.run", *launch_args]


def run_cli(args, nproc=1, script="train_gpt2.py", env=None):
    """`python script args`, or a torchrun of nproc processes, in the repo: the completed process
    with its output as text. env: variables to set on top of this process's environment."""
    launcher = torchrun("--standalone", f"--nproc_per_node={nproc}") if nproc > 1 else [sys.executable]
    return subprocess.run([*launcher, script, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
