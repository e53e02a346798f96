"""A real one-machine SLURM for the tests: munged + slurmctld + slurmd as root, no systemd, all state in a temp dir.

    python -m pytest tests/test_slurm.py        # uses it through the `slurm` fixture
    python tests/slurm_cluster.py               # start one, print how to use it, stop it on Enter

Needs root and the Debian packages `slurmctld slurmd slurm-client munge` (`bash .ci/install-slurm.sh`).
Nothing outside the temp dir is touched: our own munge key and socket, our own slurm.conf (clients find
it through SLURM_CONF), free TCP ports, daemons run in the foreground as our children and are stopped by
their pids. `unavailable_reason()` says precisely why a cluster cannot run here, for a skip message.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "sinfo")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")

# ProctrackType=linuxproc and TaskPlugin=none: no cgroups or systemd needed. The node has the machine's
# real core count; Sockets/Cores must multiply to it or slurmd refuses the layout.
SLURM_CONF = """\
ClusterName=pytest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
# our own munged; a requeued job may start again only cred_expire+1 s later (default 120 s)
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} Sockets=1 CoresPerSocket={cpus} ThreadsPerCore=1 \\
  RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _which(name: str) -> str | None:
    """PATH first, then the sbin dirs a non-login root shell may lack."""
    found = [os.path.join(d, name) for d in SBIN if os.access(os.path.join(d, name), os.X_OK)]
    return shutil.which(name) or (found[0] if found else None)


def _die_with_parent() -> None:
    """In the daemon, before exec: SIGTERM when the test process dies, even by SIGKILL (Linux prctl)."""
    _LIBC.prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the forked child must not import or load anything


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unavailable_reason() -> str | None:
    """None if a cluster can be started here, else why not (for pytest.skip)."""
    if sys.platform != "linux":
        return f"SLURM test needs Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "SLURM test needs root (it starts munged, slurmctld and slurmd); run `bash .ci/run` as root"
    missing = [b for b in BINARIES if _which(b) is None]
    if missing:
        return (f"SLURM test needs {', '.join(missing)}: install with `bash .ci/install-slurm.sh` "
                "(Debian packages slurmctld slurmd slurm-client munge)")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "SLURM test needs the user 'munge' (created by the Debian munge package)"
    return None


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """One node named `hostname -s`, one partition `debug`; use `env` for every client command."""

    def __init__(self):
        self.host = socket.gethostname().split(".")[0]  # slurmd identifies its node by the short host name
        self.root = tempfile.mkdtemp(prefix="pytest-slurm-")
        os.chmod(self.root, 0o755)  # munged runs as user munge and must reach its socket dir below
        self.conf = os.path.join(self.root, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self._procs: list[tuple[str, subprocess.Popen]] = []

    # ------------------------------------------------------------ start / stop

    def start(self, timeout: float = 60) -> "SlurmCluster":
        try:
            self._start_munge()
            self._write_conf()
            for name, args in (("slurmctld", ["-D", "-i"]), ("slurmd", ["-D"])):  # -D: foreground, we own the pid
                log = open(os.path.join(self.root, f"{name}.stdout"), "w")
                self._procs.append((name, subprocess.Popen([_which(name), *args, "-f", self.conf], env=self.env,
                                                           stdout=log, stderr=subprocess.STDOUT,
                                                           preexec_fn=_die_with_parent)))
            self._wait(lambda: self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip() == "idle",
                       timeout, "node to become idle")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self) -> None:
        munge = pwd.getpwnam("munge")
        mdir = os.path.join(self.root, "munge")
        os.makedirs(mdir, mode=0o700)
        key = os.path.join(mdir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        for p in (mdir, key):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        os.chmod(mdir, 0o755)  # clients (root here) connect to the socket inside
        self.munge_socket = os.path.join(mdir, "munge.socket")
        log = open(os.path.join(self.root, "munged.stdout"), "w")
        proc = subprocess.Popen(
            [_which("munged"), "-F", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--pid-file={mdir}/munged.pid", f"--seed-file={mdir}/munged.seed", f"--log-file={mdir}/munged.log"],
            user=munge.pw_uid, group=munge.pw_gid, extra_groups=[], stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent)
        self._procs.append(("munged", proc))
        self._wait(lambda: os.path.exists(self.munge_socket) or proc.poll() is not None, 20, "munged socket")
        if proc.poll() is not None:
            raise SlurmError(f"munged exited with {proc.returncode}: {self._tail('munged.stdout')}")

    def _write_conf(self) -> None:
        os.makedirs(os.path.join(self.root, "state"))
        os.makedirs(os.path.join(self.root, "spool"))
        mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 * 9 // 10
        with open(self.conf, "w") as f:
            f.write(SLURM_CONF.format(host=self.host, root=self.root, ctld_port=_free_port(),
                                      slurmd_port=_free_port(), munge_socket=self.munge_socket,
                                      cpus=os.cpu_count(), mem_mb=mem_mb))

    def stop(self) -> None:
        """Cancel every job, wait for them to end, then stop the daemons by pid (newest first)."""
        if any(name == "slurmctld" and p.poll() is None for name, p in self._procs):
            self.run("scancel", "--full", "--signal=KILL", "--state=RUNNING", check=False)
            self.run("scancel", "--state=PENDING", check=False)
            try:
                self._wait(lambda: not self.run("squeue", "-h", check=False).stdout.strip(), 30, "jobs to end")
            except SlurmError:
                pass  # the daemons go anyway; the log says which job hung
        for _name, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._procs = []

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------ clients

    def run(self, *cmd: str, check: bool = True, env: dict | None = None, timeout: float = 30
            ) -> subprocess.CompletedProcess:
        out = subprocess.run([_which(cmd[0]), *cmd[1:]], env={**self.env, **(env or {})}, capture_output=True,
                             text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr.strip()}")
        return out

    def sbatch(self, *args: str, env: dict | None = None) -> int:
        return int(self.run("sbatch", "--parsable", *args, env=env).stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def _wait(self, cond, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise SlurmError(f"timed out after {timeout:.0f}s waiting for {what}; logs in {self.root}:\n"
                                 + self.logs_tail())
            time.sleep(0.2)

    def _tail(self, name: str, n: int = 15) -> str:
        try:
            with open(os.path.join(self.root, name), errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def logs_tail(self) -> str:
        return "".join(f"--- {n}\n{self._tail(n)}" for n in ("slurmctld.log", "slurmd.log", "munge/munged.log"))


if __name__ == "__main__":
    reason = unavailable_reason()
    if reason:
        sys.exit(reason)
    cluster = SlurmCluster().start()
    print(f"SLURM is up; in another shell:  export SLURM_CONF={cluster.conf}; sinfo")
    try:
        input("press Enter to stop ")
    finally:
        cluster.stop()
        cluster.cleanup()
