"""Multi-node SLURM for real: slurm/train.sbatch on a two-host cluster, preempted, resumed on fewer nodes, a host
lost and its ranks resumed from the other host's memory replica.

    python -m pytest tests/test_slurm_multinode.py -q -rs     # as root, after `bash .ci/install-slurm.sh`

The cluster (tests/slurm_cluster.py, nodes=2) is slurmctld and two slurmd, each in its own network, UTS and
mount namespaces: hosts `node1` and `node2` with their own address (10.77.0.11/12 on a bridge) and their
own /etc/hosts, where, as on a default Debian install, a host's own name resolves to 127.0.1.1. The batch
script runs unchanged; the "your cluster" values set, through sbatch's environment, are SOCKET_IFNAME=eth0,
NPROC_PER_NODE and, in test 1, RDZV_PORT. Most jobs get one worker per node, so the ranks talk across hosts.
Skipped, with the reason, when not root, the packages are missing or namespaces cannot be created.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import sys
import time

import pytest

from ckpt import latest_committed_step, step_dir, verify_checkpoint
from ckpt.layout import LOCK_FILE
from ckpt.lock import STALE_S
from ckpt.memory_tier.tier import default_memory_dir
from common.procfs import running as alive, stat_fields
from conftest import FAST, ROOT, events, losses, run_train
from finetune.metrics import read_metrics
from slurm_cluster import FINAL_STATES, Host, SlurmCluster, SlurmError, running, unavailable_reason
from test_preemption import metrics_so_far

STEPS = ["train.max_steps=24", "ckpt.interval=8"]
SLOW_STEPS = "sleep@after_step,secs=0.1"  # a signal sent after step 4 lands long before the last step
SCRIPT = os.path.join(ROOT, "slurm", "train.sbatch")
RDZV_PORT = 29411  # test 1's: not the script's default (20000 + job id % 10000) for any job id this cluster gives


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable_reason(nodes=2)
    if reason:
        print(f"skipping the multi-node SLURM tests: {reason}", file=sys.stderr)
        pytest.skip(reason)
    with running(SlurmCluster(nodes=2, slurmd_timeout=10, kill_wait=10)) as c:
        yield c


@pytest.fixture(autouse=True)
def no_job_left(cluster):
    """A test that fails mid-job leaves nothing running into the next one."""
    yield
    cluster.cancel_all()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same steps without SLURM or interruption: one torchrun, 2 workers on one host."""
    run = tmp_path_factory.mktemp("multinode") / "reference"
    run_train(run, 2, STEPS)
    return read_metrics(os.path.join(str(run), "metrics.jsonl"))[0]


class Job:
    """One sbatch submission of slurm/train.sbatch into `run_dir`; its log is `<log_name>.out` beside it."""

    def __init__(self, cluster: SlurmCluster, run_dir, nodes: int, overrides: list[str] = (), fault: str = "",
                 nproc_per_node: int = 1, log_name: str = "job", env: dict | None = None):
        self.cluster, self.run_dir, self.out = cluster, run_dir, os.path.join(os.path.dirname(str(run_dir)),
                                                                              f"{log_name}.out")
        env = {"NPROC_PER_NODE": str(nproc_per_node), "SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", "CKPT_FAULT": fault,
               "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],  # torchrun of this python
               **(env or {})}
        self.id = cluster.sbatch(f"--nodes={nodes}", f"--chdir={ROOT}", f"--output={self.out}", SCRIPT,
                                 "configs/tiny.yaml", *FAST, f"run.dir={run_dir}",
                                 f"data.cache_dir={os.path.dirname(str(run_dir))}/.tok-cache", *STEPS, *overrides,
                                 env=env)

    def info(self) -> dict[str, str]:
        return self.cluster.job(self.id)

    def log(self) -> str:
        return open(self.out).read() if os.path.exists(self.out) else ""

    def explain(self) -> str:
        return f"job {self.info()}\n--- job output\n{self.log()[-5000:]}\n{self.cluster.logs_tail()}"

    def steps_done(self) -> int:
        return max((r["step"] for r in metrics_so_far(self.run_dir) if "loss" in r), default=0)

    def wait_for(self, what: str, cond, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.explain()}")
            time.sleep(0.2)

    def wait_running_step(self, step: int, timeout: float = 240) -> None:
        self.wait_for(f"step {step}", lambda: self.steps_done() >= step or self.info()["JobState"] in FINAL_STATES,
                      timeout)
        assert self.info()["JobState"] == "RUNNING", self.explain()

    def wait_end(self, timeout: float = 240) -> dict[str, str]:
        self.wait_for("the job to end", lambda: self.info()["JobState"] in FINAL_STATES, timeout)
        return self.info()


