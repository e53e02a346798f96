"""Rank 0's heartbeat during the DCP coordinator's save-side work (issue 56, the watchdog's GIL gap): how long the
hang watchdog's beat thread waits for the GIL while rank 0 plans and finishes a save at the 70B shape.

    python bench/scale_beat.py --worlds 64,256 --out bench/results/scale_beat.json   # ~10 min on 2 busy cores
    python bench/scale_beat.py --worlds 8 --out /tmp/b.json                           # a smoke, seconds
    python bench/scale_beat.py --collector paused --worlds 64 --out bench/results/scale_beat-paused.json

In `ckpt.async_mode=thread` (and `off`) DCP's coordinator runs in the training process, beside the watchdog's beat
thread (finetune/hang.py), which needs the GIL to publish rank 0's record. A reader calls a rank frozen when its
heartbeat did not move over 3 x CHECK_S plus twice the slowest store time: a single C call that holds the GIL for
about 2 x CHECK_S (a beat every CHECK_S, none during the call) would make rank 0 look frozen. This script runs, in
one process, the coordinator's own work for a save of W ranks, built from torch's own classes as
bench/scale_coord.py builds them (each weight of the Llama 3.1 70B config and its two AdamW moments in W dim-0
shards): rank 0's part of DCP's plan gather (unpickle W local plans), the project's save planner's
create_global_plan (first save: no cache), the scatter (pickle W global plans), the write results' gather (unpickle
W lists), the project's CheckpointWriter.finish (.metadata and its index, ckpt/checksum.py, into a temporary
folder), DCP's broadcast of the returned metadata, and a full gc.collect() with the plan cache alive (a gen-2
collection the training process may run at any time after it). `--collector paused`: the save as ckpt/saver.py runs
it now, the collector paused on the coordinator from the save's start to its end and what it leaves frozen
(ckpt/collector.py). Meanwhile a real HangWatchdog (rank 0 of W,
CHECK_S 1 s, on a HashStore that notes when each beat lands) beats, and a probe thread wakes every 5 ms.

Per phase: wall seconds, the longest probe gap (the longest the GIL was out of reach, scheduling by the loaded
machine included) and the coordinator thread's CPU seconds within that gap (time.pthread_getcpuclockid: the
GIL-holding work itself, the part a quiet machine also pays), the gen-2 collections' longest pause (gc.callbacks);
and the longest gap between two beats landing. Writes {"rows": [...]} with provenance (bench/provenance.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402 - bench/provenance.py, beside this script
import scale_coord  # noqa: E402 - its 70B shapes and local save plans
from ckpt import collector  # noqa: E402

PROBE_S = 0.005


class Probe:
    """A thread that wakes every PROBE_S and notes the longest gap, and the coordinator's CPU time within it."""

    def __init__(self, worker_ident: int):
        self.clock = time.pthread_getcpuclockid(worker_ident)
        self.gap, self.gap_cpu, self.stop = 0.0, 0.0, False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        last, last_cpu = time.monotonic(), time.clock_gettime(self.clock)
        while not self.stop:
            time.sleep(PROBE_S)
            now, cpu = time.monotonic(), time.clock_gettime(self.clock)
            if now - last - PROBE_S > self.gap:
                self.gap, self.gap_cpu = now - last - PROBE_S, cpu - last_cpu
            last, last_cpu = now, cpu

    def reset(self):
        self.gap, self.gap_cpu = 0.0, 0.0


class GcPauses:
    """The longest gen-2 collection (the cyclic GC holds the GIL throughout one)."""

    def __init__(self):
        self.longest, self.count, self._t0 = 0.0, 0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if info["generation"] != 2:
            return
        if phase == "start":
            self._t0 = time.monotonic()
        elif self._t0 is not None:
            self.longest, self.count = max(self.longest, time.monotonic() - self._t0), self.count + 1


class BeatTimes:
    """A HashStore whose `set` of a progress record notes when it landed."""

    def __init__(self):
        import torch.distributed as dist
        self.store, self.landed = dist.HashStore(), []

    def set(self, key, value):
        self.landed.append(time.monotonic())
        return self.store.set(key, value)

    def __getattr__(self, name):
        return getattr(self.store, name)


