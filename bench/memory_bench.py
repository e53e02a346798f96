"""Memory tier benchmark: a memory save (its blocking time, and its time until replicated and marked on every
node) against an async disk save of the same state; training throughput with a memory save every step against no
checkpointing; the time from a restart to the first resumed step, from memory against from disk.

    python bench/memory_bench.py                 # ckpt_bench's default model (~190M params), 2 nodes x 1 rank, CPU
    python bench/memory_bench.py --hidden 128 --layers 2 --vocab 512 --rounds 3 --steps 4 --out /tmp/mb   # smoke

The two "nodes" are two torchrun agents on this machine (--nnodes 2 --node_rank i, static rendezvous on 127.0.0.1),
each with its own memory folder under /dev/shm, copying their memory steps to each other (ckpt.memory_replicas=1)
over gloo on loopback TCP. That exercises the whole protocol (replication, markers, agreement, verification on
resume) with both nodes sharing this machine's cores and memory bandwidth: it does not measure a real network,
and replication competes with training for the same cores here, which a second machine would not.
Methods are interleaved round by round; each figure is a median with its min-max. The disk save is
CheckpointManager's async thread mode into --work-dir (a temp dir on local disk by default). Before each disk
resume the checkpoint's pages are dropped from the page cache (posix_fadvise), so it is read from the device, as
after a restart on another node; a shared filesystem over the network is slower still. "Restart" is the process
start up to a built model (the same for both tiers, measured once) plus the resume (find, verify, load) and the
first training step. Beside each throughput block, rank 0's CPU seconds per step (every thread of the process:
what a memory save costs in CPU, which on this machine comes out of training's two cores), and the floor: the
CPU the bare work any memory save must do takes (Floors), against what the 97% goal leaves a save per step.
"With a memory resume that took no time" is the restart ratio's ceiling at this size. Writes
<out>/memory_bench.{json,md} and keeps the run under <out>/runs/ (bench/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common.dist import free_port  # noqa: E402 - after the path insert
from common.procfs import stat_fields  # noqa: E402

import ckpt_bench  # noqa: E402 - bench/ckpt_bench.py, beside this script: the same model and training step
from finetune.config import CkptConfig  # noqa: E402 - the default ckpt.upload_nice
import provenance  # noqa: E402


def parse_args(argv=None):
    model = ckpt_bench.parse_args([])  # ckpt_bench's default model is the size compared here
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("hidden", "layers", "vocab", "seq_len"):
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=getattr(model, flag))
    p.add_argument("--nodes", type=int, default=2, help="torchrun agents on this machine, one memory folder each")
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5, help="rounds per comparison (the first is warm-up)")
    p.add_argument("--steps", type=int, default=10, help="training steps per throughput block")
    p.add_argument("--work-dir", default=None, help="where disk checkpoints go (default: a temp dir)")
    p.add_argument("--shm-dir", default="/dev/shm", help="under it, one memory folder per node")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mem-root", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- worker side (under torchrun, one per rank)

def process_age_s() -> float:
    """Seconds since this process started (Linux /proc): imports, process group and model build included."""
    start_ticks = int(stat_fields()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


class Log:
    """The event sink the checkpoint code writes to: rank 0 prints, every rank keeps the events."""

    def __init__(self, rank: int):
        self.rank, self.events = rank, []

    def info(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def event(self, name: str, **fields) -> None:
        self.events.append((name, fields))

    def last(self, name: str, tier: str | None) -> dict:
        return next(f for n, f in reversed(self.events) if n == name and f.get("tier") == tier)


def drop_page_cache(folder: str) -> None:
    """The files of `folder` out of the page cache (this machine's other users' pages are left alone)."""
    for d, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Bench:
    def __init__(self, args, model, optim, device, log):
        from types import SimpleNamespace
        from ckpt import CheckpointManager, ModelOptimizer
        from ckpt.memory_tier.tier import MemoryTier
        self.args, self.model, self.optim, self.device, self.log = args, model, optim, device, log
        self.state, self.step = {"app": ModelOptimizer(model, optim)}, 1
        node = int(os.environ.get("GROUP_RANK", "0"))
        nice = CkptConfig().upload_nice  # both tiers' background work at the default priority, as a training run has it
        options = SimpleNamespace(memory_interval=1, memory_keep=1, memory_replicas=1, dir=os.path.join(args.work_dir, "disk"),
                                  memory_dir=os.path.join(args.mem_root, f"node{node}"), upload_nice=nice)
        self.disk = CheckpointManager(options.dir, "thread", keep_last=1, on_event=log.event, upload_nice=nice)
        self.memory = MemoryTier.open(options, None, log)

    def train(self, n: int = 1) -> None:
        ckpt_bench.train_steps(self.model, self.optim, self.device, n, self.args.seq_len, self.args.vocab)
        self.step += n

    def files(self) -> dict:
        return {"meta.json": json.dumps({"step": self.step, "world_size": self.disk.world_size})}

    def save(self, tier: str) -> dict:
        """One save of the current state, waited for: blocking s, and s until committed (memory: replicated and
        marked on every node)."""
        mgr = self.memory.mgr if tier == "memory" else self.disk
        blocking = mgr.save(self.step, self.state, self.files())
        mgr.wait()
        e = self.log.last("checkpoint", "memory" if tier == "memory" else None)
        return {"blocking_s": blocking, "written_s": e["upload_s"], "committed_s": e["committed_s"]}

    def steps_per_s(self, with_memory: bool) -> tuple[float, float]:
        """Steps per second, and this process's CPU seconds per step (every thread: training, the save's copies
        and checksums, gloo's, the kernel's work for them)."""
        from ckpt import settle_alone
        mgr = self.memory.mgr

        def steps():
            for _ in range(self.args.steps):
                mgr.wait_for_staging()
                self.train()
                settle_alone(mgr)
                if with_memory:
                    mgr.save(self.step, self.state, self.files())
            mgr.wait()
        wall, cpu = timed(steps)
        return self.args.steps / wall, cpu / self.args.steps

    def restart(self, tier: str) -> tuple[float, float]:
        """Seconds from asking for a resume to the state loaded, and to the end of the first resumed step (same
        world size)."""
        import torch.distributed as dist
        from ckpt.resume import restore
        if tier == "disk":
            self.disk.wait()
            drop_page_cache(self.disk.dir)
        dist.barrier()
        t0 = time.perf_counter()
        if tier == "memory":
            mgr, path, _ = self.memory.choose_checkpoint(self.disk, "auto")
        else:
            mgr, path = self.disk, self.disk.choose_checkpoint("auto")
        restore(mgr, path, tier, self.state, 0, None, self.log)
        loaded = time.perf_counter() - t0
        self.train()
        return loaded, time.perf_counter() - t0


def timed(fn) -> tuple[float, float]:
    """Wall and process-CPU seconds (every thread, the kernel's work for them too) of fn()."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - cpu0


class Floors:
    """What any memory save must do with a rank's state, each done bare (no format, no checksum, no protocol), for
    its wall and CPU seconds: write the state's bytes into the node's memory folder (over an existing file's
    pages, as a save does over the spare's), and send them to the ring's next node while receiving as many from
    the one before (gloo, in CHUNK messages as replication sends them, one at a time each way). What
    arrives must be written into the folder too: a second write. Beside them, the pieces this design adds, each
    bare too: the snapshot copy that lets the save run off the training thread (into a reused buffer of the
    largest tensor's size), reading the file back to send it (into a CHUNK buffer, as peers.py does), and one
    checksum of the state's bytes (ALGORITHM; the writer and the receiver each take one)."""

    def __init__(self, tensors: list, folder: str, pg, rank: int, peers: tuple[int, int]):
        import torch
        from ckpt.memory_tier.peers import CHUNK
        self.views = [t.detach().reshape(-1).view(torch.uint8).numpy() for t in tensors]  # no copy: contiguous
        self.path, self.pg, (self.to, self.source) = os.path.join(folder, f"floor-{rank}"), pg, peers
        size = torch.tensor([sum(v.nbytes for v in self.views)])
        torch.distributed.all_reduce(size, torch.distributed.ReduceOp.MAX, group=pg)  # both ends agree on a count
        self.sizes = [min(CHUNK, int(size) - at) for at in range(0, int(size), CHUNK)]
        self.send, self.recv = torch.empty(CHUNK, dtype=torch.uint8), torch.empty(CHUNK, dtype=torch.uint8)
        self.snapshot = torch.empty(max(v.nbytes for v in self.views), dtype=torch.uint8)
        self.write()  # the file's pages exist before the first timed write

    def copy(self) -> None:
        import torch
        for v in self.views:
            self.snapshot[:v.nbytes].copy_(torch.from_numpy(v))

    def read(self) -> None:
        with open(self.path, "rb") as f:
            while f.readinto(memoryview(self.send.numpy())):
                pass

    def hash(self) -> None:
        from ckpt.checksum import new_hasher
        h = new_hasher()
        for v in self.views:
            h.update(v)
        h.hexdigest()

    def write(self) -> None:
        from ckpt.writeback import open_in_place
        with open_in_place(self.path) as f:
            for v in self.views:
                f.write(v)
            f.truncate()

    def wire(self) -> None:
        import torch.distributed as dist
        for n in self.sizes:
            works = [dist.isend(self.send[:n], self.to, group=self.pg), dist.irecv(self.recv[:n], self.source, group=self.pg)]
            for w in works:
                w.wait()

    def measure(self) -> dict:
        """Each piece once, one after another, every rank at once (a barrier before each)."""
        import torch.distributed as dist
        out = {}
        for name in FLOOR_PIECES:
            dist.barrier(group=self.pg)
            out[f"{name}_s"], out[f"{name}_cpu_s"] = timed(getattr(self, name))
        return out

    def close(self) -> None:
        os.remove(self.path)


FLOOR_PIECES = ("write", "wire", "copy", "read", "hash")


def rotated(methods: list, r: int) -> list:
    return methods[r % len(methods):] + methods[:r % len(methods)]


def worker(args):
    import torch
    import torch.distributed as dist
    if torch.cuda.is_available():  # as ckpt_bench: training on NCCL, checkpoints on their own gloo groups
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    model, optim, device = ckpt_bench.build(args, args.work_dir)
    startup_s = process_age_s()  # imports, process group and model: what every restart pays, whichever tier
    log = Log(dist.get_rank())
    b = Bench(args, model, optim, device, log)
    b.train()
    saves = {"memory": [], "disk": []}
    for r in range(args.rounds):
        for tier in rotated(["memory", "disk"], r):
            b.train()
            saves[tier].append(b.save(tier))
    throughput = {"none": [], "memory": []}
    for r in range(args.rounds):
        for tier in rotated(["none", "memory"], r):
            throughput[tier].append(b.steps_per_s(tier == "memory"))
    restarts = {"memory": [], "disk": []}
    for r in range(args.rounds):
        b.train()
        b.save("disk")  # the disk tier's newest step, then a memory step after it: memory is the newer
        b.train()
        b.save("memory")
        for tier in rotated(["memory", "disk"], r):
            restarts[tier].append(b.restart(tier))
    from ckpt import ModelOptimizer
    tensors = ckpt_bench.local_tensors(ModelOptimizer(model, optim).state_dict())
    rank_bytes = sum(t.numel() * t.element_size() for t in tensors)
    layout = b.memory.layout
    floor = Floors(tensors, b.memory.mgr.dir, b.memory.mgr.pg, layout.rank,
                   (layout.ring(layout.rank, 1)[0], layout.ring_sources(layout.rank, 1)[0]))
    floors = [floor.measure() for _ in range(args.rounds)]
    floor.close()
    result = {"world_size": dist.get_world_size(), "params": sum(p.numel() for p in model.parameters()),
              "rank_state_bytes": rank_bytes, "startup_s": startup_s, "saves": saves, "steps_per_s": throughput,
              "restart_s": restarts, "floors": floors, "replicas": b.memory.replicas, "nodes": b.memory.layout.nodes}
    b.memory.close(remove=True)
    b.disk.close()
    if dist.get_rank() == 0:
        with open(os.path.join(args.work_dir, "result.json"), "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver side

def launch(args, work: str, mem_root: str) -> dict:
    port = free_port()
    script = [os.path.abspath(__file__), "--worker", "--work-dir", work, "--mem-root", mem_root, "--hidden",
              str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab), "--seq-len",
              str(args.seq_len), "--rounds", str(args.rounds), "--steps", str(args.steps)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nodes),
                                "--node_rank", str(i), "--nproc_per_node", str(args.nproc_per_node), "--master_addr",
                                "127.0.0.1", "--master_port", str(port), *script], cwd=ROOT, env=env)
              for i in range(args.nodes)]
    codes = [a.wait() for a in agents]
    if any(codes):
        raise SystemExit(f"error: a node's agent exited {codes}")
    with open(os.path.join(work, "result.json")) as f:
        return json.load(f)