# ---------------------------------------------------------------- where the workers run and whom they talk to

def parent(pid: int) -> int:
    return int(stat_fields(pid)[1])


def workers(cluster: SlurmCluster, node: str) -> dict[int, int]:
    """RANK -> pid of the train_fsdp.py workers in `node`'s namespaces: processes with torchrun's RANK
    (SLURM sets none) whose parent has none (not a helper process a worker started)."""
    ranked = {}
    for pid in cluster.hosts[node].pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
                ranked[pid] = (int(env[b"RANK"]), parent(pid))
        except OSError:
            continue  # gone meanwhile
    return {rank: pid for pid, (rank, ppid) in ranked.items() if ppid not in ranked}


def _address(hex_addr: str) -> str:
    """An address as /proc/net/tcp{,6} write it (32-bit words, host order); IPv4-mapped IPv6 as plain IPv4."""
    raw = b"".join(struct.pack("<I", int(hex_addr[i:i + 8], 16)) for i in range(0, len(hex_addr), 8))
    if len(raw) == 16 and raw[:12] == b"\0" * 10 + b"\xff\xff":
        raw = raw[12:]
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def tcp_sockets(pid: int) -> list[tuple[str, int, str, int, str, str]]:
    """(local addr, port, remote addr, port, state, inode) of every TCP socket, IPv4 and IPv6, in the network
    namespace of process `pid` (a store listening on [::] shows in tcp6 only)."""
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue  # gone meanwhile, or no IPv6
        for cols in rows:
            (la, lp), (ra, rp) = cols[1].split(":"), cols[2].split(":")
            found.append((_address(la), int(lp, 16), _address(ra), int(rp, 16), cols[3], cols[9]))
    return found


def tcp_peers(pid: int) -> set[tuple[str, int]]:
    """Remote (address, port) of the established TCP connections that process `pid` holds."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()  # gone meanwhile
    inodes = set()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return {(ra, rp) for _la, _lp, ra, rp, state, inode in tcp_sockets(pid) if state == "01" and inode in inodes}


def listening_ports(pid: int) -> set[int]:
    """TCP ports listened on in the network namespace of process `pid`."""
    return {lp for _la, lp, _ra, _rp, state, _inode in tcp_sockets(pid) if state == "0A"}  # 0A = LISTEN


# ---------------------------------------------------------------- 0. the fixture cleans up after a failed start

def children_alive() -> set[int]:
    """This process's children that still run (daemons, namespace holders)."""
    found = set()
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if parent(pid) == os.getpid() and alive(pid):
                found.add(pid)
        except OSError:
            continue  # gone meanwhile
    return found


def test_a_cluster_that_fails_to_start_leaves_nothing_behind(cluster, monkeypatch):
    """A host whose set-up fails halfway kills its own namespace holder; a cluster whose start fails (here
    slurmctld, after munged and the three hosts are up) stops all of them and removes its temp dir. The
    module's cluster runs meanwhile (and makes this test skip where namespaces are not available)."""
    before = children_alive()
    with pytest.raises(SlurmError, match="mount --bind"):
        Host("half", "/nonexistent/hosts")
    assert children_alive() == before, "the half-made host's holder is still running"
    failing = SlurmCluster(nodes=2)

    def no_daemon(*_args):
        raise SlurmError("slurmctld would not start")
    monkeypatch.setattr(failing, "_start_daemon", no_daemon)
    with pytest.raises(SlurmError, match="would not start"), running(failing):
        pass
    assert not os.path.exists(failing.root)
    assert children_alive() == before, "munged or a namespace holder of the failed cluster is still running"


