"""slurm/train_gpt2.sbatch under a real one-node Slurm started here (jobs of two CPU ranks): one job stopped every
way a job stops, each attempt resuming, with the losses of an uninterrupted run. Tests marked slurm need Slurm
(apt-get install slurm-wlm munge, as .ci/run does) and root, else are skipped. About three busy minutes."""

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

from conftest import REPO, assert_refused, free_port, kill_pids, start, tiny_run_args, torchrun

SCRIPT = "slurm/train_gpt2.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "sinfo")
KILL_WAIT = 15  # seconds a job's processes get between SIGTERM and SIGKILL
CRED_EXPIRE = 5  # seconds a requeued job waits before it may start again (Slurm's default: 120)
SHARDS = dict(n_docs=500, seed=4)


def args_for(data_dir, out_dir):
    """A tiny model trained until stopped; every step's loss logged, a checkpoint only on a stop."""
    return tiny_run_args(
        data_dir, out_dir, steps=100000, n_layer=1, block_size=16, seq_len=16, B=2, rows=4, warmup=1, ckpt_every=0
    )


class Cluster:
    """A one-node Slurm cluster in folder: its daemons, and the commands of a user of it."""

    def __init__(self, folder):
        self.folder, self.conf, self.daemons = folder, folder / "slurm.conf", []  # (folder: a pathlib.Path)
        # the job runs the Python that runs the tests (PATH), two ranks on this CPU-only node
        path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        ours = dict(SLURM_CONF=str(self.conf), NPROC_PER_NODE="2", OMP_NUM_THREADS="1", PATH=path)
        self.env = {**os.environ, **ours}

    def run(self, *command, check=True, cwd=None) -> str:
        result = subprocess.run(command, check=False, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=60)
        assert not check or result.returncode == 0, (command, result.stdout, result.stderr)
        return result.stdout

    def start(self):
        key, socket_path = self.folder / "munge.key", self.folder / "munge.socket"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # --force: pytest's folders are private to root, and munged wants its socket's folder open to all
        files = [f"--{kind}-file={self.folder}/munged.{kind}" for kind in ("log", "pid", "seed")]
        self._daemon("munged", "--force", "--foreground", f"--socket={socket_path}", f"--key-file={key}", *files)
        wait_for(socket_path.exists, 30, "munged's socket", self.logs)
        node = subprocess.run(["slurmd", "-C"], check=True, capture_output=True, text=True, timeout=60).stdout
        node = node.splitlines()[0]  # NodeName=HOST CPUs=... RealMemory=...: this machine as slurmd sees it
        host = node.split()[0].removeprefix("NodeName=")
        (self.folder / "state").mkdir(), (self.folder / "spool").mkdir()
        self.conf.write_text(f"""ClusterName=test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
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
KillWait={KILL_WAIT}
ReturnToService=2
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")  # Slurm's defaults otherwise: root, munge, requeue, no MPI
        self._daemon("slurmctld", "-D", "-i")
        self._daemon("slurmd", "-D")
        idle = lambda: self.run("sinfo", "-h", "-o", "%T", check=False).strip() == "idle"
        wait_for(idle, 60, "the node to be idle", self.logs)

    def _daemon(self, name, *args):
        with open(self.folder / f"{name}.out", "w") as out:
            self.daemons.append(subprocess.Popen([name, *args], env=self.env, stdout=out, stderr=subprocess.STDOUT))

    def stop(self):
        """Cancel every job, stop the daemons, then kill any process whose environment names this slurm.conf."""
        if any(d.poll() is None for d in self.daemons[1:]):
            with contextlib.suppress(Exception):
                jobs = self.run("squeue", "-h", "-o", "%i", check=False).split()
                if jobs:
                    self.run("scancel", *jobs, check=False)
                    wait_for(lambda: not self.run("squeue", "-h", "-o", "%i", check=False).split(), KILL_WAIT + 30)
        for daemon in reversed(self.daemons):  # (Popen's terminate and kill: no error for a process gone already)
            daemon.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.wait(timeout=20)
            daemon.kill()
            daemon.wait(timeout=20)
        kill_pids(processes_with_env(f"SLURM_CONF={self.conf}"))

    def logs(self) -> str:
        """The ends of the daemons' logs: what a failed wait prints."""
        tails = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log", *(f"{d}.out" for d in DAEMONS)):
            with contextlib.suppress(OSError), open(self.folder / name, errors="replace") as f:
                tails.append(f"--- {name}\n" + "".join(f.readlines()[-15:]))
        return "\n".join(tails)

    def submit(self, out_file, trainer_args, *sbatch_args, cwd=REPO) -> str:
        """The job id of sbatch SCRIPT, from the repository's root, the lines its comments say to change overridden."""
        sbatch = ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={out_file}"]
        return self.run(*sbatch, *sbatch_args, f"{REPO}/{SCRIPT}", *trainer_args, cwd=cwd).strip().split(";")[0]

    def details(self, output):  # what a failed wait for a job prints
        return lambda: read(output)[-3000:] + "\n" + self.logs()

    def job(self, job_id) -> dict:  # scontrol's fields of the job (JobState, Restarts, ...)
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "show", "job", "-o", job_id)))


