"""A real SLURM on this machine for the tests: munged + slurmctld + slurmd(s) as root, no systemd, state in a temp dir.

    python -m pytest tests/test_slurm.py              # one node: this host, loopback (the `slurm` fixture)
    python -m pytest tests/test_slurm_multinode.py    # two hosts, each in its own namespaces
    python tests/slurm_cluster.py [--nodes 2]         # start one, print how to use it, stop it on Enter

Needs root and the Debian packages `slurmctld slurmd slurm-client munge` (`bash .ci/install-slurm.sh`).
Nothing outside the temp dir is touched: our own munge key and socket, our own slurm.conf (clients find
it through SLURM_CONF), daemons run in the foreground as our children and are stopped by their pids.
`unavailable_reason()` says precisely why a cluster cannot run here, for a skip message.

With nodes=N the cluster is N+1 simulated machines (`Host`): slurmctld in one, one slurmd in each of the
others, every one in its own network, UTS (host name) and mount namespaces (its own /etc/hosts and /dev/shm). The
controller's namespace holds a bridge; each node has a veth link `eth0` into it. Traffic never leaves
namespaces created here, and they vanish, links included, once their processes are killed.
"""

from __future__ import annotations

import contextlib
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
NAMESPACE_BINARIES = ("unshare", "nsenter", "ip", "mount", "hostname")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")

# Simulated network: 10.77.0.0/24 exists only inside our namespaces, so it cannot clash with the machine's.
SUBNET, CTL_NAME, NODE_IFNAME = "10.77.0", "slurmctl", "eth0"
# the states a job ends in (a requeued job is PENDING again, not ended)
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")

# ProctrackType=linuxproc and TaskPlugin=none: no cgroups or systemd needed. A node has the machine's
# real core count; Sockets/Cores must multiply to it or slurmd refuses the layout.
SLURM_CONF = """\
ClusterName=pytest
SlurmctldHost={ctl_host}({ctl_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
# our own munged; a requeued job may start again only cred_expire+1 s later (default 120 s)
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
# %n: the node's name, so that several slurmd on one machine keep apart
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
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
KillWait={kill_wait}
MinJobAge=600
# a node that stops answering is DOWN after this many seconds (default 300), its jobs end as NODE_FAIL
SlurmdTimeout={slurmd_timeout}
{nodes}
PartitionName=debug Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
"""
NODE_LINE = ("NodeName={name} NodeAddr={addr} CPUs={cpus} Sockets=1 CoresPerSocket={cpus} ThreadsPerCore=1 "
             "RealMemory={mem_mb} State=UNKNOWN")


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


def _wait(cond, timeout: float, what: str, explain=lambda: "") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise SlurmError(f"timed out after {timeout:.0f}s waiting for {what}\n{explain()}")
        time.sleep(0.2)


def unavailable_reason(nodes: int = 0) -> str | None:
    """None if a cluster can be started here, else why not (for pytest.skip)."""
    if sys.platform != "linux":
        return f"SLURM test needs Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "SLURM test needs root (it starts munged, slurmctld and slurmd); run `bash .ci/run` as root"
    missing = [b for b in BINARIES + (NAMESPACE_BINARIES if nodes else ()) if _which(b) is None]
    if missing:
        return (f"SLURM test needs {', '.join(missing)}: install with `bash .ci/install-slurm.sh` "
                "(Debian packages slurmctld slurmd slurm-client munge; iproute2 util-linux)")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "SLURM test needs the user 'munge' (created by the Debian munge package)"
    return _namespaces_unavailable_reason() if nodes else None