# ---------------------------------------------------------------- 1. two nodes, one worker each

def test_two_nodes_train_across_hosts_with_the_losses_of_one_node(cluster, reference, tmp_path):
    """Also the rendezvous port from sbatch's environment (RDZV_PORT): the store listens on it in node1,
    and node2's processes are connected to node1 on it."""
    job = Job(cluster, tmp_path / "run", nodes=2, fault=SLOW_STEPS, env={"RDZV_PORT": str(RDZV_PORT)})
    assert 20000 + job.id % 10000 != RDZV_PORT, "the script's default port would pass this test too"
    job.wait_running_step(2)
    placement = {node: workers(cluster, node) for node in cluster.nodes}
    assert sorted(r for ranks in placement.values() for r in ranks) == [0, 1], placement
    assert all(len(ranks) == 1 for ranks in placement.values()), f"one worker per host: {placement}"
    for node, ranks in placement.items():  # gloo's connections go to the other host's address on eth0
        other = next(n for n in cluster.nodes if n != node)
        (pid,) = ranks.values()
        assert cluster.addr(other) in {a for a, _ in tcp_peers(pid)}, f"worker on {node} has no connection to {other}"
    assert RDZV_PORT in listening_ports(next(iter(placement["node1"].values())))
    to_store = [pid for pid in cluster.hosts["node2"].pids() if (cluster.addr("node1"), RDZV_PORT) in tcp_peers(pid)]
    assert to_store, f"no process on node2 is connected to the rendezvous at node1:{RDZV_PORT}"
    info = job.wait_end()
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "node[1-2]"), job.explain()
    log = job.log()
    assert f"2 node(s) x 1 worker(s), rendezvous node1:{RDZV_PORT}," in log and "interface eth0" in log, log[-3000:]
    two = read_metrics(os.path.join(str(job.run_dir), "metrics.jsonl"))[0]
    assert {r["world_size"] for r in two.values()} == {2}
    assert {s: r["loss"] for s, r in two.items()} == {s: r["loss"] for s, r in reference.items()}


# ---------------------------------------------------------------- 2. preempted, requeued, finished

def test_preemption_saves_on_every_node_requeues_and_matches_uninterrupted(cluster, reference, tmp_path):
    job = Job(cluster, tmp_path / "run", nodes=2, overrides=["ckpt.keep_last=0"], fault=SLOW_STEPS)
    job.wait_running_step(4)
    cluster.run("scancel", "--signal=USR1", "--batch", str(job.id))

    def ended_for_good() -> bool:  # after its requeue, or without the script having asked for one
        info = job.info()
        return info["JobState"] in FINAL_STATES and (info["Restarts"] != "0" or "requeueing" not in job.log())
    job.wait_for("the job to be requeued and to end", ended_for_good, 300)
    info, log = job.info(), job.log()
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("COMPLETED", "1", "0:0"), job.explain()
    for line in ("got SIGUSR1: forwarding SIGTERM", "requeueing", "start (restart 1): 2 node(s)", "training finished"):
        assert line in log, f"{line!r} not in the job output:\n{log[-5000:]}"

    (preempted,) = events(job.run_dir, "preempted")
    p = preempted["step"]
    assert 4 <= p < 24
    ckpt_dir = os.path.join(str(job.run_dir), "checkpoints")
    assert [e["mode"] for e in events(job.run_dir, "checkpoint") if e["step"] == p] == ["sync"]
    shards = sorted(n for n in os.listdir(step_dir(ckpt_dir, p)) if n.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], "each host's rank wrote its shard"
    assert [e["step"] for e in events(job.run_dir, "resume")] == [p]
    assert losses(job.run_dir) == {s: r["loss"] for s, r in reference.items()}  # bit for bit, all 24 steps
    assert latest_committed_step(ckpt_dir) == 24
    verify_checkpoint(step_dir(ckpt_dir, 24))