def processes_with_env(entry: str) -> list:
    """The processes (not this one) whose environment holds entry (NAME=VALUE)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            if entry.encode() in f.read().split(b"\0") and int(pid) != os.getpid():
                found.append(int(pid))
    return found


def wait_for(condition, timeout, what=None, details=None) -> bool:
    """Whether condition() held within timeout s (asked every 0.25 s); with what, a failure saying so and details()."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            if what:
                pytest.fail(f"gave up after {timeout} s waiting for {what}\n{details()}")
            return False
        time.sleep(0.25)
    return True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # (each test that uses it is marked slurm)
    if missing := [name for name in DAEMONS + CLIENTS if not shutil.which(name)]:
        pytest.skip(
            f"Slurm is not installed (no {', '.join(missing)}): apt-get install slurm-wlm munge, as .ci/run does"
        )
    if os.geteuid() != 0:
        pytest.skip("slurmd runs as root, and these tests run as another user")
    try:  # the script's rendezvous is at the node's name, which slurmd takes from the host name
        socket.gethostbyname(socket.gethostname().split(".")[0])
    except OSError:
        pytest.skip(f"this machine's host name {socket.gethostname()} does not resolve to an address")
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def read(path) -> str:
    with contextlib.suppress(FileNotFoundError), open(path, errors="replace") as f:
        return f.read()
    return ""


def torchrun_started(cluster, job_id) -> bool:
    """Whether the job's step (scontrol listpids) has exec'd torchrun."""
    listed = cluster.run("scontrol", "listpids", f"{job_id}.0", check=False).splitlines()[1:]
    for pid in (line.split()[0] for line in listed if line.split()[0].isdigit()):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"torch.distributed.run" in f.read():
                return True
    return False


def logged_steps(out_dir) -> list:
    """(step, loss) of every whole step record in out_dir's log.jsonl so far."""
    records = [json.loads(line) for line in read(out_dir / "log.jsonl").splitlines() if line.endswith("}")]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def stop_step(output: str) -> int:
    """The step of the trainer's one 'stopped by signal' line."""
    steps = re.findall(r"^stopped by signal at step (\d+); checkpoint ", output, re.MULTILINE)
    assert len(steps) == 1, output
    return int(steps[0])


