"""Fault injection for the tests: kill or fail at a named moment of training or of a save.

    CKPT_FAULT="kill@after_step:8" torchrun ... train_fsdp.py ...       # SIGKILL every rank after step 8
    CKPT_FAULT="oserror@write:6" ...                                    # ENOSPC while writing step 6's shards

Format `<action>@<point>[:<step>][,rank=<r>]`; actions: `kill` (SIGKILL this process, no cleanup, like
an OOM kill or a lost node) and `oserror` (raise OSError(ENOSPC), like a full disk). Points:
`after_step` (train loop), `staged` (state copied, upload not started), `write` (inside the storage
writer, on the upload path), `before_commit` (data durable, marker not written), `after_commit`.
Unset in normal runs: `fault_point` is then one dict lookup.
"""

from __future__ import annotations

import errno
import os
import signal


def _parse(spec: str) -> dict | None:
    if not spec:
        return None
    head, _, opts = spec.partition(",")
    action, _, where = head.partition("@")
    point, _, step = where.partition(":")
    rank = dict(kv.split("=", 1) for kv in opts.split(",") if "=" in kv).get("rank")
    return {"action": action, "point": point, "step": int(step) if step else None,
            "rank": int(rank) if rank is not None else None}


def fault_point(point: str, step: int | None = None) -> None:
    spec = _parse(os.environ.get("CKPT_FAULT", ""))
    if spec is None or spec["point"] != point:
        return
    if spec["step"] is not None and spec["step"] != step:
        return
    if spec["rank"] is not None and spec["rank"] != int(os.environ.get("RANK", "0")):
        return
    if spec["action"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif spec["action"] == "oserror":
        raise OSError(errno.ENOSPC, f"No space left on device (injected by CKPT_FAULT at {point}, step {step})")
    else:
        raise ValueError(f"CKPT_FAULT: unknown action {spec['action']!r}")