# ---------------------------------------------------------------- 3. preempted on two nodes, resumed on one

def test_preempted_on_two_nodes_resumes_on_one_with_the_same_data(cluster, reference, tmp_path):
    """node2 is drained before the preemption (its job runs on; nothing new starts there), so the requeued
    two-node job cannot start again however long the test takes to cancel it: only one node is free, and the
    user resubmits on one."""
    run = tmp_path / "run"
    two = Job(cluster, run, nodes=2, fault=SLOW_STEPS)
    two.wait_running_step(4)
    cluster.run("scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=pytest-only-one-node-free")
    try:
        cluster.run("scancel", "--signal=USR1", "--batch", str(two.id))

        def requeued_or_over() -> bool:
            info = two.info()
            return (info["Restarts"], info["JobState"]) == ("1", "PENDING") or info["JobState"] in FINAL_STATES
        two.wait_for("the requeue", requeued_or_over, 120)
        assert two.info()["JobState"] == "PENDING", two.explain()
        cluster.run("scancel", str(two.id))
        (preempted,) = events(run, "preempted")
        p = preempted["step"]
        assert latest_committed_step(os.path.join(str(run), "checkpoints")) == p

        one = Job(cluster, run, nodes=1, log_name="one-node")
        info = one.wait_end()
    finally:
        cluster.run("scontrol", "update", "NodeName=node2", "State=RESUME", check=False)
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "node1"), one.explain()
    assert "1 node(s) x 1 worker(s)" in one.log()
    (resumed,) = [e for e in events(run, "resume")]
    assert (resumed["step"], resumed["world_size"], resumed["saved_world_size"]) == (p, 1, 2)
    assert_continues_on_one_rank(run, reference, p)


def assert_continues_on_one_rank(run, reference, resumed: int) -> None:
    """Steps 1-24 are in the run's metrics; those after `resumed` ran at W=1 on the reference's samples, with its
    losses within the world-size tolerance."""
    after = read_metrics(os.path.join(str(run), "metrics.jsonl"))[0]
    assert sorted(after) == list(range(1, 25))
    for s in range(resumed + 1, 25):
        assert after[s]["world_size"] == 1
        assert after[s]["sample_ids"] == reference[s]["sample_ids"], f"step {s}: a different global batch"
        assert after[s]["loss"] == pytest.approx(reference[s]["loss"], abs=1e-4), f"step {s}"


# ---------------------------------------------------------------- 4. a host dies

def committed_steps(ckpt_dir) -> list[int]:
    """Every step whose folder verifies (commit marker, sizes, checksums)."""
    found = []
    for name in sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else []:
        if name.startswith("step-"):
            try:
                found.append(verify_checkpoint(os.path.join(ckpt_dir, name))["step"])
            except Exception:  # noqa: BLE001 - uncommitted or being written: not a committed checkpoint
                pass
    return found


def lock_record(ckpt_dir) -> dict:
    """The ckpt.dir lock's record of its holder: host, pid, heartbeat time (ckpt/lock.py)."""
    with open(os.path.join(ckpt_dir, LOCK_FILE)) as f:
        text = f.read()
    try:
        return json.loads(text)
    except ValueError:
        raise AssertionError(f"the lock file holds no host/pid/heartbeat record: {text!r}") from None


