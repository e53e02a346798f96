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

`each_builds` is the same wait with many builders (one per node downloading a model before any process group,
finetune/model_files.py): a `finished` counter instead of `done`, one heartbeat counter all of them share.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections import Counter
from typing import Callable

import torch.distributed as dist

_FAILED = 1 << 40  # added to each_builds' `finished` by a builder that failed: more than any count of builders
_CALLS: Counter = Counter()  # key -> how many builds of that key this process has begun (see `one_rank_builds`)


def job_store():
    """The store of the default process group (torchrun's, prefixed by the restart attempt); None without a group."""
    return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None


def one_rank_builds(build: Callable[[], str], builder_rank: int, key: str, what: str, error_type: type[Exception], *,
                    check: Callable[[str], str | None] = lambda result: None, store=None, poll_s: float = 2.0,
                    dead_after_s: float = 120.0, visible_within_s: float = 60.0, report_s: float = 60.0,
                    log: Callable[[str], None] = print, rank: int | None = None) -> str:
    """Rank `builder_rank` returns build(); every other rank that calls this with the same `key` returns the same
    string once the builder is done. Not a collective: ranks that do not need the result do not call it (per node:
    builder_rank = the node's first rank, key naming the node).

    `key`: names this build within the attempt; a second build under the same key in one process gets a fresh one
    (a per-process count, which the builder and its waiters keep alike by calling in the same order).
    `what`: the thing built, for the lines ("the training data cache /runs/a/data-cache/3f2a").
    `check(result)` (waiters only): None when the result is usable on this rank, else why not (e.g. a folder not
    seen from here); retried until `visible_within_s` after the builder finished.
    `store`: the job's store (default: the default process group's). Without a group or store: build() here.
    `rank`: this process's rank (default: the default group's; before one exists, the launcher's RANK).
    Every failure raises `error_type` with one line; `log` prints the waiting line once per `report_s` on rank 1 and
    each node's first rank."""
    store = store if store is not None else job_store()
    rank = _rank() if rank is None else rank
    if store is None:
        return build()
    _CALLS[key] += 1
    keys = {name: f"one_rank_builds/{key}/{_CALLS[key]}/{name}" for name in ("done", "beat", "who")}
    if rank == builder_rank:
        return _build_and_tell(build, store, keys, dead_after_s / 6, error_type)
    waiting = _Waiting(store, keys["beat"], what, error_type, poll_s, dead_after_s, report_s, log, rank)
    waiting.until(lambda: store.check([keys["done"]]),
                            lambda: f"rank {builder_rank} ({_host(store, keys['who'])}) stopped while building {what}",
                            f"waiting for rank {builder_rank} to build {what}")
    outcome = json.loads(store.get(keys["done"]))
    if "error" in outcome:
        raise error_type(outcome["error"])
    return _until_visible(outcome["ok"], check, visible_within_s, poll_s, builder_rank, what, error_type, rank)


def each_builds(build: Callable[[], None], me: int, count: int, key: str, what: str, error_type: type[Exception], *,
                store, poll_s: float = 2.0, dead_after_s: float = 120.0, report_s: float = 60.0,
                log: Callable[[str], None] = print, rank: int | None = None) -> None:
    """Each of `count` builders (`me`: 0 .. count-1, e.g. one process per node) runs build(); each returns once
    every one has, so that none goes on (into a collective with a deadline) while another still builds.
    Keys per build: `finished` (a counter; a failure adds _FAILED), `failed` (a failure's message), one shared
    `beat` counter that every builder still building adds to, and per builder `who/<me>` (its host) and `done/<me>`
    (set when it ends), read only to name the builders that stopped. A builder raises `error_type`, with one line, when:
    - any builder failed: that failure's message;
    - no builder still building has beaten for `dead_after_s` and some never finished (their process or node is
      gone): naming them;
    - the store is gone.
    Cost: per builder one request per poll_s and one per dead_after_s / 3 while it waits, O(count) requests only
    to name the dead ones: the job's total is O(count) per poll, never O(count^2)."""
    rank = _rank() if rank is None else rank
    _CALLS[key] += 1
    prefix = f"each_builds/{key}/{_CALLS[key]}"
    keys = {name: f"{prefix}/{name}" for name in ("finished", "failed", "beat")}
    store.set(f"{prefix}/who/{me}", socket.gethostname())
    try:
        with _heartbeat(store, keys["beat"], dead_after_s / 6):
            build()
    except Exception as e:  # noqa: BLE001 - told to the others, then re-raised here
        store.set(keys["failed"], str(e) if isinstance(e, error_type) else f"{type(e).__name__}: {e}")
        store.add(keys["finished"], _FAILED)  # the waiters' one poll request sees it
        raise
    finally:
        store.set(f"{prefix}/done/{me}", "1")
    store.add(keys["finished"], 1)

    def stopped() -> str:
        gone = [i for i in range(count) if not store.check([f"{prefix}/done/{i}"])]
        hosts = ", ".join(f"{i} ({_host(store, f'{prefix}/who/{i}')})" for i in gone[:3])
        return f"{len(gone)} of {count} stopped while building {what}, the first: {hosts}"
    waiting = _Waiting(store, keys["beat"], what, error_type, poll_s, dead_after_s, report_s, log, rank)
    waiting.until(lambda: store.add(keys["finished"], 0) >= count, stopped, f"waiting for {count} builders of {what}")
    if store.add(keys["finished"], 0) >= _FAILED:
        raise error_type(store.get(keys["failed"]).decode())