def write_results(global_plans):
    """Each rank's DCP write results for its global plan (one file per rank), as its finish sends them."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult
    out = []
    for r, plan in enumerate(global_plans):
        offset, results = 0, []
        for item in plan.items:
            n = 4 * item.tensor_data.chunk.sizes.numel() if item.tensor_data else 8
            results.append(WriteResult(index=item.index, size_in_bytes=n,
                                       storage_data=_StorageInfo(f"__{r}_0.distcp", offset, n)))
            offset += n
        out.append(results)
    return out


def coordinator(world: int, ckpt_dir: str, paused: bool):
    """Rank 0's save-side work, phase by phase: yields (phase, callable) so each is timed on its own."""
    from ckpt.uploader import CheckpointWriter, save_planner
    tensors = scale_coord.sharded("70B")
    blobs = [pickle.dumps(p) for p in scale_coord.local_save_plans(tensors, world)]  # what each rank sends
    gc.collect()
    state = {}
    if paused:
        yield "save starts: collector paused", lambda: state.update(until=collector.paused_until(True))
    yield "gather local plans (unpickle W)", lambda: state.update(plans=[pickle.loads(b) for b in blobs])
    planner = save_planner(ckpt_dir, None)
    yield "create_global_plan (first save)", lambda: state.update(
        zip(("global_plans", "metadata"), planner.create_global_plan(state.pop("plans"))))
    yield "scatter global plans (pickle W)", lambda: [pickle.dumps(p) for p in state["global_plans"]]
    result_blobs = [pickle.dumps(r) for r in write_results(state["global_plans"])]
    yield "gather write results (unpickle W)", lambda: state.update(results=[pickle.loads(b) for b in result_blobs])
    writer = CheckpointWriter(ckpt_dir, 1)
    writer.reset(ckpt_dir)
    writer.set_up_storage_writer(True)
    yield "finish: .metadata and its index", lambda: writer.finish(state["metadata"], state["results"])
    yield "broadcast the returned metadata", lambda: pickle.loads(pickle.dumps(state["metadata"]))
    if paused:
        yield "save ends: collector enabled, what is alive frozen", lambda: state.pop("until")(None)
    yield "gc.collect() with the plan cache alive", gc.collect
    yield "free the save's objects", state.clear


def run_world(world: int, paused: bool) -> list[dict]:
    import finetune.hang as hang
    beats = BeatTimes()
    dog = hang.HangWatchdog(600.0, 0, world, "unused", None, beats)
    dog.state = ("checkpoint", 1, time.monotonic())
    dog._publish()
    probe, pauses = Probe(threading.get_ident()), GcPauses()
    dog._beater.start()
    probe.thread.start()
    rows = []
    with tempfile.TemporaryDirectory() as ckpt_dir:
        for phase, work in coordinator(world, ckpt_dir, paused):
            time.sleep(2 * hang.CHECK_S)  # a beat before the phase
            probe.reset()
            pauses.longest = 0.0
            start, t0, cpu0 = len(beats.landed), time.monotonic(), time.thread_time()
            work()
            t1, cpu1 = time.monotonic(), time.thread_time()
            time.sleep(2 * hang.CHECK_S)  # the beat after it
            landed = beats.landed[max(0, start - 1):]
            gaps = [b - a for a, b in zip(landed, landed[1:])]
            rows.append({"W": world, "collector": "paused" if paused else "on", "phase": phase, "seconds": round(t1 - t0, 3), "cpu_s": round(cpu1 - cpu0, 3),
                         "probe_gap_s": round(probe.gap, 3), "probe_gap_cpu_s": round(probe.gap_cpu, 3),
                         "gc2_longest_s": round(pauses.longest, 3), "beat_gap_s": round(max(gaps, default=0), 3)})
            print(json.dumps(rows[-1]), flush=True)
    probe.stop = True
    dog.close()
    gc.unfreeze()
    gc.callbacks.remove(pauses._callback)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="64,256")
    p.add_argument("--collector", choices=("on", "paused"), default="on",
                   help="on: Python's collector as it was; paused: as ckpt/saver.py runs the coordinator's save now")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "scale_beat.json"))
    args = p.parse_args(argv)
    started = provenance.start(argv)
    rows = []
    for world in map(int, args.worlds.split(",")):
        rows += run_world(world, args.collector == "paused")
        gc.collect()
    import finetune.hang as hang
    name = os.path.basename(args.out).removesuffix(".json")
    provenance.record({"rows": rows, "model": "70B", "collector": args.collector, "check_s": hang.CHECK_S, "probe_s": PROBE_S,
                       "tensors": len(scale_coord.sharded("70B"))}, name, os.path.dirname(os.path.abspath(args.out)),
                      started)


if __name__ == "__main__":
    sys.exit(main())