def test_host_failure_ends_the_job_keeps_checkpoints_and_the_next_job_resumes(cluster, reference, tmp_path):
    """The host of rank 0 (the lock holder) stops dead mid-run. SLURM ends the job (requeued), every committed
    checkpoint survives. The dead job's flock is still held (as a file server keeps a vanished client's lock)
    and its heartbeat is only a minute old: a new job on the surviving node is refused with one line that
    names the holder and says how to tell it is dead and what to do. Done that (SLURM says the host is down;
    the lock deleted), the next submission resumes from the newest committed checkpoint and finishes."""
    run = tmp_path / "run"
    ckpt_dir = os.path.join(str(run), "checkpoints")
    lock_path = os.path.join(ckpt_dir, LOCK_FILE)
    overrides = ["ckpt.interval=4", "ckpt.keep_last=0"]
    job = Job(cluster, run, nodes=2, overrides=overrides, fault=SLOW_STEPS)
    job.wait_for("two committed checkpoints", lambda: len(committed_steps(ckpt_dir)) >= 2 or
                 job.info()["JobState"] in FINAL_STATES, 240)
    assert job.info()["JobState"] == "RUNNING", job.explain()
    holder = lock_record(ckpt_dir)
    dead = holder["host"]
    assert dead in cluster.nodes and workers(cluster, dead).get(0) == holder["pid"], (holder, dead)
    alive_node = next(n for n in cluster.nodes if n != dead)
    before = committed_steps(ckpt_dir)
    t0 = time.monotonic()
    cluster.freeze(dead)
    try:
        # over: failed, or requeued by SLURM (--requeue) and waiting for a second node that is down
        job.wait_for("the job to end", lambda: job.info()["JobState"] in FINAL_STATES or
                     (job.info()["JobState"] == "PENDING" and job.info()["Restarts"] != "0"), 180)
        ended_s = time.monotonic() - t0
        print(f"job ended {ended_s:.1f}s after its rank-0 host froze: {job.info()['JobState']}")
        # SLURM's own detection: no answer for SlurmdTimeout (10 s here), then the job is failed or requeued
        assert ended_s < 120, job.explain()
        cluster.run("scancel", str(job.id))
        assert set(before) <= set(committed_steps(ckpt_dir)), "a committed checkpoint was lost"
        newest = latest_committed_step(ckpt_dir)
        with open(lock_path, "a+") as f, pytest.raises(BlockingIOError):  # the frozen holder keeps its flock
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # the test the refusal below proposes ("is the host down?"), as a SLURM user makes it; also keeps the
        # next jobs off the frozen host
        job.wait_for(f"sinfo to show {dead} down", lambda: cluster.run(
            "sinfo", "-h", "-n", dead, "-o", "%T").stdout.strip().startswith("down"), 60)

        refused = Job(cluster, run, nodes=1, overrides=overrides, log_name="refused")
        info = refused.wait_end()
        # train_fsdp.py exits 2; torchrun reports any failed worker as 1, and the script passes that on
        assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("FAILED", "1:0", alive_node), \
            refused.explain()
        (line,) = [x for x in refused.log().splitlines() if x.startswith("error: ")]
        age = int(line.split("last heartbeat ")[1].split("s ago")[0])
        print(f"refused {age}s after the dead holder's last heartbeat: {line}")
        assert age < STALE_S, "the heartbeat is young: the refusal must help before it goes stale"
        for words in (f"pid {holder['pid']} on {dead}", f"if {dead} is down or `ps -p {holder['pid']}` on {dead} "
                      f"shows nothing, that job is dead: delete {lock_path} and start again"):
            assert words in line, f"{words!r} not in {line!r}"

        os.remove(lock_path)  # what the message says to do, the host being down
        resumed = Job(cluster, run, nodes=1, overrides=overrides, log_name="resumed")
        info = resumed.wait_end()
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), resumed.explain()
        assert [e["step"] for e in events(run, "resume")] == [newest]
        after = read_metrics(os.path.join(str(run), "metrics.jsonl"))[0]
        assert sorted(after) == list(range(1, 25))
        for s in range(newest + 1, 25):
            assert after[s]["world_size"] == 1
            assert after[s]["sample_ids"] == reference[s]["sample_ids"], f"step {s}: a different global batch"
            assert after[s]["loss"] == pytest.approx(reference[s]["loss"], abs=1e-4), f"step {s}"
        assert latest_committed_step(ckpt_dir) == 24
    finally:
        cluster.run("scancel", str(job.id), check=False)
        cluster.revive(dead)  # for the tests after this one


