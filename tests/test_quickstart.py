"""quickstart.sh in a fresh clone as a user runs it (tiny overrides, the test's own venv, offline, no
TIKTOKEN_CACHE_DIR), then rerun: it resumes and reuses."""

import hashlib
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import REPO, kill_group, run_command, start, wait_for, with_env
from trainkit.evaluation.hellaswag_examples import DATA_URL

TINY_DATA = "--max-tokens 40K --shard-size 8K"  # 5 shards of 8K tokens (the first is validation)
FEW_EXAMPLES = "--limit 8"  # of HellaSwag (200 take 20 s on a CPU)
OUT = "out/quick[1]*"  # an out dir named like a glob pattern is still that folder
TINY_TRAIN = f"--out-dir {OUT} --max-steps 3 --batch-size 4 --total-batch-size 512 --val-every 2 --val-steps 2".split()
TINY_TRAIN += "--sample-every 0 --ckpt-every 2".split()


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout of the repo")
    if sys.prefix == sys.base_prefix:
        pytest.skip("needs the tests to run in a virtual environment, which quickstart.sh then uses")
    path = tmp_path_factory.mktemp("quickstart") / "repo"
    subprocess.run(["git", "clone", "-q", str(REPO), str(path)], check=True, timeout=60)
    return path


# proxies that refuse every connection: a machine without internet
OFFLINE = dict.fromkeys(("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"), "http://127.0.0.1:9")


def quickstart_env(clone, **env) -> dict:
    """Offline (OFFLINE's proxies), no TIKTOKEN_CACHE_DIR: the GPT-2 BPE from the clone's bpe/; env on top."""
    tiny = dict(QUICKSTART_FINEWEB_ARGS=TINY_DATA, QUICKSTART_HELLASWAG_ARGS=FEW_EXAMPLES, OMP_NUM_THREADS="1")
    cache = dict(TIKTOKEN_CACHE_DIR=None, DATA_GYM_CACHE_DIR=None, HELLASWAG_DIR=str(clone / "hellaswag"))
    return {**OFFLINE, **tiny, **cache, "QUICKSTART_VENV": sys.prefix, **env}


def bash(*args, cwd=REPO, timeout=60, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], cwd=cwd, env=with_env(env), capture_output=True, text=True, timeout=timeout)


def quickstart(clone, *args, **env):
    return bash("quickstart.sh", *args, cwd=clone, timeout=600, **quickstart_env(clone, **env))


def test_help_prints_the_usage_and_does_nothing(clone):
    proc = bash("quickstart.sh", "--max-steps", "5", "--help", cwd=clone, QUICKSTART_VENV=str(clone / "no-venv"))
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.startswith("From a fresh clone to a trained GPT-2")
    assert "(python train_gpt2.py --help lists them)" in proc.stdout and "QUICKSTART_VENV" in proc.stdout
    assert not (clone / "no-venv").exists()