def test_the_script_outside_a_job_says_to_submit_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # run with bash instead of sbatch
    result = subprocess.run(
        ["bash", SCRIPT, "--out-dir", tmp_path / "out"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert_refused(result, "no Slurm job here (SLURM_JOB_ID is not set): submit this script with sbatch")
    assert result.stdout == "" and os.listdir(tmp_path) == []


@pytest.mark.slurm
def test_a_job_submitted_from_another_folder_says_where_to_submit_it(cluster, tmp_path):
    """The job's folder is the one sbatch ran in: without train_gpt2.py there, the job fails at once (exit 2)."""
    output = tmp_path / "job.out"
    job = cluster.submit(output, [], cwd=tmp_path)
    wait_for(lambda: cluster.job(job)["JobState"] == "FAILED", 60, "the job to fail", cluster.details(output))
    assert cluster.job(job)["ExitCode"] == "2:0"
    assert read(output) == f"error: no train_gpt2.py in {tmp_path}: submit the job from the repository's root\n"


@pytest.mark.slurm
def test_one_job_stopped_every_way_resumes_each_time_with_the_losses_of_an_uninterrupted_run(
    cluster, data_dir, tmp_path
):
    """One job of five attempts, each ended another way: 1, the time limit's USR1 while the run still starts; 2,
    preempted (SIGTERM: a checkpoint, requeued, the script adds --resume); 3, Slurm's own signal 170 s before a
    limit cut to 3 minutes; 4, rank 0 SIGKILLed, its .lock left; 5, resumed despite the lock, then the time limit
    of a job Slurm will not requeue. Every step logged once, with the losses of one uninterrupted 2-rank torchrun,
    bit for bit. Prints the time from each stop to the resumed step."""
    out_dir, output, straight_dir = tmp_path / "out", tmp_path / "job.out", tmp_path / "straight"
    job = cluster.submit(output, args_for(data_dir, out_dir), "--time=30", "--signal=B:USR1@170")
    details, seen, times = cluster.details(output), 0, []

    def attempt_ended(restarts, what, state=None) -> str:
        """The ended attempt's output, once the job has restarted that often (and is in state)."""
        nonlocal seen
        ended = lambda: (lambda j: j["Restarts"] == str(restarts) and state in (None, j["JobState"]))(cluster.job(job))
        wait_for(ended, KILL_WAIT + 90, what, details)
        text = read(output)[seen:]
        seen += len(text)
        return text

    def resumed(stopped, restarts):
        """Until the attempt after restarts has trained step stopped, resumed from its checkpoint."""
        line = f"resumed from {out_dir / f'ckpt_{stopped:07d}.pt'} at step {stopped}\n"
        trained = lambda: f"step {stopped:5d}/" in read(output)[seen:].partition(line)[2]
        wait_for(trained, 240, "a resumed step", details)
        assert cluster.job(job)["Restarts"] == str(restarts) and read(output)[seen:].count(line) == 1
        times.append(time.time())

    # 1: the time limit's signal once torchrun runs (the script's trap is set, and the SIGTERM it sends finds it)
    wait_for(lambda: torchrun_started(cluster, job), 60, "torchrun to start", details)
    cluster.run("scancel", "--batch", "--signal=USR1", job)
    text = attempt_ended(0, "the first attempt to fail", "FAILED")
    assert text.startswith("train_gpt2.sbatch: the time limit is near: stopping the run\n"), text
    assert text.endswith(f"error: the time limit came before this job wrote a checkpoint in {out_dir}: not requeued\n")
    assert cluster.job(job)["ExitCode"] == "1:0" and not list(out_dir.glob("ckpt_*.pt"))
    cluster.run("scontrol", "requeue", job)

    # 2: preempted
    wait_for(lambda: logged_steps(out_dir), 240, "the job's first step", details)
    times.append(time.time())
    cluster.run("scontrol", "requeue", job)
    wait_for(lambda: "stopped by signal" in read(output)[seen:], KILL_WAIT + 30, "the preempted run to stop", details)
    stops = [stop_step(attempt_ended(2, "the preempted job to be requeued"))]
    resumed(stops[0], 2)
    # the uninterrupted run, stopped once it has trained as far as the job
    cmd = [*torchrun("--standalone", "--nproc_per_node=2"), "train_gpt2.py", *args_for(data_dir, straight_dir)]
    straight = start(cmd, env=cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # 3: at the time limit, which the signal is due 170 s before: at Slurm's next check of the limits (every 30 s)
        cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=3")
        near = lambda: "the time limit is near" in read(output)[seen:]
        wait_for(near, 90, "the signal before the time limit", details)
        times.append(time.time())
        text = attempt_ended(3, "the script to requeue the job")
        cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=30")  # the next attempts train until stopped
        stops.append(stop_step(text))
        assert f"train_gpt2.sbatch: checkpointed before the time limit: requeueing job {job}\n" in text, text
        assert "DUE TO TIME LIMIT" not in text
        resumed(stops[1], 3)

        # 4: rank 0, which holds the lock, dies at once (as by the OOM killer)
        lock = read(out_dir / ".lock")
        os.kill(int(lock.split()[1]), signal.SIGKILL)
        attempt_ended(3, "the killed attempt to fail", "FAILED")
        assert read(out_dir / ".lock") == lock
        cluster.run("scontrol", "requeue", job)

        # 5: resumed from the same checkpoint; then a job Slurm will not requeue
        resumed(stops[1], 4)
        cluster.run("scontrol", "update", f"JobId={job}", "Requeue=0")
        cluster.run("scancel", "--batch", "--signal=USR1", job)
        text = attempt_ended(4, "the last attempt to fail", "FAILED")
        stops.append(stop_step(text))
        assert "is in use by another training run" not in text
        assert text.endswith(
            f"train_gpt2.sbatch: checkpointed before the time limit: requeueing job {job}\n"
            f"Requested operation is presently disabled for job {job}\n"
            f"error: Slurm did not requeue job {job}: to go on, submit the same command plus --resume\n"
        )
        assert cluster.job(job)["ExitCode"] == "1:0"
        wait_for(lambda: len(logged_steps(straight_dir)) >= stops[2], 300, "the straight run's steps", details)
        straight.send_signal(signal.SIGTERM)  # (torchrun exits 1, reporting the signal it passed on)
        straight.wait(timeout=120)
    finally:
        if straight.poll() is None:
            straight.kill()
    assert sorted(p.name for p in out_dir.glob("ckpt_*.pt")) == [f"ckpt_{step:07d}.pt" for step in stops]
    assert [step for step, _ in logged_steps(out_dir)] == list(range(stops[2]))
    assert logged_steps(out_dir) == logged_steps(straight_dir)[: stops[2]]
    on_disk = [(out_dir / f"ckpt_{stops[i]:07d}.pt").stat().st_mtime - times[2 * i] for i in (0, 1)]
    print(
        f"\npreemption: requeue -> checkpoint on disk {on_disk[0]:.1f} s, -> the resumed job's first step "
        f"{times[1] - times[0]:.1f} s; time limit: USR1 -> checkpoint on disk {on_disk[1]:.1f} s, -> the resumed "
        f"job's first step {times[3] - times[2]:.1f} s (Slurm holds a requeued job {CRED_EXPIRE + 1} s here)"
    )
