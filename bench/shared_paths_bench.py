"""What the two shared-visibility checks cost: the start-up check of run.dir, data.cache_dir and ckpt.dir
(common/shared_paths.py) and the committer's listing before a marker (ckpt/commit_protocol.py check_visible).

    python bench/shared_paths_bench.py                     # 2 nodes x 2 ranks, 1,024 files, ~30 s
    python bench/shared_paths_bench.py --dir /nfs/scratch  # on the filesystem you will use

The start-up check: 4 processes (gloo, one machine) in 2 "nodes" (GROUP_RANK 0 and 1, as torchrun numbers them),
`--rounds` checks of 3 folders under --dir, each timed on rank 0 from call to return (both collectives included).
The commit check: `--files` files of a few bytes in one folder under --dir (one per rank at 70B on 512 GPUs is
about 516), `--rounds` calls of check_visible. Writes bench/results/shared_paths_bench.{json,md} (--out; runs kept
under bench/results/runs/); docs/multinode.md quotes it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import provenance  # noqa: E402 - bench/provenance.py, beside this script

NODES, PER_NODE = 2, 2


def _checker(rank: int, port: int, folder: str, rounds: int, q) -> None:
    os.environ["GROUP_RANK"] = str(rank // PER_NODE)
    import torch.distributed as dist

    from common.shared_paths import unshared_path_problem
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=NODES * PER_NODE)
    paths = {"run.dir": folder, "data.cache_dir": os.path.join(folder, "data-cache"),
             "ckpt.dir": os.path.join(folder, "checkpoints")}
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        problem = unshared_path_problem(paths)
        times.append(time.perf_counter() - t0)
        assert problem is None, problem
    if rank == 0:
        q.put(times)
    dist.destroy_process_group()


def startup_check(folder: str, rounds: int) -> list[float]:
    import torch.multiprocessing as mp

    from common.dist import free_port
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_checker, args=(r, port, folder, rounds, q)) for r in range(NODES * PER_NODE)]
    for p in procs:
        p.start()
    times = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return times


def commit_check(folder: str, files: int, rounds: int) -> list[float]:
    from ckpt.commit_protocol import check_visible
    manifest = {}
    for r in range(files):
        name = f"__{r}_0.distcp"
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"x" * 64)
        manifest[name] = {"size": 64}
    names, times = sorted(manifest), []
    for _ in range(rounds):
        t0 = time.perf_counter()
        check_visible(folder, manifest, names)
        times.append(time.perf_counter() - t0)
    return times


def summary(times: list[float]) -> dict:
    return {"seconds": times, "median_s": statistics.median(times), "max_s": max(times)}


def main(argv: list[str] | None = None) -> None:
    started = provenance.start(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the folders go (their filesystem is measured)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--files", type=int, default=1024)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="shared-paths-bench-", dir=args.dir)
    try:
        startup = summary(startup_check(os.path.join(work, "run"), args.rounds))
        os.makedirs(os.path.join(work, "step"))
        commit = summary(commit_check(os.path.join(work, "step"), args.files, args.rounds))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = provenance.record({"startup_check": {"nodes": NODES, "ranks": NODES * PER_NODE, "paths": 3, **startup},
                                "commit_check": {"files": args.files, **commit}, "dir": args.dir},
                               "shared_paths_bench", args.out, started)
    provenance.write_markdown(args.out, "shared_paths_bench", [
        provenance.markdown_line(result), "",
        "| check | size | median s | max s |", "|---|---|---|---|",
        f"| start-up (3 paths) | {NODES} nodes x {PER_NODE} ranks | {startup['median_s']:.4f} | {startup['max_s']:.4f} |",
        f"| before a marker | {args.files} files | {commit['median_s']:.4f} | {commit['max_s']:.4f} |"])


if __name__ == "__main__":
    main()