# ---------------------------------------------------------------- 5. a wedged rank

def test_wedged_rank_ends_the_job_within_the_training_timeout(cluster, tmp_path):
    """SIGSTOP on node2's worker: node1's rank waits in a collective for train.collective_timeout_minutes
    (0.25 here), then the job ends with a line naming the cause, not after torch's default 30 minutes.
    No periodic saves: this is the training timeout alone (a save in flight waits ckpt.timeout_minutes), and no
    hang watchdog: auto's limit is 0.8 of the collective timeout (finetune/hang.py), so it would race this one
    (it won once under load: exit 76, a restart, the job COMPLETED); tests/test_slurm.py covers the watchdog."""
    job = Job(cluster, tmp_path / "run", nodes=2, fault=SLOW_STEPS,
              overrides=["ckpt.interval=0", "train.collective_timeout_minutes=0.25", "train.hang_timeout=0"])
    job.wait_running_step(3)
    (rank, pid), = workers(cluster, "node2").items()
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    info = job.wait_end(timeout=300)
    ended_s = time.monotonic() - t0
    print(f"job ended {ended_s:.1f}s after rank {rank} was stopped (timeout 15 s)")
    assert info["JobState"] == "FAILED", job.explain()
    assert 10 < ended_s < 15 + 60, job.explain()
    assert ("a training collective waited more than 0.25 min (train.collective_timeout_minutes) for another rank"
            in job.log()), job.log()[-4000:]


# ---------------------------------------------------------------- 6. the agent killed alone