def hosts_unavailable_reason() -> str | None:
    """None if simulated hosts (`SlurmCluster.start_hosts`) can be made here, else why not (no SLURM needed)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "simulated hosts need Linux and root (network, UTS and mount namespaces)"
    missing = [b for b in NAMESPACE_BINARIES if _which(b) is None]
    if missing:
        return f"simulated hosts need {', '.join(missing)} (Debian packages iproute2 util-linux)"
    return _namespaces_unavailable_reason()


def _namespaces_unavailable_reason() -> str | None:
    """Try what the multi-host cluster needs: new net/UTS/mount namespaces, a bridge and a veth pair."""
    try:
        host = Host("probe", None)
    except (OSError, SlurmError) as e:
        return f"multi-node SLURM test cannot create network/UTS/mount namespaces here: {e}"
    try:
        host.sh("ip", "link", "add", "br-probe", "type", "bridge")
        host.sh("ip", "link", "add", "va", "type", "veth", "peer", "name", "vb")
    except SlurmError as e:
        return f"multi-node SLURM test cannot create a bridge or veth link in a namespace: {e}"
    finally:
        host.destroy()
    return None


class SlurmError(RuntimeError):
    pass


class Host:
    """A simulated machine: new network, UTS and mount namespaces, held open by a `sleep` child. Commands
    run in it through `nsenter`; `destroy()` kills every process in it, and with the last one the kernel
    removes the namespaces and their network links."""

    def __init__(self, name: str, hosts_file: str | None):
        self.name, self.netns = name, None
        self.holder = subprocess.Popen(
            [_which("unshare"), "--net", "--uts", "--mount", "--propagation", "private", "--", "sleep", "infinity"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
        try:  # a host that fails halfway is no one's to destroy but its own
            self._set_up(hosts_file)
        except BaseException:
            self.destroy()
            raise

    def _set_up(self, hosts_file: str | None) -> None:
        _wait(lambda: self.holder.poll() is not None or self._comm() == "sleep", 10, f"namespaces of {self.name}")
        if self.holder.poll() is not None:
            raise SlurmError(f"unshare exited {self.holder.returncode}: {self.holder.stderr.read().decode().strip()}")
        self.netns = os.readlink(f"/proc/{self.holder.pid}/ns/net")
        self.sh("hostname", self.name)
        self.sh("ip", "link", "set", "lo", "up")
        self.sh("mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/dev/shm")  # its own, as a machine has
        self.shm = f"/proc/{self.holder.pid}/root/dev/shm"  # that /dev/shm, as this process sees it
        if hosts_file:  # this machine's own name resolution, as DNS or /etc/hosts gives it on a real cluster
            self.sh("mount", "--bind", hosts_file, "/etc/hosts")

    def _comm(self) -> str:
        try:
            with open(f"/proc/{self.holder.pid}/comm") as f:
                return f.read().strip()
        except OSError:
            return ""

    def cmd(self, *argv: str, cwd: str = "/") -> list[str]:
        """`argv` run inside this host (nsenter execs it: the pid is argv's own)."""
        return [_which("nsenter"), f"--target={self.holder.pid}", "--net", "--uts", "--mount", f"--wd={cwd}",
                "--", *argv]

    def sh(self, *argv: str) -> str:
        out = subprocess.run(self.cmd(*argv), capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise SlurmError(f"on {self.name}: {' '.join(argv)} exited {out.returncode}: {out.stderr.strip()}")
        return out.stdout

    def pids(self) -> list[int]:
        """Every process in this host's network namespace but the holder (daemons, jobs, orphans)."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.holder.pid:
                try:
                    if os.readlink(f"/proc/{entry}/ns/net") == self.netns:
                        found.append(int(entry))
                except OSError:
                    pass  # gone meanwhile
        return found

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def destroy(self) -> None:
        """Idempotent; kills what runs in the namespaces even if the holder is already gone (nsenter-ed
        processes keep them alive without it)."""
        if self.netns is not None:
            self.kill_all()
        if self.holder.poll() is None:
            self.holder.kill()
        self.holder.wait()


class SlurmCluster:
    """nodes=0: one node named `hostname -s` on loopback. nodes=N: N hosts `node1`..`nodeN`, each in its
    own namespaces, and the controller in another. One partition `debug`; use `run()` for client commands."""

    def __init__(self, nodes: int = 0, slurmd_timeout: int = 300, kill_wait: int = 30):
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)] or [socket.gethostname().split(".")[0]]
        self.namespaced = nodes > 0
        self.slurmd_timeout, self.kill_wait = slurmd_timeout, kill_wait
        self.root = tempfile.mkdtemp(prefix="pytest-slurm-")
        os.chmod(self.root, 0o755)  # munged runs as user munge and must reach its socket dir below
        self.conf = os.path.join(self.root, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self.hosts: dict[str, Host] = {}  # name -> Host, the controller's included, when namespaced
        self._procs: list[tuple[str, subprocess.Popen]] = []

    def addr(self, name: str) -> str:
        """A host's address on the simulated network."""
        return f"{SUBNET}.1" if name == CTL_NAME else f"{SUBNET}.{10 + self.nodes.index(name) + 1}"

    # ------------------------------------------------------------ start / stop

    def start(self, timeout: float = 60) -> "SlurmCluster":
        try:
            self._start_munge()
            self._write_conf()
            if self.namespaced:
                self._make_network()
            self._start_daemon("slurmctld", CTL_NAME, "-D", "-i")  # -D: foreground, we own the pid
            for node in self.nodes:
                self._start_daemon(f"slurmd-{node}", node, "-D")
            want = "\n".join(["idle"] * len(self.nodes))
            _wait(lambda: self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip() == want,
                  timeout, "nodes to become idle", self.logs_tail)
        except BaseException:
            self.stop()
            raise
        return self

    def start_hosts(self) -> "SlurmCluster":
        """The hosts and their network only, no munge or SLURM daemons (tests/test_k8s.py runs pods in them);
        stop() destroys them."""
        try:
            self._make_network()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_daemon(self, name: str, host: str, *args: str) -> None:
        argv = [_which(name.split("-")[0]), *args, "-f", self.conf]
        if self.namespaced:
            argv = self.hosts[host].cmd(*argv)
        log = open(os.path.join(self.root, f"{name}.stdout"), "w")
        self._procs.append((name, subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                   preexec_fn=_die_with_parent)))

    def _start_munge(self) -> None:
        """munged stays in this machine's namespaces: clients reach it through its socket file, which
        network namespaces do not separate."""
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
        _wait(lambda: os.path.exists(self.munge_socket) or proc.poll() is not None, 20, "munged socket")
        if proc.poll() is not None:
            raise SlurmError(f"munged exited with {proc.returncode}: {self._tail('munged.stdout')}")

    def _write_conf(self) -> None:
        os.makedirs(os.path.join(self.root, "state"))
        mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 * 9 // 10 // len(self.nodes)
        if self.namespaced:  # own network stacks: the standard ports, addresses on the simulated network
            ctl_host, ctl_addr, ctld_port, slurmd_port = CTL_NAME, self.addr(CTL_NAME), 6817, 6818
            addrs = [self.addr(n) for n in self.nodes]
        else:
            ctl_host, ctl_addr, ctld_port, slurmd_port = self.nodes[0], "127.0.0.1", _free_port(), _free_port()
            addrs = ["127.0.0.1"]
        nodes = "\n".join(NODE_LINE.format(name=n, addr=a, cpus=os.cpu_count(), mem_mb=mem_mb)
                          for n, a in zip(self.nodes, addrs))
        with open(self.conf, "w") as f:
            f.write(SLURM_CONF.format(ctl_host=ctl_host, ctl_addr=ctl_addr, root=self.root, ctld_port=ctld_port,
                                      slurmd_port=slurmd_port, munge_socket=self.munge_socket,
                                      kill_wait=self.kill_wait, slurmd_timeout=self.slurmd_timeout,
                                      nodes=nodes, node_list=",".join(self.nodes)))

    def _make_network(self) -> None:
        """The controller's host holds a bridge; every node gets a veth pair: `eth0` in the node, its
        other end (named after the node) in the bridge."""
        for name in (CTL_NAME, *self.nodes):
            self.hosts[name] = Host(name, self._hosts_file(name))
        ctl = self.hosts[CTL_NAME]
        ctl.sh("ip", "link", "add", "br0", "type", "bridge")
        ctl.sh("ip", "addr", "add", f"{self.addr(CTL_NAME)}/24", "dev", "br0")
        ctl.sh("ip", "link", "set", "br0", "up")
        for name in self.nodes:
            node = self.hosts[name]
            subprocess.run([_which("ip"), "link", "add", "name", name, "netns", str(ctl.holder.pid), "type", "veth",
                            "peer", "name", NODE_IFNAME, "netns", str(node.holder.pid)], check=True,
                           capture_output=True)
            ctl.sh("ip", "link", "set", name, "master", "br0", "up")
            node.sh("ip", "addr", "add", f"{self.addr(name)}/24", "dev", NODE_IFNAME)
            node.sh("ip", "link", "set", NODE_IFNAME, "up")

    def _hosts_file(self, name: str) -> str:
        """The host's /etc/hosts: the other hosts by their addresses, and its own name on 127.0.1.1 as a
        default Debian/Ubuntu install writes it. So a program that finds its address by resolving its own
        host name gets loopback, and only an explicit interface (GLOO_SOCKET_IFNAME...) reaches the others."""
        lines = ["127.0.0.1 localhost"]
        for other in (CTL_NAME, *self.nodes):
            lines.append(f"127.0.1.1 {other}" if other == name else f"{self.addr(other)} {other}")
        path = os.path.join(self.root, f"hosts.{name}")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    # ------------------------------------------------------------ a host fails, and comes back

    def freeze(self, name: str) -> None:
        """Host `name` stops dead: every process in it stopped (SIGSTOP), its link down, so peers get no
        answer at all, not even a reset connection. Files it holds locked stay locked, as a file server keeps
        a vanished client's locks. slurmctld marks it DOWN after SlurmdTimeout and fails its jobs."""
        host = self.hosts[name]
        for _ in range(2):  # a process forked during the first pass
            host.kill_all(signal.SIGSTOP)
        self.hosts[CTL_NAME].sh("ip", "link", "set", name, "down")

    def revive(self, name: str, timeout: float = 60) -> None:
        """Host `name` reboots: whatever ran in it is killed, the link comes up, a fresh slurmd registers
        (ReturnToService=2 puts the node back in service)."""
        host = self.hosts[name]
        host.kill_all(signal.SIGKILL)
        _wait(lambda: not host.pids(), 20, f"the processes of {name} to die")
        for entry in [e for e in self._procs if e[0] == f"slurmd-{name}"]:  # killed above: reap it
            entry[1].wait(10)
            self._procs.remove(entry)
        self.hosts[CTL_NAME].sh("ip", "link", "set", name, "up")
        self._start_daemon(f"slurmd-{name}", name, "-D")
        _wait(lambda: self.run("sinfo", "-h", "-n", name, "-o", "%T", check=False).stdout.strip() == "idle",
              timeout, f"{name} to be back in service", self.logs_tail)
        # "idle" says only that the node reaches slurmctld. In one CI run the next job's step launch, 0.2 s
        # later, failed on the other node with "Communication connection failure": a job spanning every node
        # must run before the host counts as back.
        _wait(self._a_step_runs_on_every_node, timeout, f"a job on every node after {name} came back",
              self.logs_tail)

    def _a_step_runs_on_every_node(self) -> bool:
        job_id = self.sbatch(f"--nodes={len(self.nodes)}", "--output=/dev/null", "--chdir=/", "--wrap", "srun true")
        _wait(lambda: self.job(job_id)["JobState"] in FINAL_STATES, 30, f"probe job {job_id} to end",
              self.logs_tail)
        return self.job(job_id)["JobState"] == "COMPLETED"

    def cancel_all(self, timeout: float = 30) -> None:
        """Kill every running job and drop every pending one; return once none is left running."""
        self.run("scancel", "--full", "--signal=KILL", "--state=RUNNING", check=False)
        self.run("scancel", "--state=PENDING", check=False)
        _wait(lambda: not self.run("squeue", "-h", "-t", "RUNNING,COMPLETING", check=False).stdout.strip(),
              timeout, "jobs to end", self.logs_tail)

    def stop(self) -> None:
        """Cancel every job, wait for them to end, stop the daemons by pid (newest first), then kill what
        is left in the simulated hosts (a job's orphans, a stopped process) and the hosts themselves."""
        if any(name == "slurmctld" and p.poll() is None for name, p in self._procs):
            try:
                self.cancel_all()
            except (SlurmError, subprocess.TimeoutExpired, OSError):
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
        for host in self.hosts.values():
            try:
                host.destroy()
            except OSError:
                pass  # the next host's processes must still go
        self.hosts = {}

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------ clients

    def run(self, *cmd: str, check: bool = True, env: dict | None = None, timeout: float = 30
            ) -> subprocess.CompletedProcess:
        """A client command (sbatch, scontrol, ...), on the controller's host when namespaced."""
        argv = [_which(cmd[0]), *cmd[1:]]
        if self.namespaced:
            argv = self.hosts[CTL_NAME].cmd(*argv, cwd=os.getcwd())
        out = subprocess.run(argv, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr.strip()}")
        return out

    def sbatch(self, *args: str, env: dict | None = None) -> int:
        return int(self.run("sbatch", "--parsable", *args, env=env).stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, NodeList, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def _tail(self, name: str, n: int = 15) -> str:
        try:
            with open(os.path.join(self.root, name), errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def logs_tail(self) -> str:
        names = ["slurmctld.log", *(f"slurmd-{n}.log" for n in self.nodes), "munge/munged.log"]
        return "".join(f"--- {n}\n{self._tail(n)}" for n in names)


@contextlib.contextmanager
def running(cluster: SlurmCluster):
    """Start `cluster`, yield it, and stop it and remove its temp dir however the body or the start ends
    (the fixtures and __main__ use this)."""
    try:
        yield cluster.start()
    finally:
        try:
            cluster.stop()
        finally:
            cluster.cleanup()


if __name__ == "__main__":
    n = int(sys.argv[sys.argv.index("--nodes") + 1]) if "--nodes" in sys.argv else 0
    reason = unavailable_reason(n)
    if reason:
        sys.exit(reason)
    with running(SlurmCluster(n)) as cluster:
        enter = f"nsenter --target={cluster.hosts[CTL_NAME].holder.pid} --net --uts --mount  " if n else ""
        print(f"SLURM is up; in another shell:  export SLURM_CONF={cluster.conf}; {enter}sinfo")
        input("press Enter to stop ")
