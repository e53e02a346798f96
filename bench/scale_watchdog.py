"""The hang watchdog (finetune/hang.py) at W = 64..2048 on one machine: the project's own HangWatchdog objects, one
per simulated rank, each with its own client of one real TCPStore, counted.

    python bench/scale_watchdog.py                                   # W = 64,256,1024,2048, ~10 min on 2 cores
    python bench/scale_watchdog.py --worlds 64,256 --out /tmp/w.json  # what the scale simulation runs

The store is hosted as torchrun's agent hosts it (TCPStore is_master, use_libuv=True, in this process), its keys
under a PrefixStore as init_distributed's. The W ranks are HangWatchdog objects spread over a few worker processes
(store calls release the GIL), each with its beat thread and its watchdog thread, each with a TCPStore client of its
own (a rank's own connection), wrapped to count what it sends and reads: a multi_get or check of k keys counts k
key operations, a set or add one; bytes are the keys and values sent and the values received. Ranks r//8 share a
simulated node (its host name in the record: no kill can reach a real process). Python stacks are not written (W
files of every thread of a process holding W/P ranks); everything else runs as in training.

Cases, per W (the CHECK_S cadence, 1 s, is real; the hang timeout is compressed, and said so in each row):
- steady: every rank in `step` within its timeout for 10 s: key operations a second.
- slow save: every rank in `checkpoint` for 10 timeouts of 4 s (a 10-minute save at auto's 60 s floor is 10
  periods): key operations per check, and no verdict.
- sigterm: a SIGTERM on every rank at once (written to each watchdog's signal pipe, as signal.set_wakeup_fd
  does), every rank alive: key operations, and no exit.
- frozen: rank W-3 (no reader) stops (its threads end, its record stays) at the start of a save: the verdict
  names it, every other rank acts on it (exit 76); seconds from the timeout to the last rank's exit.
- readers frozen: both readers (ranks 0 and W/2) stop at the start of a save: the backup (rank 3W/4) sees it in
  the readers' records, reads every record and names them; seconds as in `frozen`.

Writes {"rows": [...], "provenance": {...}} to --out (default bench/results/scale_watchdog.json; each run also
under <out's folder>/runs/<name>/, bench/provenance.py). A row: path, when, formula, W, N (8 ranks a node),
requests_per_rank, requests_total, bytes_per_rank, bytes_total, busiest_share (the busiest rank's share of the
total; the store's one server thread serves all of it), seconds, note.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import provenance  # noqa: E402 - bench/provenance.py, beside this script

RANKS_PER_NODE = 8
TIMEOUT_S = 4.0  # the compressed hang timeout of the save cases
SAVE_PERIODS = 10  # a 10-minute save at auto's 60 s floor overruns 10 periods
STEADY_S = 10.0


class Counted:
    """A store client that counts key operations and bytes (see the module's docstring)."""

    def __init__(self, store):
        self.store, self.ops, self.bytes, self.records, self.lock = store, 0, 0, 0, threading.Lock()

    def _count(self, ops: int, nbytes: int, keys=()) -> None:
        with self.lock:
            self.ops += ops
            self.bytes += nbytes
            self.records += sum(k.startswith("finetune/progress/") for k in keys)  # the records read, exactly

    def set(self, key, value):
        self._count(1, len(key) + len(value))
        return self.store.set(key, value)

    def add(self, key, value):
        self._count(1, len(key) + 8)
        return self.store.add(key, value)

    def get(self, key):
        out = self.store.get(key)
        self._count(1, len(key) + len(out), [key])
        return out

    def check(self, keys):
        self._count(len(keys), sum(map(len, keys)), keys)
        return self.store.check(keys)

    def multi_get(self, keys):
        out = self.store.multi_get(keys)
        self._count(len(keys), sum(map(len, keys)) + sum(map(len, out)), keys)
        return out


def worker(host: str, port: int, ranks: list[int], world: int, conn, run_dir: str) -> None:
    """One process holding `ranks`: runs each case the parent names, reports its counts."""
    threading.stack_size(256 << 10)
    import torch.distributed as dist
    import finetune.hang as hang
    ended: dict[int, tuple[int, float]] = {}  # rank -> (exit code, when)

    def exit_(code):  # a verdict's os._exit: this rank's threads end, the process and its other ranks go on
        rank = getattr(threading.current_thread(), "rank", None)
        if rank is None:
            real_exit(code)
        ended[rank] = (code, time.monotonic())
        raise SystemExit(code)
    real_exit, os._exit = os._exit, exit_
    hang.HangWatchdog._dump_stacks = lambda self: os.path.join(run_dir, "hang", f"rank{self.rank}.txt")
    def client(_):  # a rank's own connection; made 32 at a time (the server accepts ~25 a second here)
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=300), use_libuv=True,
                             wait_for_workers=False)
    with ThreadPoolExecutor(32) as pool:
        clients = dict(zip(ranks, pool.map(client, ranks)))
    log = SimpleNamespace(event_from_any_rank=lambda name, **kw: None)
    conn.send("ready")
    while (case := conn.recv()) is not None:
        name, timeout, prefix, frozen = case
        stores = {r: Counted(dist.PrefixStore(prefix, clients[r])) for r in ranks}
        dogs = [hang.HangWatchdog(timeout, r, world, run_dir, log, stores[r]) for r in ranks]
        phase = "step" if name == "steady" else "checkpoint"
        for dog in dogs:
            dog.where = {"host": f"node{dog.rank // RANKS_PER_NODE}", "pid": 1 << 30}  # no kill reaches a process
            dog.state = (phase, 1, time.monotonic())  # the record a rank frozen at the case's start leaves
            dog._publish()
            dog._signals = os.pipe()
            for fd in dog._signals:
                os.set_blocking(fd, False)
        conn.send("published")
        t0 = conn.recv()  # every rank's record is in: the case starts now, on every worker's clock
        before = {r: (s.ops, s.bytes, s.records) for r, s in stores.items()}
        for dog in dogs:
            dog.state = (phase, 1, time.monotonic())
            if dog.rank in frozen:
                continue  # SIGSTOP at the save's start: it beats no more; its record stays as it was
            for t in (dog._beater, dog._thread):
                t.rank = dog.rank
                t.start()
        if name == "sigterm":
            for dog in dogs:
                os.write(dog._signals[1], bytes([signal.SIGTERM]))
        conn.recv()  # the parent says when the case is over
        for dog in dogs:  # the watchdog threads first: a reader in its window must not see the beats end
            dog._stop = True
            dog._wake.set()
        for dog in dogs:
            if dog._thread.ident is not None:
                dog._thread.join(30)
        for dog in dogs:
            dog._changed.set()
            if dog._beater.ident is not None:
                dog._beater.join(30)
        ops = {r: s.ops - before[r][0] for r, s in stores.items()}
        nbytes = {r: s.bytes - before[r][1] for r, s in stores.items()}
        verdicts = {d.rank: d._news() and d._verdict() for d in dogs}
        records = {r: s.records - before[r][2] for r, s in stores.items()}
        conn.send({"ops": ops, "bytes": nbytes, "records": records,
                   "ended": {r: (code, when - t0) for r, (code, when) in ended.items()},
                   "verdict": next((v for v in verdicts.values() if v), None)})
        ended.clear()
        for dog in dogs:
            for fd in dog._signals:
                os.close(fd)
    conn.send("bye")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, processes: int, run_dir: str) -> list[dict]:
    import torch.distributed as dist
    port, ctx = free_port(), mp.get_context("fork")
    pipes, procs = [], []
    for p in range(processes):  # forked before the store's server thread exists
        here, there = ctx.Pipe()
        proc = ctx.Process(target=worker, args=("127.0.0.1", port, list(range(p, world, processes)), world, there,
                                                run_dir), daemon=True)
        proc.start()
        pipes.append(here)
        procs.append(proc)
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=300), use_libuv=True,
                           wait_for_workers=False)
    for c in pipes:
        assert c.recv() == "ready"
    cases = [("steady", 600.0, STEADY_S, ()), ("slow save", TIMEOUT_S, TIMEOUT_S * SAVE_PERIODS + 1, ()),
             ("sigterm", 600.0, 6.0, ()), ("frozen", TIMEOUT_S, TIMEOUT_S + 20.0, (world - 3,)),
             ("readers frozen", TIMEOUT_S, TIMEOUT_S + 30.0, (0, world // 2))]
    out = {}
    for n, (name, timeout, seconds, frozen) in enumerate(cases):
        for c in pipes:
            c.send((name, timeout, f"w{world}/case{n}/", frozen))
        for c in pipes:
            assert c.recv() == "published"
        t0 = time.monotonic()
        for c in pipes:
            c.send(t0)
        time.sleep(seconds)
        for c in pipes:
            c.send("over")
        reports = [c.recv() for c in pipes]
        out[name] = merge(reports, time.monotonic() - t0)
        print(f"W={world} {name}: {summary(out[name])}", flush=True)
    for c in pipes:
        c.send(None)
        c.recv()
    for proc in procs:
        proc.join(30)
    del server
    return rows_of(world, out)


def merge(reports: list[dict], seconds: float) -> dict:
    ops, nbytes, records, ended, verdict = {}, {}, {}, {}, None
    for r in reports:
        ops.update(r["ops"])
        records.update(r["records"])
        nbytes.update(r["bytes"])
        ended.update(r["ended"])
        verdict = verdict or r["verdict"]
    return {"ops": ops, "bytes": nbytes, "records": records, "ended": ended, "verdict": verdict, "seconds": seconds}


def summary(case: dict) -> str:
    v = case["verdict"]
    return (f"{sum(case['ops'].values())} key ops, {sum(case['bytes'].values())} bytes, {len(case['ended'])} exited, "
            f"verdict: {v and {k: v[k] for k in ('why', 'by', 'frozen')}}")


def row(path, when, formula, world, ops, nbytes, seconds, note, per=1.0) -> dict:
    """`per`: what the totals are divided by (seconds for a rate, checks for a per-check figure)."""
    total, total_bytes = sum(ops.values()) / per, sum(nbytes.values()) / per
    return {"path": path, "when": when, "formula": formula, "W": world, "N": max(1, world // RANKS_PER_NODE),
            "requests_per_rank": round(total / world, 2), "requests_total": round(total, 1),
            "bytes_per_rank": round(total_bytes / world, 1), "bytes_total": round(total_bytes),
            "busiest_share": round(max(ops.values()) / per / total, 4) if total else None,
            "seconds": round(seconds, 2) if seconds is not None else None, "note": note}


def rows_of(world: int, out: dict) -> list[dict]:
    steady, save, term, frozen = out["steady"], out["slow save"], out["sigterm"], out["frozen"]
    rows = [row("hang watchdog: beat + failure key", "per second", "2W key ops/s (1 set, 1 check per rank)", world,
                steady["ops"], steady["bytes"], steady["seconds"],
                "every rank in `step` within its timeout, CHECK_S 1 s; requests = key operations, per second",
                per=steady["seconds"])]
    steady_rate = {r: steady["ops"][r] / steady["seconds"] for r in steady["ops"]}
    save_ok = save["verdict"] is None and not save["ended"]
    rows.append(per_check(row("hang watchdog: slow-phase check", "per check (each timeout a save or eval overruns)",
                              "<= 8W keys per check: 2 readers x 2 multi_get of W-1 (W-1 more once), the backup "
                              "2 x 2 (its readers'); others 0",
                              world, save["ops"], save["bytes"], save["seconds"],
                              f"a save {SAVE_PERIODS} timeouts long (timeout compressed to {TIMEOUT_S:g} s: 10 min at "
                              f"auto's 60 s floor is 10 periods); its key ops less the steady rate, per check; "
                              f"seconds: the whole save; "
                              f"{'no verdict' if save_ok else 'FALSE VERDICT: ' + summary(save)}"),
                          save, steady, steady_rate, SAVE_PERIODS, world))
    term_ok = term["verdict"] is None and not term["ended"]
    rows.append(per_check(row("hang watchdog: SIGTERM to all", "at each SIGTERM (every preemption)",
                              "2 readers x 2 multi_get of W-1 + the backup's 4: ~4W keys; others 0", world, term["ops"], term["bytes"],
                              term["seconds"], f"every rank signalled at once, all alive; "
                              f"{'no exit, no verdict' if term_ok else 'WRONG: ' + summary(term)}"),
                          term, steady, steady_rate, 1, world))
    v = frozen["verdict"]
    named = bool(v) and v["frozen"] == [world - 3]
    exits = [code for code, _ in frozen["ended"].values()]
    last = max((when for _, when in frozen["ended"].values()), default=None)
    rows.append(per_check(row("hang watchdog: one frozen rank", "once, at the hang",
                              "~4W keys (the check) + W gets of the verdict", world, frozen["ops"], frozen["bytes"],
                              None if last is None else last - TIMEOUT_S,
                              f"rank {world - 3} stopped at the save's start, timeout {TIMEOUT_S:g} s: "
                              f"{'named' if named else 'NOT NAMED'} by rank {v and v['by']}; "
                              f"{exits.count(76)} of {world - 1} live ranks exited 76; seconds: from the timeout to "
                              f"the last rank's exit"),
                          frozen, steady, steady_rate, 1, world, seconds=frozen["seconds"]))
    both = out["readers frozen"]
    v, readers = both["verdict"], sorted({0, world // 2})
    named = bool(v) and v["frozen"] == readers
    exits = [code for code, _ in both["ended"].values()]
    last = max((when for _, when in both["ended"].values()), default=None)
    rows.append(per_check(row("hang watchdog: both readers frozen", "once, at the hang",
                              "the backup: 4 keys per check, then ~3W once (every record) + W gets of the verdict",
                              world, both["ops"], both["bytes"], None if last is None else last - TIMEOUT_S,
                              f"ranks {readers} (the readers) stopped at the save's start, timeout {TIMEOUT_S:g} s: "
                              f"{'named' if named else 'NOT NAMED'} by rank {v and v['by']}; "
                              f"{exits.count(76)} of {world - 2} live ranks exited 76; seconds: from the timeout to "
                              f"the last rank's exit"),
                          both, steady, steady_rate, 1, world, seconds=both["seconds"]))
    return rows


def per_check(r: dict, case: dict, steady: dict, steady_rate: dict, checks: int, world: int,
              seconds: float | None = None) -> dict:
    """The case's key operations less the steady cadence over its length, per check."""
    span = case["seconds"] if seconds is None else seconds
    extra = {k: max(0.0, case["ops"][k] - steady_rate.get(k, 0) * span) / checks for k in case["ops"]}
    rate_b = {k: steady["bytes"][k] / steady["seconds"] for k in steady["bytes"]}
    extra_b = {k: max(0.0, case["bytes"][k] - rate_b.get(k, 0) * span) / checks for k in case["bytes"]}
    total, total_b = sum(extra.values()), sum(extra_b.values())
    records = sum(case["records"].values()) / checks
    return r | {"records_read_total": round(records, 1), "records_read_per_W": round(records / world, 2),
                "requests_per_rank": round(total / world, 2), "requests_total": round(total, 1),
                "bytes_per_rank": round(total_b / world, 1), "bytes_total": round(total_b),
                "busiest_share": round(max(extra.values()) / total, 4) if total else None}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="64,256,1024,2048")
    p.add_argument("--processes", type=int, default=4, help="worker processes holding the ranks")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "scale_watchdog.json"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    started = provenance.start(argv)
    import tempfile
    import torch  # noqa: F401 - before the workers fork: they share its import
    rows = []
    with tempfile.TemporaryDirectory() as run_dir:
        for world in map(int, args.worlds.split(",")):
            rows += run_world(world, min(args.processes, world), run_dir)
    name = os.path.basename(args.out).removesuffix(".json")
    provenance.record({"rows": rows, "ranks_per_node": RANKS_PER_NODE, "timeout_s": TIMEOUT_S,
                       "save_periods": SAVE_PERIODS, "processes": args.processes}, name,
                      os.path.dirname(os.path.abspath(args.out)), started)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