def spread(values: list[float]) -> dict:
    steady = values[1:] or values  # the first round is warm-up (buffers allocated, plans cached)
    return {"median": statistics.median(steady), "min": min(steady), "max": max(steady)}


def summarize(raw: dict) -> dict:
    saves = {tier: {k: spread([s[k] for s in raw["saves"][tier]]) for k in ("blocking_s", "written_s", "committed_s")}
             for tier in ("memory", "disk")}
    tp = {k: spread([sps for sps, _ in v]) for k, v in raw["steps_per_s"].items()}
    cpu = {k: spread([c for _, c in v]) for k, v in raw["steps_per_s"].items()}
    restart = {tier: {"resume_s": spread([x for x, _ in v]), "resume_and_first_step_s": spread([y for _, y in v]),
                      "restart_to_first_step_s": spread([raw["startup_s"] + y for _, y in v])}
               for tier, v in raw["restart_s"].items()}
    floors = {k: spread([f[k] for f in raw["floors"]]) for k in raw["floors"][0]}
    med = lambda d, k: d[k]["median"]  # noqa: E731
    step_s, step_cpu_s = 1 / tp["none"]["median"], cpu["none"]["median"]
    floor_cpu_s = 2 * med(floors, "write_cpu_s") + med(floors, "wire_cpu_s")
    # with what this design adds: a snapshot copy, a read back to send, a checksum at each end
    design_floor_cpu_s = (floor_cpu_s + med(floors, "copy_cpu_s") + med(floors, "read_cpu_s")
                          + 2 * med(floors, "hash_cpu_s"))
    # the most CPU a save can take per step and keep 97%: the goal's 3% of a step, plus every moment the training
    # process leaves its core idle (waiting in collectives), as if the save could fill each of them
    budget_cpu_s = step_s * (1 / 0.97 - 1) + max(0.0, step_s - step_cpu_s)
    ratios = {
        "memory_blocking_over_disk_blocking": med(saves["memory"], "blocking_s") / med(saves["disk"], "blocking_s"),
        "memory_replicated_over_disk_committed": med(saves["memory"], "committed_s") / med(saves["disk"], "committed_s"),
        "throughput_memory_every_step_over_none": tp["memory"]["median"] / tp["none"]["median"],  # goal >= 0.97
        "restart_disk_over_memory": (med(restart["disk"], "restart_to_first_step_s")
                                     / med(restart["memory"], "restart_to_first_step_s")),  # goal >= 5
        "resume_and_first_step_disk_over_memory": (med(restart["disk"], "resume_and_first_step_s")
                                                   / med(restart["memory"], "resume_and_first_step_s")),
        "resume_disk_over_memory": med(restart["disk"], "resume_s") / med(restart["memory"], "resume_s"),
        # the best a memory tier could reach here: a resume that took no time, and the same start and first step
        "restart_disk_over_instant_memory": (med(restart["disk"], "restart_to_first_step_s")
                                             / (med(restart["memory"], "restart_to_first_step_s")
                                                - med(restart["memory"], "resume_s"))),
        "floor_cpu_over_budget": floor_cpu_s / budget_cpu_s,
        "design_floor_cpu_over_budget": design_floor_cpu_s / budget_cpu_s,
    }
    return {"params": raw["params"], "world_size": raw["world_size"], "nodes": raw["nodes"], "replicas": raw["replicas"],
            "rank_state_GB": raw["rank_state_bytes"] / 1e9, "rounds": len(raw["saves"]["memory"]),
            "saves": saves, "throughput_steps_per_s": tp, "cpu_s_per_step": cpu,
            "memory_save_cpu_s": cpu["memory"]["median"] - cpu["none"]["median"], "floors": floors,
            "floor_cpu_s": floor_cpu_s, "design_floor_cpu_s": design_floor_cpu_s, "budget_cpu_s": budget_cpu_s,
            "startup_s": raw["startup_s"],
            "restart": restart, "ratios": ratios}