def descendants(pids) -> set[int]:
    """Every process below `pids` (children, their children, ...), from the parent links in /proc."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            children.setdefault(parent(int(entry)), []).append(int(entry))
        except OSError:
            continue  # gone meanwhile
    found, todo = set(), list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_agent_killed_alone_takes_its_workers_with_it(cluster, tmp_path):
    """SIGKILL to torchrun on a node (as the OOM killer does) with its two workers on the same node: nothing
    else would stop them here (SLURM's proctrack/linuxproc finds a step's processes by parentage, and an
    orphan has none), so only the workers' parent-death signal does. ckpt.async_mode=process: each worker
    has started DCP's uploader process (and multiprocessing's resource tracker); none of those may be left
    either, holding /dev/shm or a GPU."""
    run = tmp_path / "run"
    job = Job(cluster, run, nodes=1, nproc_per_node=2, fault=SLOW_STEPS,
              overrides=["train.max_steps=1000", "data.epochs=1000", "ckpt.async_mode=process", "ckpt.interval=4"])
    job.wait_running_step(3)
    (node,) = [n for n in cluster.nodes if workers(cluster, n)]
    ranks = workers(cluster, node)
    assert sorted(ranks) == [0, 1], ranks

    def uploaders() -> list[int]:  # DCP's process-mode uploader: a multiprocessing spawn child of a worker (its
        # guard, a child of the uploader, shows the same command line)
        return [p for p in descendants(ranks.values()) if "spawn_main" in cmdline(p) and parent(p) in ranks.values()]
    job.wait_for("each worker's uploader process", lambda: len(uploaders()) == 2 or
                 job.info()["JobState"] in FINAL_STATES, 180)
    assert len(uploaders()) == 2, job.explain()
    below = descendants(ranks.values())
    agent = {parent(pid) for pid in ranks.values()}
    assert len(agent) == 1, agent
    os.kill(agent.pop(), signal.SIGKILL)
    t0, gone_s = time.monotonic(), {}
    # the workers get SIGKILL from the kernel; their children notice the closed pipe and exit on their own
    for what, pids, limit in (("workers", ranks.values(), 15), ("their child processes", below, 30)):
        while any(alive(p) for p in pids) and time.monotonic() - t0 < limit:
            time.sleep(0.1)
        gone_s[what] = time.monotonic() - t0
        left = {p: cmdline(p)[:200] for p in pids if alive(p)}
        assert not left, f"{what} outlived their agent by {gone_s[what]:.0f}s: {left}"
    steps = job.steps_done()
    print(f"after the agent's SIGKILL: workers gone in {gone_s['workers']:.2f}s, their {len(below)} child "
          f"processes in {gone_s['their child processes']:.2f}s")
    time.sleep(2)
    assert job.steps_done() == steps, "training went on after the agent died"
    with open(os.path.join(str(run), "checkpoints", LOCK_FILE), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while an orphan holds it
    info = job.wait_end(timeout=120)
    assert info["JobState"] in ("FAILED", "CANCELLED", "COMPLETED") and info["ExitCode"] != "0:0", job.explain()


# ---------------------------------------------------------------- 7. a host lost: the memory tier's replica

def test_a_lost_host_resumes_on_the_other_from_its_memory_replica(cluster, reference, tmp_path):
    """Memory steps every step with one replica: each host's /dev/shm holds its rank's files and a copy of the
    other's. After step K + 1 (memory step K marked on both hosts) node2's job processes are SIGKILLed and its
    memory folder wiped; the job is cancelled. Resubmitted on node1 alone, it resumes at step K from memory,
    W=2 -> W=1, reading node2's rank from node1's copy, and trains the reference's samples."""
    k, run = 5, tmp_path / "run"
    folder = default_memory_dir(os.path.join(str(run), "checkpoints"))  # each host's own /dev/shm (slurm_cluster.py)
    paused = tmp_path / "paused"
    overrides = ["ckpt.memory_interval=1", "ckpt.keep_last=0"]
    job = Job(cluster, run, nodes=2, overrides=overrides,
              fault=f"wait_for@after_step:{k + 1},secs=120,file={folder}/step-{k:06d}/commit.json;"
                    f"sleep@after_step:{k + 1},secs=600,file={paused}")
    job.wait_for("both ranks to pause after memory step {k}", lambda: paused.exists() or
                 job.info()["JobState"] in FINAL_STATES, 240)
    markers = {n: f"{cluster.hosts[n].shm}{folder[len('/dev/shm'):]}/step-{k:06d}/commit.json" for n in cluster.nodes}
    job.wait_for("both hosts' markers", lambda: all(os.path.exists(m) for m in markers.values()), 60)
    lost = workers(cluster, "node2")
    (lost_rank,) = lost
    held = json.load(open(markers["node1"]))["held"]
    assert f"__{lost_rank}_0.distcp" in held, f"node1 holds no copy of node2's rank {lost_rank}: {held}"
    for pid in [*lost.values(), parent(next(iter(lost.values())))]:  # the rank and its torchrun agent
        os.kill(pid, signal.SIGKILL)
    cluster.hosts["node2"].sh("rm", "-rf", folder)
    cluster.run("scancel", "--full", "--signal=KILL", str(job.id))
    job.wait_end()
    cluster.run("scontrol", "update", "NodeName=node2", "State=DRAIN", "Reason=pytest-host-lost")
    try:
        one = Job(cluster, run, nodes=1, overrides=overrides, log_name="one-node")
        info = one.wait_end()
    finally:
        cluster.run("scontrol", "update", "NodeName=node2", "State=RESUME", check=False)
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "node1"), one.explain()
    assert f"resume: memory tier, step {k}" in one.log(), one.log()[-4000:]
    (resumed,) = events(run, "resume")
    assert (resumed["step"], resumed["tier"], resumed["saved_world_size"], resumed["world_size"]) == (k, "memory", 2, 1)
    assert_continues_on_one_rank(run, reference, k)