def _rank() -> int:
    """The default group's rank; before one exists, the rank the launcher gave (RANK), 0 without one."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0") or 0)


@contextlib.contextmanager
def _heartbeat(store, key: str, beat_s: float):
    """Add to the counter `key` now and every `beat_s` while the body runs (a thread: the body may block in C)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(beat_s):
            try:
                store.add(key, 1)
            except RuntimeError:
                return  # the store is gone: the waiters see that themselves
    store.add(key, 1)
    threading.Thread(target=beat, name="handoff-beat", daemon=True).start()
    try:
        yield
    finally:
        stop.set()


def _build_and_tell(build: Callable[[], str], store, keys: dict, beat_s: float, error_type: type[Exception]) -> str:
    """The builder: heartbeat while build() runs, then its outcome in `done` (an error as the waiters will raise it)."""
    store.set(keys["who"], socket.gethostname())
    try:
        with _heartbeat(store, keys["beat"], beat_s):
            result = build()
    except Exception as e:  # noqa: BLE001 - told to the waiters, then re-raised here
        msg = str(e) if isinstance(e, error_type) else f"{type(e).__name__}: {e}"
        store.set(keys["done"], json.dumps({"error": msg}))
        raise
    store.set(keys["done"], json.dumps({"ok": result}))
    return result


class _Waiting:
    """A waiter's loop, for one_rank_builds and each_builds: polls `done()` every poll_s and the builders' shared
    heartbeat counter every dead_after_s / 3; see the module docstring for how it ends."""

    def __init__(self, store, beat_key: str, what: str, error_type: type[Exception], poll_s: float,
                 dead_after_s: float, report_s: float, log: Callable[[str], None], rank: int):
        self.store, self.beat_key, self.what, self.error_type = store, beat_key, what, error_type
        self.poll_s, self.dead_after_s, self.report_s, self.log, self.rank = poll_s, dead_after_s, report_s, log, rank

    def until(self, done: Callable[[], bool], stopped: Callable[[], str], waiting_for: str) -> None:
        """Return once done(); raise error_type naming stopped() when the heartbeat stood still for dead_after_s."""
        talk = self.rank == 1 or int(os.environ.get("LOCAL_RANK", self.rank)) == 0
        t0 = next_report = last_change = time.monotonic()
        next_beat_check, last_beat = t0, None
        try:
            while not done():
                now = time.monotonic()
                if now >= next_beat_check:
                    next_beat_check = now + self.dead_after_s / 3
                    beat = self.store.add(self.beat_key, 0)
                    if beat != last_beat:
                        last_beat, last_change = beat, now
                    elif now - last_change >= self.dead_after_s:
                        raise self.error_type(f"{stopped()}: no sign of life from it for {self.dead_after_s:.0f} s "
                                              "(its process or node is gone; its own log says why)")
                if talk and now >= next_report + self.report_s:
                    next_report = now
                    self.log(f"rank {self.rank}: {waiting_for} ({(now - t0) / 60:.0f} min)")
                time.sleep(self.poll_s)
        except dist.DistNetworkError:
            raise self.error_type(f"lost the job's store while {waiting_for}: the launcher that serves it (torchrun "
                                  "on the first node) is gone") from None


def _host(store, key: str) -> str:
    return store.get(key).decode() if store.check([key]) else "host unknown"


def _until_visible(result: str, check: Callable[[str], str | None], within_s: float, poll_s: float,
                   builder_rank: int, what: str, error_type: type[Exception], rank: int) -> str:
    """`result` once `check` passes here; a shared filesystem may show another node's new files a little late."""
    deadline = time.monotonic() + within_s
    while (problem := check(result)) is not None:
        if time.monotonic() >= deadline:
            raise error_type(f"rank {builder_rank} built {what}, but rank {rank} ({socket.gethostname()}) does not "
                             f"see it after {within_s:.0f} s: {problem}")
        time.sleep(min(poll_s, 1.0))
    return result
