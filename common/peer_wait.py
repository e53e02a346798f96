"""Waiting for another rank's file, bounded and aware of a dead peer; and work done once per node (local rank 0),
which the node's other ranks wait for. No process group needed: it runs before one exists.

    python -m pytest tests/test_hub.py -q -k once_per_node

`once_per_node(work, what, error_type, timeout_s)`: local rank 0 writes its pid, runs `work()` and then a result
file (work's string, or its error's message); every other rank of the node waits for that file (wait_for_file: one stat per
poll), and stops at once, naming `what`, when local rank 0's process is gone or `timeout_s` has passed. The files
live in the node's temp folder, named by the launch (torchrun agent's pid, restart, rendezvous port), so a later
launch never reads them; local rank 0 removes a day's stale ones.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import tempfile
import time
from typing import Callable

from common.procfs import running

PID_WAIT_S = 120.0  # local rank 0 writes its pid within a second of starting; torchrun starts the node's ranks at once


class PeerWaitError(Exception):
    """A wait on another rank ended without its file: the message names what was waited for and why it ended."""


def wait_for_file(path: str, what: str, timeout_s: float, peer_gone: Callable[[], str | None] = lambda: None,
                  poll_s: float = 0.2) -> None:
    """Return once `path` exists. Raise PeerWaitError naming `what` after `timeout_s`, or as soon as `peer_gone()`
    returns why the rank that would write it cannot any more."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        gone = peer_gone()
        if gone:
            raise PeerWaitError(f"stopped waiting for {what}: {gone}")
        if time.monotonic() > deadline:
            raise PeerWaitError(f"waited {timeout_s:.0f} s for {what} ({path} never appeared)")
        time.sleep(poll_s)


def _process_gone(pid: int) -> str | None:
    """Why local rank 0 (`pid`, on this node) is gone, or None while it runs (a zombie has ended)."""
    return None if running(pid) else f"local rank 0 (pid {pid}) has ended"


def _launch_files(what: str) -> str:
    """The path prefix of this launch's files for `what` on this node."""
    launch = "-".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT"))
    digest = hashlib.sha256(f"{os.getppid()}|{launch}|{what}".encode()).hexdigest()[:16]
    folder = os.path.join(tempfile.gettempdir(), f"fsdp-finetune-{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"once-{digest}")


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def once_per_node(work: Callable[[], str], what: str, error_type: type[Exception], timeout_s: float) -> str:
    """Run `work()` on local rank 0 of each node and return its string on every rank of the node; the others
    raise `error_type` with its error's message (every rank ends with the same line), or PeerWaitError's as
    `error_type` when it died or `timeout_s` passed (float("inf"): as long as it lives)."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) == 1:
        return work()
    prefix = _launch_files(what)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        for stale in glob.glob(os.path.join(os.path.dirname(prefix), "once-*")):
            if time.time() - os.path.getmtime(stale) > 86400:
                os.remove(stale)
        _write(prefix + ".pid", str(os.getpid()))
        try:
            result = work()
        except Exception as e:
            _write(prefix + ".done", json.dumps({"error": str(e) if isinstance(e, error_type) else
                                                 f"{type(e).__name__}: {e}"}))
            raise
        _write(prefix + ".done", json.dumps({"ok": result}))
        return result
    try:
        wait_for_file(prefix + ".pid", f"local rank 0 to start {what}", PID_WAIT_S)
        with open(prefix + ".pid") as f:
            pid = int(f.read())
        wait_for_file(prefix + ".done", what, timeout_s, lambda: _process_gone(pid))
    except PeerWaitError as e:
        raise error_type(str(e)) from None
    with open(prefix + ".done") as f:
        outcome = json.load(f)
    if "error" in outcome:
        raise error_type(outcome["error"])
    return outcome["ok"]
