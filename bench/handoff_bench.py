"""What handing the staged state to DCP's process-mode uploader costs, per save: tensors shared by file descriptor
(torch's default sharing strategy, what async_mode=process uses) against shared by file name.

    python bench/handoff_bench.py                    # 876 DTensors (ckpt_bench's 289M shape on a rank), ~1 min
    python bench/handoff_bench.py --tensors 100 --rounds 3

At every save DCP pickles the staged state dict into a pipe to its uploader process (a spawned process, as DCP
starts it) and the uploader unpickles it before it plans or writes anything. Sharing by descriptor, the uploader
fetches each storage's descriptor from this process over one connection per storage (multiprocessing's resource
sharer); by name, it opens the named segment itself. The two sets of tensors are allocated side by side and
sent in alternating order, each round; the uploader maps nothing until written, so the byte count matters little
and the tensor count does. Writes bench/results/handoff_bench.{json,md} (runs kept under bench/results/runs/);
docs/performance.md says what it explains and why the default stays.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import provenance  # bench/provenance.py, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def uploader(conn) -> None:
    """The stand-in for DCP's uploader: unpickle each request, say when it is whole."""
    while (obj := conn.recv()) is not None:
        conn.send((len(obj), time.perf_counter()))


def staged_state(n: int, total_bytes: int, strategy: str) -> dict:
    """`n` one-dimensional fp32 DTensors in shared memory (by `strategy`), `total_bytes` in all."""
    import torch
    import torch.multiprocessing as mp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mp.set_sharing_strategy(strategy)  # what the allocation below uses
    mesh = init_device_mesh("cpu", (1,))
    numel = max(1, total_bytes // 4 // n)
    return {f"t{i}": DTensor.from_local(torch.zeros(numel).share_memory_(), mesh, [Shard(0)]) for i in range(n)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=876, help="storages per save (params + 2 AdamW moments + steps)")
    p.add_argument("--mib", type=int, default=1024, help="bytes of each set, in MiB")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    started = provenance.start(argv)
    import torch.distributed as dist
    import torch.multiprocessing as mp
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the mesh's: no peer, no port
    sets = {s: staged_state(args.tensors, args.mib << 20, s) for s in ("file_descriptor", "file_system")}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=uploader, args=(child,), daemon=True)
    proc.start()
    secs: dict[str, list] = {s: [] for s in sets}
    for r in range(args.rounds + 1):  # the first round warms both up
        for strategy in (list(sets) if r % 2 == 0 else list(sets)[::-1]):
            mp.set_sharing_strategy(strategy)  # what pickling reads
            t0 = time.perf_counter()
            parent.send(sets[strategy])
            count, whole = parent.recv()
            assert count == args.tensors
            if r:
                secs[strategy].append(whole - t0)
    parent.send(None)
    proc.join()
    dist.destroy_process_group()
    rows = {s: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)} for s, v in secs.items()}
    result = provenance.record({"tensors": args.tensors, "bytes": args.mib << 20, "rounds": args.rounds,
                                "handoff_s": rows, "raw_s": secs}, "handoff_bench", args.out, started)
    lines = [f"{args.tensors} DTensors, {args.mib} MiB, to a spawned process through a pipe; {args.rounds} rounds "
             "after a warm-up, the two orders alternating. " + provenance.markdown_line(result), "",
             "| shared by | send until unpickled (s), median (min-max) |", "|---|---|"]
    for s, v in rows.items():
        lines.append(f"| {s} | {v['median_s']:.3f} ({v['min_s']:.3f}-{v['max_s']:.3f}) |")
    provenance.write_markdown(args.out, "handoff_bench", lines)


if __name__ == "__main__":
    sys.exit(main())