def to_markdown(r: dict) -> list[str]:
    def ms(x):
        return f"{x['median']:.3f} ({x['min']:.3f}-{x['max']:.3f})"
    s, t, ra = r["saves"], r["throughput_steps_per_s"], r["ratios"]
    return [f"{r['params'] / 1e6:.0f}M params, {r['nodes']} nodes on one machine, {r['world_size']} ranks, "
            f"{r['rank_state_GB']:.2f} GB of model + AdamW state per rank, {r['replicas']} replica; {r['device']}. "
            f"Median (min-max) over {r['rounds'] - 1} rounds after the first, methods interleaved. "
            + provenance.markdown_line(r), "",
            "| save | blocking (s) | files written (s) | until committed (s) |", "|---|---|---|---|",
            *(f"| {what} | {ms(s[tier]['blocking_s'])} | {ms(s[tier]['written_s'])} | {ms(s[tier]['committed_s'])} |"
              for tier, what in (("memory", "memory tier (committed: replicated and marked on every node)"),
                                 ("disk", "disk, async thread mode"))), "",
            "| restart to first resumed step | resume (s) | resume + first step (s) | with process start (s) |",
            "|---|---|---|---|",
            *(f"| {tier} tier | {ms(r['restart'][tier]['resume_s'])} | {ms(r['restart'][tier]['resume_and_first_step_s'])} | "
              f"{ms(r['restart'][tier]['restart_to_first_step_s'])} |" for tier in ("memory", "disk")), "",
            f"- training: {t['none']['median']:.3f} steps/s without checkpoints, {t['memory']['median']:.3f} with a "
            f"memory save every step: {ra['throughput_memory_every_step_over_none']:.1%} (goal >= 97%)",
            f"- CPU seconds per step on rank 0 (every thread): {ms(r['cpu_s_per_step']['none'])} without "
            f"checkpoints, {ms(r['cpu_s_per_step']['memory'])} with a memory save every step: "
            f"{r['memory_save_cpu_s']:.2f} s of CPU per memory save",
            f"- floor, each done bare: writing the state into the memory folder {ms(r['floors']['write_cpu_s'])} s of "
            f"CPU ({ms(r['floors']['write_s'])} s), sending it to the peer while receiving the peer's "
            f"{ms(r['floors']['wire_cpu_s'])} s of CPU ({ms(r['floors']['wire_s'])} s); with the second write (what "
            f"arrives), {r['floor_cpu_s']:.2f} s of CPU per save at the least, against the {r['budget_cpu_s']:.2f} s "
            f"a save may take per step for 97% (3% of a step plus the training process's idle time): "
            f"{ra['floor_cpu_over_budget']:.2f}x",
            f"- with what this design adds, each bare: the snapshot copy {ms(r['floors']['copy_cpu_s'])} s of CPU, "
            f"reading the file back to send it {ms(r['floors']['read_cpu_s'])} s, a checksum of the state "
            f"{ms(r['floors']['hash_cpu_s'])} s (twice: writer and receiver): {r['design_floor_cpu_s']:.2f} s of CPU "
            f"per save at the least, {ra['design_floor_cpu_over_budget']:.2f}x what 97% leaves",
            f"- memory save / async disk save: blocking {ra['memory_blocking_over_disk_blocking']:.2f}x, until "
            f"committed {ra['memory_replicated_over_disk_committed']:.2f}x",
            f"- restart to first step, disk / memory: {ra['restart_disk_over_memory']:.2f}x with the process start "
            f"({r['startup_s']:.1f} s, the same for both; goal >= 5x), "
            f"{ra['resume_and_first_step_disk_over_memory']:.2f}x for the resume and first step, "
            f"{ra['resume_disk_over_memory']:.2f}x for the resume alone; with a memory resume that took no time, "
            f"{ra['restart_disk_over_instant_memory']:.2f}x with the process start"]


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    started = provenance.start(argv)
    work = args.work_dir or tempfile.mkdtemp(prefix="memory-bench-")
    mem_root = tempfile.mkdtemp(prefix="memory-bench-", dir=args.shm_dir)
    try:
        raw = launch(args, work, mem_root)
    finally:
        shutil.rmtree(mem_root, ignore_errors=True)
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    import torch
    result = summarize(raw)
    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"
    provenance.record(result, "memory_bench", args.out, started)
    provenance.write_markdown(args.out, "memory_bench", to_markdown(result))


if __name__ == "__main__":
    main()
