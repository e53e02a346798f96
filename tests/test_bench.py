"""The checkpoint benchmark and the scale table run end to end at a tiny size and report every figure they promise.

    python -m pytest tests/test_bench.py -q
"""

import json
import shutil
import subprocess
import sys

from conftest import ROOT


def test_ckpt_bench_tiny(tmp_path):
    out = tmp_path / "res"
    proc = subprocess.run([sys.executable, "bench/ckpt_bench.py", "--hidden", "64", "--layers", "1", "--vocab", "256",
                           "--saves", "2", "--train-steps", "4", "--every", "2", "--seq-len", "16", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "ckpt_bench.json").read_text())
    assert set(r["methods"]) == {"rank0_torch_save", "rank0_torch_save_keep_old", "dcp_plain", "dcp_plain_keep_old",
                                 "dcp_async_bare", "dcp_sync", "dcp_async_thread", "dcp_async_process"}
    for m in r["methods"].values():
        assert 0 < m["first_blocking_s"] and 0 < m["blocking_s"]["min"] <= m["blocking_s"]["max"]
        assert m["upload_s"]["median"] <= m["committed_s"]["median"] + 1e-9 and m["commit_overhead_s"]["min"] >= 0
        assert m["checkpoint_GB"] > 0 and m["retention_s"]["min"] >= 0
    assert r["memcpy_floor_s"] > 0 and r["load_s"]["world_1"] > 0 and r["load_s"]["same_world"] > 0
    assert set(r["verify_s"]) == {"w1", "w2"} and all(v["parallel_xxh3_s"] > 0 for v in r["verify_s"].values())
    for key in ("commit_overhead_over_upload", "rank0_torch_save_over_dcp_sync", "async_committed_over_plain_dcp",
                "rank0_torch_save_keep_old_over_dcp_sync", "async_committed_over_bare_async",
                "bare_async_committed_over_plain_dcp"):
        assert r["ratios"][key] > 0
    assert set(r["throughput_steps_per_s"]) == {"none", "thread", "process"}
    assert "| dcp_async_thread |" in (out / "ckpt_bench.md").read_text()

    # the scale table from those rates (plus the committed checksum rates): one measured W, one scaled by W
    shutil.copy(ROOT + "/bench/results/checksum_bench.json", out)
    proc = subprocess.run([sys.executable, "bench/ckpt_scale.py", "--results", str(out), "--out", str(out),
                           "--models", "7B", "--worlds", "2", "4", "--measure-max", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((out / "ckpt_scale.json").read_text())
    measured, scaled = s["rows"]
    assert (measured["world_size"], scaled["world_size"]) == (2, 4) and measured["checkpoint_GB"] == 84
    assert measured["manifest_costs_scaled_from_W"] is None and scaled["manifest_costs_scaled_from_W"] == 2
    for x in s["rows"]:
        assert 0 < x["new_commit_s"] and 0 < x["new_verify_s"] < x["old_verify_s"] and x["metadata_MB"] > 0
    assert scaled["per_rank_GB"] == measured["per_rank_GB"] / 2 and scaled["old_commit_s"] == measured["old_commit_s"]
    assert "| 7B | 84 GB | 4 |" in (out / "ckpt_scale.md").read_text()
