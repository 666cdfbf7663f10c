"""A real two-node Slurm on this host for the tests: munged, slurmctld and two slurmd.

Debian's slurm-wlm 22.05 + munge (``make sysdeps``) run as root. Everything the
daemons read or write lives under one temp dir: slurm.conf, gres.conf, spool,
state, logs, a private munge key and socket, and the emulated GPUs (character
devices 195:N, which Slurm's GRES plugin accepts; they are not usable GPUs, so
the checks judge visibility from ``CUDA_VISIBLE_DEVICES``). Nodes ``n1`` and
``n2`` both run here (``NodeAddr=127.0.0.1``, one slurmd port each) and declare
the shape of the real target, 16 CPUs and 8 GPUs per node
(``SlurmdParameters=config_overrides`` lets slurmd declare more than the host has).

Teardown cancels the jobs, stops slurmd before slurmctld (slurmd ignores SIGTERM
while slurmctld is down), then munged, and kills any process still holding the
temp dir in its environment (job steps), so nothing outlives the session.

    from slurm_cluster import slurm  # noqa: F401  (the session fixture)
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dsr1kit.cluster.rendezvous import free_port

NODES = ("n1", "n2")
CPUS_PER_NODE = 16
GPUS_PER_NODE = 8
DAEMONS = ("munged", "slurmctld", "slurmd")
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when pytest dies, even by SIGKILL."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Job:
    job_id: int
    state: str
    exit_code: str
    output: str


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    # -- set-up ---------------------------------------------------------------------------
    @classmethod
    def create(cls) -> "SlurmCluster":
        root = Path(tempfile.mkdtemp(prefix="dsr1kit-slurm-"))
        root.chmod(0o755)  # munged requires its socket dir to be searchable by all
        for d in ("state", "spool", "log", "dev"):
            (root / d).mkdir()
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for i in range(GPUS_PER_NODE):  # emulated GPUs: the NVIDIA major number, no driver behind it
            os.mknod(root / "dev" / f"nvidia{i}", 0o666 | 0o020000, os.makedev(195, i))
        (root / "gres.conf").write_text(
            f"AutoDetect=off\nName=gpu File={root}/dev/nvidia[0-{GPUS_PER_NODE - 1}]\n"
        )
        (root / "slurm.conf").write_text(cls._slurm_conf(root))
        env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        return cls(root, env)

    @staticmethod
    def _slurm_conf(root: Path) -> str:
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} "
            f"CPUs={CPUS_PER_NODE} Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
            for n in NODES
        )
        # A random first job id: jobs derive ports from it (15000/20000 + JOBID % 10000), so two
        # test sessions on one host do not collide.
        first_job_id = random.randrange(1000, 9000, 10)
        return f"""\
ClusterName=dsr1kit-test
FirstJobId={first_job_id}
SlurmctldHost=localhost
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.sock,cred_expire=20
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MinJobAge=600
KillWait=5
GresTypes=gpu
{nodes}
PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "wb")
        self.procs[name] = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )

    def start(self, timeout: float = 60) -> None:
        r = self.root
        self._spawn(
            "munged",
            [
                "munged",
                "-F",
                f"--key-file={r}/munge.key",
                f"--socket={r}/munge.sock",
                f"--pid-file={r}/munged.pid",
                f"--seed-file={r}/munged.seed",
                f"--log-file={r}/log/munged.log",
            ],
        )
        self._wait(lambda: (r / "munge.sock").exists(), 10, "munged socket")
        self._spawn("slurmctld", ["slurmctld", "-D"])
        for n in NODES:
            self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n])
        self._wait(lambda: self.sinfo_states() == ["idle"] * len(NODES), timeout, "both nodes idle")

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.3)
        raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}:\n{self.logs()}")

    def logs(self, tail: int = 2000) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
            for p in sorted((self.root / "log").iterdir())
        )

    # -- use ------------------------------------------------------------------------------
    def run(self, *argv: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(argv),
            env={**self.env, **kw.pop("env", {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )

    def sinfo_states(self) -> list[str]:
        proc = self.run("sinfo", "-h", "-N", "-o", "%T")
        return sorted(proc.stdout.split()) if proc.returncode == 0 else []

    def sbatch(self, *args: str, env: dict[str, str] | None = None, cwd: str | Path | None = None) -> int:
        proc = self.run("sbatch", "--parsable", *args, env=env or {}, cwd=cwd)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {proc.stderr}")
        return int(proc.stdout.strip().split(";")[0])

    def job_fields(self, job_id: int) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_job(self, job_id: int, timeout: float = 300) -> Job:
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job_fields(job_id)
            if fields.get("JobState") in FINAL_STATES:
                out = Path(fields.get("StdOut", ""))
                text = out.read_text(errors="replace") if out.is_file() else ""
                return Job(job_id, fields["JobState"], fields.get("ExitCode", ""), text)
            time.sleep(1)
        self.run("scancel", str(job_id))
        raise TimeoutError(f"job {job_id} still {fields.get('JobState')} after {timeout:g} s:\n{self.logs()}")

    # -- teardown -------------------------------------------------------------------------
    def stop(self) -> None:
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--partition=test", timeout=10)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.run("squeue", "-h").stdout.strip():
                time.sleep(0.5)
        order = [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:  # slurmd first: it ignores SIGTERM once slurmctld is gone
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for pid in self.leftover_pids():  # job steps and tasks that escaped the daemons
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)

    def leftover_pids(self) -> list[int]:
        """Processes whose environment names this cluster's temp dir (SLURM_CONF): ours only."""
        marker = str(self.root).encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker in (entry / "environ").read_bytes() or marker in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
        return pids


def slurm_unavailable() -> str:
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"{', '.join(missing)} not installed: run `make sysdeps` (Debian slurm-wlm munge)"
    if os.geteuid() != 0:
        return "a test Slurm runs its daemons as root"
    return ""


@pytest.fixture(scope="session")
def slurm():
    """One real two-node Slurm for the whole session; stopped (everything killed) after."""
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster.create()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
