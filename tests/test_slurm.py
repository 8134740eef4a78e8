"""slurm/train_gpt2.sbatch under a real Slurm: munge, slurmctld and slurmd started on this machine, a
one-node cluster, jobs of two CPU ranks. A preempted job (scontrol requeue) checkpoints, comes back
by itself and ends with the losses of an uninterrupted run; a job at its time limit checkpoints
first and requeues itself; the lock a killed attempt leaves stops no later one.

The tests marked slurm need Slurm (Debian: apt-get install slurm-wlm munge; .ci/run installs it when
run as root) and root (slurmd), and are skipped, saying so, without them. About five minutes on a busy
2-core machine: alone with `python -m pytest -q -m slurm tests`, left out with `-m "not slurm"`."""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, free_port, tiny_run_args, torchrun

SCRIPT = "slurm/train_gpt2.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "sinfo")
KILL_WAIT = 15  # seconds a job's processes get between SIGTERM and SIGKILL
CRED_EXPIRE = 5  # seconds a requeued job waits before it may start again (Slurm's default: 120)
T = 16
SHARDS = dict(n_docs=500, seed=4)


def args_for(data_dir, out_dir, steps):
    """The tests' tiny model; every step's loss logged, a checkpoint only at the end or on a stop."""
    return tiny_run_args(
        data_dir, out_dir, steps=steps, n_layer=1, block_size=16, seq_len=T, B=2, rows=4, warmup=1, ckpt_every=0
    )


