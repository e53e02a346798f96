"""Fault injection for the tests: kill or fail at a named moment of training or of a save.

    CKPT_FAULT="kill@after_step:8" torchrun ... train_fsdp.py ...       # SIGKILL every rank after step 8
    CKPT_FAULT="oserror@write:6" ...                                    # ENOSPC while writing step 6's shards

Format `<action>@<point>[:<step>][,rank=<r>][,secs=<s>]`, several joined by `;`. Actions: `kill` (SIGKILL
this process, no cleanup, like an OOM kill or a lost node), `oserror` (raise OSError(ENOSPC), like a
full disk) and `sleep` (wait `secs`, to widen a window, e.g. let an async save finish). Points:
`after_step` (train loop), `staged` (state copied, upload not started), `write` (inside the storage
writer, on the upload path), `before_commit` (data durable, marker not written), `after_commit`.
Unset in normal runs: `fault_point` is then one environment lookup.
"""

from __future__ import annotations

import errno
import os
import signal
import time


def _parse(spec: str) -> list[dict]:
    faults = []
    for one in filter(None, (x.strip() for x in spec.split(";"))):
        head, _, opts = one.partition(",")
        action, _, where = head.partition("@")
        point, _, step = where.partition(":")
        kv = dict(o.split("=", 1) for o in opts.split(",") if "=" in o)
        faults.append({"action": action, "point": point, "step": int(step) if step else None,
                       "rank": int(kv["rank"]) if "rank" in kv else None, "secs": float(kv.get("secs", 5))})
    return faults


def fault_point(point: str, step: int | None = None) -> None:
    spec = os.environ.get("CKPT_FAULT")
    if not spec:
        return
    for f in _parse(spec):
        if f["point"] != point or f["step"] not in (None, step):
            continue
        if f["rank"] is not None and f["rank"] != int(os.environ.get("RANK", "0")):
            continue
        if f["action"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f["action"] == "oserror":
            raise OSError(errno.ENOSPC, f"No space left on device (injected by CKPT_FAULT at {point}, step {step})")
        elif f["action"] == "sleep":
            time.sleep(f["secs"])
        else:
            raise ValueError(f"CKPT_FAULT: unknown action {f['action']!r}")