def test_quickstart_runs_then_reuses_resumes_and_stops_on_ctrl_c(clone, tmp_path):
    # the later --limit of QUICKSTART_HELLASWAG_ARGS wins, as in argparse
    first = quickstart(clone, *TINY_TRAIN, TMPDIR=str(tmp_path), QUICKSTART_HELLASWAG_ARGS=f"{FEW_EXAMPLES} --limit=3")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = first.stdout
    assert "creating the virtual environment" not in out  # QUICKSTART_VENV is used as it is
    assert "quickstart: tokenizing the Python standard library" in out
    assert "step     2/3 | loss" in out and "step     3 | val loss" in out
    # the --limit of QUICKSTART_HELLASWAG_ARGS; offline, of the subset the repository ships, said so
    hellaswag = out.split("quickstart: HellaSwag, first 3 examples\n", 1)[1].splitlines()[:4]
    assert hellaswag[:3] == [
        f"quickstart: cannot download HellaSwag from {DATA_URL} ([Errno 111] Connection refused): scoring the subset shipped in fixtures/ instead",
        f"hellaswag: scoring {OUT}/ckpt_0000003.pt, step 3",
        "hellaswag: the first 3 of 446 examples in fixtures/hellaswag_val_subset.jsonl (the subset the repository ships, not the full 10042-example set); chance is 0.25",
    ]
    assert hellaswag[3].startswith('{"acc": ') and hellaswag[3].endswith(', "n": 3}')
    assert "UserWarning" not in out + first.stderr
    run = clone / OUT
    assert f"wrote {run.relative_to(clone) / 'loss.png'}" in out
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples = out.split("quickstart: samples\n", 1)[1]
    headers = [line for line in samples.splitlines() if line.startswith("---")]
    assert headers == [f"--- sample {i}/3 ---" for i in (1, 2, 3)]
    assert samples.split("--- sample 1/3 ---\n", 1)[1].startswith("def ")
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("ckpt_")) == ["ckpt_0000002.pt", "ckpt_0000003.pt"]
    assert not list(tmp_path.glob("quickstart-*"))  # HellaSwag's stderr, kept in a temporary file, is gone
    # the README's next commands need the environment's python: the last lines say how
    assert out.splitlines()[-3:] == [
        f"quickstart: next: the scripts need {sys.prefix}'s python; activate it in your shell, then run them, e.g.:",
        f"  . {sys.prefix}/bin/activate",
        '  python sample.py --checkpoint out/quick\\[1\\]\\* --prompt "def "',
    ]

    # the same command with more steps reuses the data and resumes; Ctrl-C (SIGINT to the whole process group, as
    # a terminal's, which does not ignore it) once it trains stops the trainer with a checkpoint, then the script
    proc = start(
        ["bash", "quickstart.sh", *TINY_TRAIN, "--max-steps", "100000"],
        cwd=clone,
        env=quickstart_env(clone, TMPDIR=str(tmp_path)),
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_for(lambda: '"step": 3, "loss"' in (run / "log.jsonl").read_text(), proc, timeout=600, what="step 3")
        kill_group(proc, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        kill_group(proc)
    assert proc.returncode == 130, stdout[-2000:] + stderr[-2000:]
    same_command = " ".join(TINY_TRAIN).replace(OUT, "out/quick\\[1\\]\\*")  # quoted as bash's printf %q does
    expected = f"quickstart: interrupted; run the same command again to resume: bash quickstart.sh {same_command} --max-steps 100000"
    assert stderr.splitlines()[-1] == expected
    assert "quickstart: reusing the tokenized standard library in data/stdlib" in stdout
    assert f"resumed from {OUT}/ckpt_0000003.pt at step 3" in stdout
    assert "step     3/100000 | loss" in stdout and "step     2/100000" not in stdout
    stopped = int(stdout.split("stopped by signal at step ")[1].split(";")[0])  # checkpointed on the way out
    assert (run / f"ckpt_{stopped:07d}.pt").is_file()
    assert "HellaSwag" not in stdout and "done in" not in stdout
    assert not list(tmp_path.glob("quickstart-*"))


def test_damaged_bpe_is_one_line(clone, tmp_path):
    # offline, without TIKTOKEN_CACHE_DIR, with the shipped BPE damaged: nothing to tokenize with
    bpe = clone / "bpe" / "r50k_base.tiktoken"
    good = bpe.read_bytes()
    bad = good.replace(b" 1000\n", b" 1001\n")
    try:
        bpe.write_bytes(bad)
        proc = quickstart(clone, TMPDIR=str(tmp_path))
    finally:
        bpe.write_bytes(good)
    expected = f"error: could not load the GPT-2 tokenizer: {bpe.resolve()} is damaged (sha256 {hashlib.sha256(bad).hexdigest()[:16]}..., expected 306cd27f03c1a714...); restore it (git checkout -- bpe), or set TIKTOKEN_CACHE_DIR to a folder that holds tiktoken's cached r50k_base file"
    assert (proc.returncode, proc.stderr.splitlines()[-1]) == (2, expected)
    assert "quickstart: tokenizing" not in proc.stdout


def test_a_script_run_by_a_python_without_the_libraries_names_the_venv_beside_it(tmp_path):
    """One line names the environment and both ways to use it; without a .venv there, it says to install the
    requirements."""
    for name in ("sample.py", "trainkit"):
        (tmp_path / name).symlink_to(REPO / name)
    start = "error: cannot import the libraries this script needs (ModuleNotFoundError: No module named 'torch'): "
    venv = "the virtual environment .venv beside it is not active: run `. .venv/bin/activate` first, or .venv/bin/python sample.py"
    for fix in ("reinstall them (pip install -r requirements.txt)", venv):
        if fix == venv:
            (tmp_path / ".venv" / "bin").mkdir(parents=True)
            (tmp_path / ".venv" / "bin" / "python").touch()
        # -S: no site-packages, as a python that lacks the libraries
        proc = run_command("-S", "sample.py", "--checkpoint", "out/quickstart", cwd=tmp_path, timeout=60)
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", start + fix + "\n")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="with an NVIDIA GPU, PyPI's CUDA build is the one")
def test_torch_for_a_linux_machine_without_a_gpu_is_the_cpu_build(tmp_path):
    """.ci/install_torch.sh (quickstart.sh's and .ci/run's): the pinned version's "+cpu" build where offered (the newest
    without a pin), else PyPI's, said so. quickstart.sh without the libraries: torch, the requirements, one line."""
    if os.uname().sysname != "Linux":
        pytest.skip("the CPU build is looked for on Linux only (PyPI's is the CPU one elsewhere)")
    offered = tmp_path / "offered.txt"
    # a venv's python without the libraries (-S): `pip index versions torch` answers offered.txt, `pip install` echoes
    fake_python = tmp_path / "venv" / "bin" / "python"
    fake_python.parent.mkdir(parents=True)
    fake_python.write_text(f"""#!/bin/sh
case "$1 $2 $3" in "-m pip index") cat {offered} ;; "-m pip install") echo "$*" ;; *) exec {sys.executable} -S "$@" ;; esac
""")
    fake_python.chmod(0o755)

    def install(*version):
        script = f'say() {{ echo "say: $*"; }}; PY={fake_python}; PIP=(echo pip install); . .ci/install_torch.sh; install_torch "$@"'
        proc = bash("-c", script, "install", *version, **OFFLINE)
        assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
        return proc.stdout.splitlines()

    offered.write_text("torch (2.14.0)\nAvailable versions: 2.14.0, 2.13.0+cpu, 2.13.0, 2.12.0+cpu, 2.12.0\n")
    assert install("2.13.0") == [
        "say: installing torch 2.13.0+cpu (no NVIDIA GPU: the CPU build)",
        "pip install torch==2.13.0+cpu",
    ]
    assert install("2.12.0")[1] == "pip install torch==2.12.0+cpu"
    assert install()[1] == "pip install torch==2.13.0+cpu"  # the newest CPU build
    offered.write_text("torch (2.14.0)\nAvailable versions: 2.14.0, 2.13.0\n")  # PyPI's list: no +cpu
    assert install("2.13.0") == [
        "say: download.pytorch.org is unreachable: installing PyPI's torch==2.13.0 (its Linux build carries CUDA libraries, larger, and runs on the CPU too)",
        "pip install torch==2.13.0",
    ]
    offered.write_text("torch (2.14.0)\nAvailable versions: 2.14.0, 2.13.0+cpu, 2.13.0\n")
    proc = bash("quickstart.sh", QUICKSTART_VENV=str(fake_python.parent.parent), TMPDIR=str(tmp_path), **OFFLINE)
    assert (proc.returncode, proc.stderr) == (2, "error: the installs left out: torch numpy tiktoken\n")
    assert proc.stdout.splitlines() == [
        "quickstart: installing torch 2.13.0+cpu (no NVIDIA GPU: the CPU build)",
        "-m pip install -q torch==2.13.0+cpu",
        "-m pip install -q -r requirements.txt matplotlib>=3.7",
    ]
