"""One rank builds something the others need (the tokenized data cache, a model download): the others wait for it
through the job's store, for as long as the builder is alive, and never longer.

    python -m pytest tests/test_shared_paths.py -q -k one_rank_builds

Why not a collective: a barrier or broadcast gives up after the process group's timeout, so a job whose rank 0
tokenizes a large data set for an hour would crash on the other ranks. Why not a file the others poll (what this
replaced): on a folder that not every node sees, they poll forever. The store (torchrun's TCPStore, which every node
reaches; its keys prefixed by the restart attempt, train_fsdp.py attempt_store) carries three keys per build:
- `done`: the outcome, set once by the builder: {"ok": result} or {"error": message};
- `beat`: a counter the builder's heartbeat thread adds to every `dead_after_s / 6`;
- `who`: the builder's host, to name it.
A waiter checks `done` once every `poll_s` (one request, no server-side wait: a TCPStore wait that times out logs two
warning lines each time) and `beat` once every `dead_after_s / 3`. It ends, with one line, when:
- the builder failed: its message, on every waiting rank (`error_type`);
- the builder's heartbeat stopped for `dead_after_s` (its process was killed, its node lost) or the store is gone
  (the launcher that serves it died): naming the builder's rank and host;
- the builder finished, but `check(result)` still says the result is not visible here after `visible_within_s`
  (a folder this node does not share): that problem, naming this rank and host.
Cost: a waiter makes 1 / poll_s requests a second (0.5 at the default): at 512 ranks, about 256 requests a second
on the store while rank 0 builds; the builder one request per heartbeat.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import Counter
from typing import Callable

import torch.distributed as dist

_CALLS: Counter = Counter()  # key -> how many builds of that key this process has begun (see `one_rank_builds`)


def job_store():
    """The store of the default process group (torchrun's, prefixed by the restart attempt); None without a group."""
    return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None


def one_rank_builds(build: Callable[[], str], builder_rank: int, key: str, what: str, error_type: type[Exception], *,
                    check: Callable[[str], str | None] = lambda result: None, store=None, poll_s: float = 2.0,
                    dead_after_s: float = 120.0, visible_within_s: float = 60.0, report_s: float = 60.0,
                    log: Callable[[str], None] = print) -> str:
    """Rank `builder_rank` returns build(); every other rank that calls this with the same `key` returns the same
    string once the builder is done. Not a collective: ranks that do not need the result do not call it (per node:
    builder_rank = the node's first rank, key naming the node).

    `key`: names this build within the attempt; a second build under the same key in one process gets a fresh one
    (a per-process count, which the builder and its waiters keep alike by calling in the same order).
    `what`: the thing built, for the lines ("the training data cache /runs/a/data-cache/3f2a").
    `check(result)` (waiters only): None when the result is usable on this rank, else why not (e.g. a folder not
    seen from here); retried until `visible_within_s` after the builder finished.
    `store`: the job's store (default: the default process group's). Without a group or store: build() here.
    Every failure raises `error_type` with one line; `log` prints the waiting line once per `report_s` on rank 1 and
    each node's first rank."""
    store = store if store is not None else job_store()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if store is None:
        return build()
    _CALLS[key] += 1
    keys = {name: f"one_rank_builds/{key}/{_CALLS[key]}/{name}" for name in ("done", "beat", "who")}
    if rank == builder_rank:
        return _build_and_tell(build, store, keys, dead_after_s / 6, error_type)
    outcome = _wait_for_builder(store, keys, builder_rank, what, error_type, poll_s, dead_after_s, report_s, log)
    if "error" in outcome:
        raise error_type(outcome["error"])
    return _until_visible(outcome["ok"], check, visible_within_s, poll_s, builder_rank, what, error_type)


def _build_and_tell(build: Callable[[], str], store, keys: dict, beat_s: float, error_type: type[Exception]) -> str:
    """The builder: heartbeat while build() runs, then its outcome in `done` (an error as the waiters will raise it)."""
    store.set(keys["who"], socket.gethostname())
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(beat_s):
            try:
                store.add(keys["beat"], 1)
            except RuntimeError:
                return  # the store is gone: the waiters see that themselves
    store.add(keys["beat"], 1)
    threading.Thread(target=beat, name="one-rank-builds-beat", daemon=True).start()
    try:
        result = build()
    except Exception as e:  # noqa: BLE001 - told to the waiters, then re-raised here
        msg = str(e) if isinstance(e, error_type) else f"{type(e).__name__}: {e}"
        store.set(keys["done"], json.dumps({"error": msg}))
        raise
    finally:
        stop.set()
    store.set(keys["done"], json.dumps({"ok": result}))
    return result


def _wait_for_builder(store, keys: dict, builder_rank: int, what: str, error_type: type[Exception], poll_s: float,
                      dead_after_s: float, report_s: float, log: Callable[[str], None]) -> dict:
    """A waiter: the builder's outcome once it is in the store; raises `error_type` if the builder or the store is
    gone (see the module docstring)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    talk = rank == 1 or int(os.environ.get("LOCAL_RANK", rank)) == 0
    t0 = next_report = last_change = time.monotonic()
    next_beat_check, last_beat = t0, None
    try:
        while not store.check([keys["done"]]):
            now = time.monotonic()
            if now >= next_beat_check:
                next_beat_check = now + dead_after_s / 3
                beat = store.add(keys["beat"], 0)
                if beat != last_beat:
                    last_beat, last_change = beat, now
                elif now - last_change >= dead_after_s:
                    raise error_type(f"rank {builder_rank} ({_host(store, keys)}) stopped while building {what}: "
                                     f"no sign of life from it for {dead_after_s:.0f} s (its process or node is gone; "
                                     "its own log says why)")
            if talk and now >= next_report + report_s:
                next_report = now
                log(f"rank {rank}: waiting for rank {builder_rank} to build {what} ({(now - t0) / 60:.0f} min)")
            time.sleep(poll_s)
        return json.loads(store.get(keys["done"]))
    except dist.DistNetworkError:
        raise error_type(f"lost the job's store while waiting for rank {builder_rank} to build {what}: the launcher "
                         "that serves it (torchrun on the first node) is gone") from None


def _host(store, keys: dict) -> str:
    return store.get(keys["who"]).decode() if store.check([keys["who"]]) else "host unknown"


def _until_visible(result: str, check: Callable[[str], str | None], within_s: float, poll_s: float,
                   builder_rank: int, what: str, error_type: type[Exception]) -> str:
    """`result` once `check` passes here; a shared filesystem may show another node's new files a little late."""
    deadline = time.monotonic() + within_s
    while (problem := check(result)) is not None:
        if time.monotonic() >= deadline:
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise error_type(f"rank {builder_rank} built {what}, but rank {rank} ({socket.gethostname()}) does not "
                             f"see it after {within_s:.0f} s: {problem}")
        time.sleep(min(poll_s, 1.0))
    return result
