"""bench/ckpt_bench.py's summary of its rounds: per method the first save, then median and min-max over the later
rounds, each write rate against the disk's own in the same round, and the ratios the docs' targets use.

    python bench/ckpt_bench.py --hidden 256 --layers 2 --saves 3 --train-steps 0    # uses this

A round runs every method once and one disk probe: every rank writes its share of the checkpoint's bytes with dd
(conv=fdatasync) at the same time (bench/host_rates.py). A method's write rate in a round is the checkpoint's
bytes over its upload seconds (until every rank's files and .metadata are written: for an async save, from the
call until the upload is done); `write_over_disk` divides it by the probe's rate of the same round, so load that
slows the whole machine for a while moves both.
"""

from __future__ import annotations

import statistics


def disk_rate(probe: dict) -> float:
    """Bytes per second of one disk probe (every rank's dd at once)."""
    return probe["bytes"] / probe["seconds"]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(save: dict, load: dict, every: int) -> dict:
    """Per method: first save, then median and min-max over the later (steady-state) rounds."""
    rows = {}
    for name, saves in save["methods"].items():
        steady = saves[1:] or saves
        row = {"first_blocking_s": saves[0]["blocking_s"], "rounds": len(saves),
               "checkpoint_GB": steady[-1]["bytes"] / 1e9}
        for key in ("blocking_s", "upload_s", "committed_s"):
            row[key] = spread([x[key] for x in steady])
        row["commit_overhead_s"] = spread([x["committed_s"] - x["upload_s"] for x in steady])
        # ours only: deleting the checkpoint keep_last pushed out, after the marker, in the background (all modes)
        row["retention_s"] = spread([x.get("retention_s", 0.0) for x in steady])
        row["write_GBps"] = row["checkpoint_GB"] / row["committed_s"]["median"]
        # against the disk's own rate in the same round: the checkpoint's bytes over the upload's seconds
        row["write_over_disk"] = spread([x["bytes"] / x["upload_s"] / disk_rate(d) for x, d in
                                         zip(steady, save["disk"][1:] or save["disk"])])
        rows[name] = row
    med = {name: {k: rows[name][k]["median"] for k in ("blocking_s", "upload_s", "committed_s", "commit_overhead_s")}
           for name in rows}
    ours = ("dcp_sync", "dcp_async_thread", "dcp_async_process")
    ratios = {
        # worst of our three modes: the commit (manifest from the gathered digests + marker) against the upload
        "commit_overhead_over_upload": max(med[m]["commit_overhead_s"] / med[m]["upload_s"] for m in ours),
        "rank0_torch_save_over_dcp_sync": med["rank0_torch_save"]["blocking_s"] / med["dcp_sync"]["blocking_s"],
        # like for like: a torch.save that also keeps the previous checkpoint until the new one is written
        "rank0_torch_save_keep_old_over_dcp_sync": (med["rank0_torch_save_keep_old"]["blocking_s"]
                                                    / med["dcp_sync"]["blocking_s"]),
        "bare_async_committed_over_plain_dcp": med["dcp_async_bare"]["committed_s"] / med["dcp_plain"]["committed_s"],
        # what keeping the previous checkpoint during a save costs a plain dcp.save, and our sync upload against that
        "plain_keep_old_over_plain": med["dcp_plain_keep_old"]["upload_s"] / med["dcp_plain"]["upload_s"],
        "sync_upload_over_plain_keep_old": med["dcp_sync"]["upload_s"] / med["dcp_plain_keep_old"]["upload_s"],
        "verify_rank0_sha256_over_parallel_w2": save["verify"]["rank0_sha256_s"] / save["verify"]["parallel_xxh3_s"],
    }
    for m in ours:
        ratios[f"commit_overhead_over_upload_{m}"] = med[m]["commit_overhead_s"] / med[m]["upload_s"]
    for mode in ("thread", "process"):  # each async mode against the same controls, never the better of the two
        m = med[f"dcp_async_{mode}"]
        ratios[f"async_committed_over_plain_dcp_{mode}"] = m["committed_s"] / med["dcp_plain"]["committed_s"]
        # against DCP's own async_save (thread mode, our stager, stock writer): what our layer adds
        ratios[f"async_committed_over_bare_async_{mode}"] = m["committed_s"] / med["dcp_async_bare"]["committed_s"]
        ratios[f"async_blocking_over_memcpy_{mode}"] = m["blocking_s"] / save["memcpy_floor_s"]
        ratios[f"async_blocking_over_sync_{mode}"] = m["blocking_s"] / med["dcp_sync"]["blocking_s"]
    for m in ("dcp_plain", *ours):  # the goal: >= 80% of the disk's own rate
        ratios[f"write_over_disk_{m}"] = rows[m]["write_over_disk"]["median"]
    out = {
        "disk_GBps": spread([disk_rate(d) / 1e9 for d in save["disk"][1:] or save["disk"]]),
        "params": save["params"], "world_size": save["world_size"], "rank_state_GB": save["rank_state_bytes"] / 1e9,
        "memcpy_floor_s": save["memcpy_floor_s"], "memcpy_pageable_s": save.get("memcpy_pageable_s"), "methods": rows,
        "checkpoint_files": save["checkpoint_files"],
        "load_s": {"same_world": save["load_same_world_s"], "world_1": load["load_s"]},
        "verify_s": {f"w{save['world_size']}": save["verify"], "w1": load["verify"]},
        "ratios": ratios, "save_every": every,
    }
    if "steps_per_s" in save:
        tp = save["steps_per_s"]
        out["throughput_steps_per_s"] = tp
        ratios["throughput_thread_over_none"] = tp["thread"] / tp["none"]
        ratios["throughput_process_over_none"] = tp["process"] / tp["none"]
    return out