class Cluster:
    """A one-node Slurm cluster in folder: its daemons, and the commands of a user of it."""

    def __init__(self, folder):
        self.folder, self.conf = folder, os.path.join(folder, "slurm.conf")
        self.daemons = []
        # the job runs the Python that runs the tests (PATH), two ranks on this CPU-only node
        self.env = {
            **os.environ,
            "SLURM_CONF": self.conf,
            "NPROC_PER_NODE": "2",
            "OMP_NUM_THREADS": "1",
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        }

    def run(self, *command, check=True, cwd=None) -> str:
        result = subprocess.run(command, check=False, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=60)
        assert not check or result.returncode == 0, (command, result.stdout, result.stderr)
        return result.stdout

    def start(self):
        key = os.path.join(self.folder, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        socket_path = os.path.join(self.folder, "munge.socket")
        # --force: pytest's folders are private to root, and munged wants its socket's folder open to all
        self._daemon(
            "munged",
            "--force",
            "--foreground",
            f"--socket={socket_path}",
            f"--key-file={key}",
            f"--log-file={self.folder}/munged.log",
            f"--pid-file={self.folder}/munged.pid",
            f"--seed-file={self.folder}/munged.seed",
        )
        wait_for(lambda: os.path.exists(socket_path), 30, "munged's socket", self.logs)
        node = subprocess.run(["slurmd", "-C"], check=True, capture_output=True, text=True, timeout=60).stdout
        node = node.splitlines()[0]  # NodeName=HOST CPUs=... RealMemory=...: this machine as slurmd sees it
        host = node.split()[0].removeprefix("NodeName=")
        for name in ("state", "spool"):
            os.makedirs(os.path.join(self.folder, name))
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path},cred_expire={CRED_EXPIRE}
StateSaveLocation={self.folder}/state
SlurmdSpoolDir={self.folder}/spool
SlurmctldPidFile={self.folder}/slurmctld.pid
SlurmdPidFile={self.folder}/slurmd.pid
SlurmctldLogFile={self.folder}/slurmctld.log
SlurmdLogFile={self.folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
JobRequeue=1
KillWait={KILL_WAIT}
MpiDefault=none
ReturnToService=2
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
        self._daemon("slurmctld", "-D", "-i")
        self._daemon("slurmd", "-D")
        wait_for(
            lambda: self.run("sinfo", "-h", "-o", "%T", check=False).strip() == "idle",
            60,
            "the node to be idle",
            self.logs,
        )

    def _daemon(self, name, *args):
        with open(os.path.join(self.folder, f"{name}.out"), "w") as out:
            self.daemons.append(subprocess.Popen([name, *args], env=self.env, stdout=out, stderr=subprocess.STDOUT))

    def stop(self):
        """Cancel every job, stop the daemons, then kill what is left of this cluster: any process
        whose environment names its slurm.conf (slurmstepd, a job's processes). Each may be gone already."""
        if any(d.poll() is None for d in self.daemons[1:]):
            with contextlib.suppress(Exception):
                jobs = self.run("squeue", "-h", "-o", "%i", check=False).split()
                if jobs:
                    self.run("scancel", *jobs, check=False)
                    poll(lambda: not self.run("squeue", "-h", "-o", "%i", check=False).split(), KILL_WAIT + 30)
        for daemon in reversed(self.daemons):
            with contextlib.suppress(ProcessLookupError):
                daemon.terminate()
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    daemon.kill()
                daemon.wait(timeout=20)
        for pid in processes_with_env(f"SLURM_CONF={self.conf}"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def logs(self) -> str:
        """The daemons' logs, ends only: what a failed wait prints."""
        tails = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log", *(f"{d}.out" for d in DAEMONS)):
            with contextlib.suppress(OSError), open(os.path.join(self.folder, name), errors="replace") as f:
                tails.append(f"--- {name}\n" + "".join(f.readlines()[-15:]))
        return "\n".join(tails)

    def submit(self, out_file, trainer_args, *sbatch_args, cwd=REPO) -> str:
        """The job id of sbatch SCRIPT, from the repository's root as a user submits it, with the
        lines its comments say to change for this cluster overridden on the command line."""
        return (
            self.run(
                "sbatch",
                "--parsable",
                "--gpus-per-node=0",
                "--cpus-per-task=1",
                f"--output={out_file}",
                *sbatch_args,
                os.path.join(REPO, SCRIPT),
                *trainer_args,
                cwd=cwd,
            )
            .strip()
            .split(";")[0]
        )

    def job(self, job_id) -> dict:
        """scontrol's fields of the job (JobState, Restarts, ...)."""
        line = self.run("scontrol", "show", "job", "-o", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", line))


def processes_with_env(entry: str) -> list:
    """The processes (not this one) whose environment holds entry, as NAME=VALUE."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            if entry.encode() in f.read().split(b"\0") and int(pid) != os.getpid():
                found.append(int(pid))
    return found


def poll(condition, timeout) -> bool:
    """Whether condition() became true within timeout seconds (asked every 0.1 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def wait_for(condition, timeout, what, details):
    """poll, failing after timeout seconds with what it waited for and details()."""
    if not poll(condition, timeout):
        pytest.fail(f"gave up after {timeout} s waiting for {what}\n{details()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # (each test that uses it is marked slurm)
    missing = [name for name in DAEMONS + CLIENTS if not shutil.which(name)]
    if missing:
        pytest.skip(
            f"Slurm is not installed (no {', '.join(missing)}): apt-get install slurm-wlm munge, "
            "as .ci/run does when run as root"
        )
    if os.geteuid() != 0:
        pytest.skip("slurmd runs as root, and these tests run as another user")
    try:  # the script's rendezvous is at the node's name, which slurmd takes from the host name
        socket.gethostbyname(socket.gethostname().split(".")[0])
    except OSError:
        pytest.skip(f"this machine's host name {socket.gethostname()} does not resolve to an address")
    cluster = Cluster(str(tmp_path_factory.mktemp("slurm")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def read(path) -> str:
    with contextlib.suppress(FileNotFoundError), open(path, errors="replace") as f:
        return f.read()
    return ""


def job_details(cluster, output):
    """What a failed wait for a job prints: the ends of its output and of the daemons' logs."""
    return lambda: read(output)[-3000:] + "\n" + cluster.logs()


def running_again(cluster, job_id) -> bool:
    """Whether the job runs its second attempt."""
    job = cluster.job(job_id)
    return (job["JobState"], job["Restarts"]) == ("RUNNING", "1")


def torchrun_started(cluster, job_id) -> bool:
    """Whether the job's step runs torchrun (its task, as scontrol listpids names it, has exec'd it)."""
    listed = cluster.run("scontrol", "listpids", f"{job_id}.0", check=False).splitlines()[1:]
    for pid in (line.split()[0] for line in listed if line.split()[0].isdigit()):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"torch.distributed.run" in f.read():
                return True
    return False


def logged_steps(out_dir) -> list:
    """(step, loss) of every step record in out_dir's log.jsonl so far."""
    records = [json.loads(line) for line in read(os.path.join(out_dir, "log.jsonl")).splitlines() if line.endswith("}")]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def stop_step(output: str) -> int:
    """The step of the trainer's one 'stopped by signal' line."""
    steps = re.findall(r"^stopped by signal at step (\d+); checkpoint ", output, re.MULTILINE)
    assert len(steps) == 1, output
    return int(steps[0])


def test_the_script_outside_a_job_says_to_submit_it(tmp_path):
    """Run with bash instead of sbatch, the script starts nothing: one line, exit code 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(
        ["bash", SCRIPT, "--out-dir", str(tmp_path / "out")],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stdout, result.stderr) == (
        2,
        "",
        "error: no Slurm job here (SLURM_JOB_ID is not set): submit this script with sbatch\n",
    )
    assert os.listdir(tmp_path) == []


@pytest.mark.slurm
def test_a_job_submitted_from_another_folder_says_where_to_submit_it(cluster, tmp_path):
    """The job's folder is the one sbatch ran in: without train_gpt2.py there the job fails at once,
    exit code 2, with one line in its output."""
    output = tmp_path / "job.out"
    job = cluster.submit(output, [], cwd=tmp_path)
    wait_for(lambda: cluster.job(job)["JobState"] == "FAILED", 60, "the job to fail", job_details(cluster, output))
    assert cluster.job(job)["ExitCode"] == "2:0"
    assert read(output) == f"error: no train_gpt2.py in {tmp_path}: submit the job from the repository's root\n"


@pytest.mark.slurm
def test_a_preempted_job_checkpoints_comes_back_and_ends_as_an_uninterrupted_run(cluster, data_dir, tmp_path):
    """scontrol requeue mid-run (what a preemption does): the trainer gets SIGTERM, finishes its step,
    checkpoints and exits; Slurm starts the job again, the script adds --resume, and the run goes on
    from that checkpoint to the end with the losses of one uninterrupted torchrun of two ranks, bit
    for bit. Prints the time from the requeue to the checkpoint and to the resumed step."""
    steps, out_dir, output = 200, tmp_path / "out", tmp_path / "job.out"
    straight = subprocess.Popen(
        [
            *torchrun("--standalone", "--nproc_per_node=2"),
            "train_gpt2.py",
            *args_for(data_dir, tmp_path / "straight", steps),
        ],
        cwd=REPO,
        env=cluster.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        job = cluster.submit(output, args_for(data_dir, out_dir, steps))
        details = job_details(cluster, output)
        wait_for(lambda: len(logged_steps(out_dir)) >= 10, 180, "10 steps of the job", details)
        requeued = time.time()
        cluster.run("scontrol", "requeue", job)
        wait_for(lambda: "stopped by signal" in read(output), KILL_WAIT + 30, "the preempted run to stop", details)
        stopped = stop_step(read(output))
        checkpoint = out_dir / f"ckpt_{stopped:07d}.pt"
        assert checkpoint.exists()
        checkpointed = checkpoint.stat().st_mtime
        wait_for(lambda: running_again(cluster, job), 120, "the requeued job to run", details)
        restarted = time.time()
        wait_for(
            lambda: any(step == stopped for step, _ in logged_steps(out_dir)),
            180,
            "the requeued job's first step",
            details,
        )
        resumed = time.time()
        wait_for(lambda: cluster.job(job)["JobState"] == "COMPLETED", 180, "the job to complete", details)
        _, err = straight.communicate(timeout=300)
        assert straight.returncode == 0, err[-3000:]
    finally:
        if straight.poll() is None:
            straight.kill()
    text = read(output)
    assert cluster.job(job)["Restarts"] == "1"
    assert text.count(f"resumed from {checkpoint} at step {stopped}\n") == 1, text
    assert sorted(os.listdir(out_dir)) == [checkpoint.name, f"ckpt_{steps:07d}.pt", "log.jsonl"]
    assert [step for step, _ in logged_steps(out_dir)] == list(range(steps))
    assert logged_steps(out_dir) == logged_steps(tmp_path / "straight")
    print(
        f"\npreemption: requeue -> checkpoint on disk {checkpointed - requeued:.1f} s, -> the job running again "
        f"{restarted - requeued:.1f} s (Slurm holds a requeued job {CRED_EXPIRE + 1} s here), -> its first step "
        f"{resumed - requeued:.1f} s"
    )


@pytest.mark.slurm
def test_a_job_at_its_time_limit_checkpoints_and_requeues_itself_and_a_killed_attempts_lock_stops_nothing(
    cluster, data_dir, tmp_path
):
    """Slurm's signal before the time limit (the script's --signal=B:USR1@N, here 60 s before a limit
    cut to 2 minutes once the job trains) makes the script stop the run: the trainer checkpoints and
    the script requeues the job, which resumes from that checkpoint. That attempt's rank 0 is then
    killed outright (SIGKILL), leaving its .lock behind and the job failed; requeued by hand, the
    job resumes again, not stopped by the lock. Prints the time from the signal to the checkpoint
    and from the requeue to the resumed step."""
    out_dir, output = tmp_path / "out", tmp_path / "job.out"
    job = cluster.submit(output, args_for(data_dir, out_dir, 100000), "--time=10", "--signal=B:USR1@60")
    details = job_details(cluster, output)
    wait_for(lambda: logged_steps(out_dir), 180, "the job's first step", details)
    cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=2")  # Slurm checks the limits every 30 s
    wait_for(lambda: "the time limit is near" in read(output), 90, "the signal before the time limit", details)
    signalled = time.time()
    wait_for(lambda: "requeueing job" in read(output), KILL_WAIT + 60, "the script to requeue the job", details)
    requeued = time.time()
    cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=10")  # the next attempt trains until killed
    text = read(output)
    stopped = stop_step(text)
    checkpoint = out_dir / f"ckpt_{stopped:07d}.pt"
    checkpointed = checkpoint.stat().st_mtime
    assert f"train_gpt2.sbatch: checkpointed before the time limit: requeueing job {job}\n" in text
    assert "DUE TO TIME LIMIT" not in text

    resumed_line = f"resumed from {checkpoint} at step {stopped}\n"
    wait_for(lambda: running_again(cluster, job), 120, "the requeued job to run", details)
    restarted = time.time()
    wait_for(
        lambda: any(step == stopped for step, _ in logged_steps(out_dir)), 180, "the requeued job's first step", details
    )
    resumed = time.time()
    assert cluster.job(job)["Restarts"] == "1" and read(output).count(resumed_line) == 1

    lock = read(out_dir / ".lock")
    os.kill(int(lock.split()[1]), signal.SIGKILL)  # rank 0, which holds the lock, dies at once (as by the OOM killer)
    wait_for(lambda: cluster.job(job)["JobState"] == "FAILED", KILL_WAIT + 60, "the killed attempt to fail", details)
    assert read(out_dir / ".lock") == lock
    cluster.run("scontrol", "requeue", job)
    wait_for(lambda: read(output).count(resumed_line) == 2, 180, "the attempt after the kill to resume", details)
    wait_for(lambda: len(logged_steps(out_dir)) > stopped + 1, 60, "its steps", details)
    assert "is in use by another training run" not in read(output)
    cluster.run("scancel", job)
    print(
        f"\ntime limit: signal -> checkpoint on disk {checkpointed - signalled:.1f} s, -> the run's processes gone "
        f"and the job requeued {requeued - signalled:.1f} s; requeue -> the job running "
        f"again {restarted - requeued:.1f} s (Slurm holds a requeued job {CRED_EXPIRE + 1} s here), -> its first "
        f"step {resumed - requeued:.1f} s"
    )


@pytest.mark.slurm
def test_a_time_limit_before_the_first_checkpoint_is_not_requeued(cluster, data_dir, tmp_path):
    """The signal before the time limit while the run is still starting (no checkpoint written, none
    to come): the script does not requeue a job that would meet the same limit again, and says so."""
    out_dir, output = tmp_path / "out", tmp_path / "job.out"
    job = cluster.submit(output, args_for(data_dir, out_dir, 100000))
    details = job_details(cluster, output)
    # torchrun runs (so the script's trap is set, and the SIGTERM it sends finds it): the signal Slurm sends
    # before the time limit
    wait_for(lambda: torchrun_started(cluster, job), 60, "torchrun to start", details)
    cluster.run("scancel", "--batch", "--signal=USR1", job)
    wait_for(lambda: cluster.job(job)["JobState"] == "FAILED", KILL_WAIT + 60, "the job to fail", details)
    text = read(output)
    assert text.startswith("train_gpt2.sbatch: the time limit is near: stopping the run\n"), text
    assert text.endswith(f"error: the time limit came before this job wrote a checkpoint in {out_dir}: not requeued\n")
    assert (cluster.job(job)["Restarts"], cluster.job(job)["ExitCode"]) == ("0", "1:0")
    assert not list(out_dir.glob("ckpt_*.pt"))


@pytest.mark.slurm
def test_a_job_slurm_will_not_requeue_says_how_to_go_on(cluster, data_dir, tmp_path):
    """At the time limit's signal a job sent with --no-requeue checkpoints as any other, and the script,
    which cannot requeue it, says how to continue instead of leaving the run stopped without a word."""
    out_dir, output = tmp_path / "out", tmp_path / "job.out"
    job = cluster.submit(output, args_for(data_dir, out_dir, 100000), "--no-requeue")
    details = job_details(cluster, output)
    wait_for(lambda: logged_steps(out_dir), 180, "the job's first step", details)
    cluster.run("scancel", "--batch", "--signal=USR1", job)  # what Slurm sends before the time limit
    wait_for(lambda: cluster.job(job)["JobState"] == "FAILED", KILL_WAIT + 60, "the job to fail", details)
    text = read(output)
    stopped = stop_step(text)
    assert (out_dir / f"ckpt_{stopped:07d}.pt").exists()
    assert text.endswith(
        f"train_gpt2.sbatch: checkpointed before the time limit: requeueing job {job}\n"
        f"Requested operation is presently disabled for job {job}\n"
        f"error: Slurm did not requeue job {job}: to go on, submit the same command plus --resume\n"
    )
    assert (cluster.job(job)["Restarts"], cluster.job(job)["ExitCode"]) == ("0", "1:0")
