"""The benchmarks run end to end at a tiny size, report every figure they promise, and say where each figure came
from (bench/provenance.py): commit, date, machine, load before and after, command; a second run is kept beside the first.

    python -m pytest tests/test_bench.py -q
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch

from conftest import ROOT, run_python

sys.path.insert(0, os.path.join(ROOT, "bench"))

PROVENANCE = {"git_commit", "git_dirty", "started_utc", "finished_utc", "load_average_before", "load_average_after",
              "machine", "command"}


def check_provenance(out, name: str, args: list[str], script: str | None = None) -> dict:
    """The latest results file names its run (by `script`, default `name`), and the run is also kept under
    runs/<name>/; returns the result."""
    r = json.loads((out / f"{name}.json").read_text())
    p = r["provenance"]
    assert PROVENANCE <= set(p) and set(p["machine"]) >= {"cpu", "cores", "ram_GiB", "kernel"}
    assert len(p["git_commit"]) == 40 and isinstance(p["git_dirty"], bool) and p["finished_utc"].endswith("Z")
    assert len(p["load_average_before"]) == 3 and len(p["load_average_after"]) == 3 and p["machine"]["cores"] >= 1
    assert p["command"] == " ".join(["python", f"bench/{script or name}.py", *args])
    assert r in [json.loads(f.read_text()) for f in (out / "runs" / name).glob("*.json")]
    return r


def run(name: str, args: list[str], timeout: int) -> None:
    """`python bench/<name>.py *args`, forked from tests/zygote.py (its imports done): the runs it starts are exec'd
    by the bench itself, as a user's would be."""
    proc = run_python([f"bench/{name}.py", *args], timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_second_run_is_kept_beside_the_first(tmp_path):
    args = ["--mib", "1", "--rounds", "1", "--out", str(tmp_path)]
    run("checksum_bench", args, 60)
    first = check_provenance(tmp_path, "checksum_bench", args)
    run("checksum_bench", args, 60)
    second = check_provenance(tmp_path, "checksum_bench", args)
    runs = [json.loads(f.read_text()) for f in (tmp_path / "runs" / "checksum_bench").glob("*.json")]
    assert len(runs) == 2 and first in runs and second in runs and first != second
    assert "| xxh3_128 |" in (tmp_path / "checksum_bench.md").read_text()


def test_loss_memory_tiny(tmp_path):
    args = ["--vocab", "512", "--seq", "32", "--repeats", "1", "--out", str(tmp_path)]
    run("loss_memory", args, 120)
    r = check_provenance(tmp_path, "loss_memory", args)
    assert set(r["methods"]) == {"plain", "chunked"} and r["logits_bytes"] == 32 * 512 * 4
    plain, chunked = r["methods"]["plain"]["loss"], r["methods"]["chunked"]["loss"]
    assert abs(plain - chunked) <= 1e-5 * abs(plain)  # same loss, however the memory is spent
    assert "| chunked |" in (tmp_path / "loss_memory.md").read_text()


def test_handoff_bench_tiny(tmp_path):
    args = ["--tensors", "20", "--mib", "1", "--rounds", "2", "--out", str(tmp_path)]
    run("handoff_bench", args, 120)
    r = check_provenance(tmp_path, "handoff_bench", args)
    assert set(r["handoff_s"]) == {"file_descriptor", "file_system"} and r["tensors"] == 20
    assert all(len(v) == 2 and min(v) > 0 for v in r["raw_s"].values())
    assert "| file_descriptor |" in (tmp_path / "handoff_bench.md").read_text()


def test_ckpt_bench_tiny(tmp_path):
    out = tmp_path / "res"
    args = ["--hidden", "64", "--layers", "1", "--vocab", "256", "--saves", "2", "--train-steps", "4", "--every", "2",
            "--seq-len", "16", "--out", str(out)]
    run("ckpt_bench", args, 300)
    r = check_provenance(out, "ckpt_bench", args)
    assert set(r["methods"]) == {"rank0_torch_save", "rank0_torch_save_keep_old", "dcp_plain", "dcp_plain_keep_old",
                                 "dcp_async_bare", "dcp_sync", "dcp_async_thread", "dcp_async_process"}
    for m in r["methods"].values():
        assert 0 < m["first_blocking_s"] and 0 < m["blocking_s"]["min"] <= m["blocking_s"]["max"]
        assert m["upload_s"]["median"] <= m["committed_s"]["median"] + 1e-9 and m["commit_overhead_s"]["min"] >= 0
        assert m["checkpoint_GB"] > 0 and m["retention_s"]["min"] >= 0
    assert r["memcpy_floor_s"] > 0 and r["load_s"]["world_1"] > 0 and r["load_s"]["same_world"] > 0
    assert set(r["verify_s"]) == {"w1", "w2"} and all(v["parallel_xxh3_s"] > 0 for v in r["verify_s"].values())
    for key in ("commit_overhead_over_upload", "rank0_torch_save_over_dcp_sync",
                "rank0_torch_save_keep_old_over_dcp_sync", "bare_async_committed_over_plain_dcp"):
        assert r["ratios"][key] > 0
    for mode in ("thread", "process"):  # each async mode against the controls, not the better of the two
        m = r["methods"][f"dcp_async_{mode}"]
        assert r["ratios"][f"async_blocking_over_sync_{mode}"] == \
            m["blocking_s"]["median"] / r["methods"]["dcp_sync"]["blocking_s"]["median"]
        assert r["ratios"][f"async_committed_over_plain_dcp_{mode}"] == \
            m["committed_s"]["median"] / r["methods"]["dcp_plain"]["committed_s"]["median"]
        assert r["ratios"][f"async_committed_over_bare_async_{mode}"] > 0
        assert r["ratios"][f"async_blocking_over_memcpy_{mode}"] > 0
    assert set(r["throughput_steps_per_s"]) == {"none", "thread", "process"}
    assert r["disk_GBps"]["min"] > 0  # the disk's own rate, probed in every round beside the methods
    for name in ("dcp_plain", "dcp_sync", "dcp_async_thread", "dcp_async_process"):
        assert r["ratios"][f"write_over_disk_{name}"] == r["methods"][name]["write_over_disk"]["median"] > 0
    assert "| dcp_async_thread |" in (out / "ckpt_bench.md").read_text()

    # the scale table from those rates (plus the committed checksum rates): one measured W, one extrapolated
    shutil.copy(ROOT + "/bench/results/checksum_bench.json", out)
    args = ["--results", str(out), "--out", str(out), "--models", "7B", "--worlds", "2", "4", "--measure-max", "2"]
    run("ckpt_scale", args, 120)
    s = check_provenance(out, "ckpt_scale", args)
    measured, scaled = s["rows"]
    assert (measured["world_size"], scaled["world_size"]) == (2, 4) and measured["checkpoint_GB"] == 84
    assert measured["manifest_costs_scaled_from_W"] is None and scaled["manifest_costs_scaled_from_W"] == 2
    assert measured["manifest_costs"] == "measured" and scaled["manifest_costs"] == "extrapolated: W=2 measured x 2"
    assert s["rates"]["source"]["ckpt_bench"]["git_commit"] == r["provenance"]["git_commit"]
    for x in s["rows"]:
        assert 0 < x["new_commit_s"] and 0 < x["new_verify_s"] < x["old_verify_s"] and x["metadata_MB"] > 0
    assert scaled["per_rank_GB"] == measured["per_rank_GB"] / 2 and scaled["old_commit_s"] == measured["old_commit_s"]
    md = (out / "ckpt_scale.md").read_text()
    assert "| 7B | 84 GB | 4 |" in md and md.count("(extrapolated: W=2 x 2)") == 3


def test_memory_bench_tiny(tmp_path):
    """Two local nodes: memory against disk saves, throughput, restarts; every figure it promises is there."""
    out = tmp_path / "res"
    args = ["--hidden", "64", "--layers", "1", "--vocab", "256", "--seq-len", "16", "--rounds", "2", "--steps", "2",
            "--out", str(out)]
    run("memory_bench", args, 300)
    r = check_provenance(out, "memory_bench", args)
    assert (r["nodes"], r["world_size"], r["replicas"]) == (2, 2, 1)
    for tier in ("memory", "disk"):
        save, restart = r["saves"][tier], r["restart"][tier]
        assert 0 < save["blocking_s"]["min"] <= save["blocking_s"]["max"] <= save["committed_s"]["max"]
        assert 0 < restart["resume_s"]["max"] <= restart["resume_and_first_step_s"]["max"]
        assert restart["resume_and_first_step_s"]["median"] < restart["restart_to_first_step_s"]["median"]
    tp = r["throughput_steps_per_s"]
    assert r["ratios"]["throughput_memory_every_step_over_none"] == tp["memory"]["median"] / tp["none"]["median"]
    assert all(r["ratios"][k] > 0 for k in ("restart_disk_over_memory", "resume_and_first_step_disk_over_memory",
                                            "resume_disk_over_memory"))
    cpu = r["cpu_s_per_step"]
    assert 0 < cpu["none"]["min"] and 0 < cpu["memory"]["min"]
    assert r["memory_save_cpu_s"] == cpu["memory"]["median"] - cpu["none"]["median"]
    fl = r["floors"]
    pieces = ("write", "wire", "copy", "read", "hash")
    assert all(0 < fl[f"{p}{k}"]["min"] <= fl[f"{p}{k}"]["max"] for p in pieces for k in ("_s", "_cpu_s"))
    assert r["floor_cpu_s"] == 2 * fl["write_cpu_s"]["median"] + fl["wire_cpu_s"]["median"]
    assert r["design_floor_cpu_s"] == pytest.approx(r["floor_cpu_s"] + fl["copy_cpu_s"]["median"]
                                                    + fl["read_cpu_s"]["median"] + 2 * fl["hash_cpu_s"]["median"])
    assert r["ratios"]["floor_cpu_over_budget"] == r["floor_cpu_s"] / r["budget_cpu_s"] and r["budget_cpu_s"] > 0
    assert r["ratios"]["restart_disk_over_instant_memory"] > r["ratios"]["restart_disk_over_memory"]
    assert "| memory tier (committed: replicated and marked on every node) |" in (out / "memory_bench.md").read_text()


def test_realsize_bench_tiny(tmp_path):
    """The real-size benchmark end to end at a toy size: phases with each rank's peak, the plan's components
    against them, the loads at both world sizes, blocking against the memcpy floor, writes against the disk."""
    out = tmp_path / "res"
    args = ["--layers", "1", "--vocab", "512", "--steps", "3", "--seq-len", "16", "--upload-nice", "10", "--out",
            str(out)]
    run("realsize_bench", args, 900)
    r = check_provenance(out, "realsize_bench", args)
    phases = {p["phase"]: p for p in r["phases"]}
    assert {"build", "step 1 (the first)", "save 2: staging (blocking)", "save 2: upload until committed",
            "final save (sync)", "export"} <= set(phases)
    assert all(p["rank0_peak_GiB"] > 0 and p["rank1_peak_GiB"] > 0 for p in phases.values())
    for world, load in r["loads"].items():
        assert "load (in build)" in {p["phase"] for p in load["phases"]} and load["peak_rss_GiB"], world
    assert set(r["loads"]) == {"W=2", "W=1"} and set(r["loads"]["W=1"]["peak_rss_GiB"]) == {"0"}
    total = r["plan_check"][-1]
    assert total["component"].startswith("total") and total["planned_GiB"] > 0
    assert total["measured_GiB"] == r["peak_rss_GiB"] and len(r["plan_check"]) == 4
    saves = r["upload_nice"]["10"]
    assert saves["first_blocking_s"] > 0 and saves["sync_write_over_disk"] > 0 and saves["checkpoint_GB"] > 0
    assert r["blocking"]["steady_over_floor"] == saves["steady_blocking_s"] / r["host"]["memcpy_floor_s"]
    assert r["machine_min_available_GiB"] > 0 and "| plan component |" in (out / "realsize_bench.md").read_text()

    # the presets' times from those rates: a results file naming its source, every row marked extrapolated
    args = ["--results", str(out), "--out", str(out)]
    run("realsize_extrapolate", args, 120)
    x = check_provenance(out, "realsize_extrapolate", args)
    assert x["source"]["git_commit"] == r["provenance"]["git_commit"] and len(x["rows"]) == 3
    assert all(row["how"] == "extrapolated" and row["async_blocking_s"] > 0 for row in x["rows"])
    assert x["rows"][2]["rank_GB"] == pytest.approx(x["rows"][1]["rank_GB"] / 8, rel=1e-3)  # 70B: 512 vs 64 GPUs
    md = (out / "realsize_extrapolate.md").read_text()
    assert md.startswith("Extrapolated from ") and md.count("(extrapolated)") == 9


# ---------------------------------------------------------------- the one-GPU check (bench/gpu_check.sh, gpu_bench.py)

no_cuda_here = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")


@no_cuda_here
def test_gpu_check_without_cuda_says_so_in_one_line_and_writes_nothing(tmp_path):
    results = [ROOT + "/bench/results/" + f for f in ("gpu_bench.json", "gpu_tier.log")]
    before = [os.path.exists(f) and os.path.getmtime(f) for f in results]
    proc = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode != 0 and proc.stdout == "", proc.stdout[-2000:]
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("error: no CUDA device"), \
        proc.stderr[-2000:]
    assert [os.path.exists(f) and os.path.getmtime(f) for f in results] == before and not os.listdir(tmp_path)


FAKE_GPU_PYTHON = """#!/bin/bash
# python3 as bench/gpu_check.sh calls it, on a machine that has CUDA: each step writes what the real one writes
case "$*" in
  *--collect-only*) echo "tests/test_gpu.py::test_one" ;;
  *--junitxml*) while [ $# -gt 0 ]; do [ "$1" = --junitxml ] && echo "<testsuite/>" > "$2"; shift; done ;;
  *gpu_bench.py*) mkdir -p bench/results/runs/gpu_bench/run1/deep && echo "{}" > bench/results/gpu_bench.json &&
                  echo "# bench" > bench/results/gpu_bench.md && echo "{}" > bench/results/runs/gpu_bench/run1/deep/m.jsonl ;;
  -) cat > /dev/null; echo "premise" ;;
esac
exit 0
"""


def test_gpu_check_leaves_one_flat_folder_of_at_most_8_files_in_out(tmp_path):
    """Issue 58 point 10: the lent GPU machine returns at most 8 files from $OUT, at most 2 folders down; the run
    folder went 4 folders down and never came back. A copy of the script in a stand-in repository, its python a
    stand-in that writes what each step writes."""
    repo, out = tmp_path / "repo", tmp_path / "out"
    (repo / "bench").mkdir(parents=True)
    out.mkdir()
    shutil.copy(os.path.join(ROOT, "bench", "gpu_check.sh"), repo / "bench")
    fake = tmp_path / "python"
    fake.write_text(FAKE_GPU_PYTHON)
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(repo / "bench" / "gpu_check.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT": str(out), "PYTHON": str(fake), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = sorted(os.listdir(out))
    assert names == ["gpu_bench.json", "gpu_bench.md", "gpu_bench_runs.tar.gz", "gpu_premise.txt", "gpu_tier.collected",
                     "gpu_tier.log", "gpu_tier.xml"], names
    assert all((out / n).is_file() for n in names) and len(names) <= 8
    with tarfile.open(out / "gpu_bench_runs.tar.gz") as tar:
        assert "gpu_bench/run1/deep/m.jsonl" in tar.getnames()


@no_cuda_here
def test_gpu_bench_without_cuda_is_one_error_line():
    proc = subprocess.run([sys.executable, "bench/gpu_bench.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith("error: no CUDA device")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr[-2000:]


def test_model_flops_and_mfu_of_the_qwen05b_shape():
    """6 x the matmul parameters: every nn.Linear of the real Qwen2.5-0.5B module (lm_head, tied, counted once as
    the matmul it is), plus the causal attention term; MFU against the GPU's peak, looked up by its name."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    from gpu_bench import PEAK_BF16_TFLOPS, mfu, model_flops_per_token, peak_tflops
    from qwen_shape import SHAPES
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES["0.5b"]))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    f = model_flops_per_token(SHAPES["0.5b"], 2048)
    assert f["matmul_params"] == linear == 493_961_216
    assert f["attention"] == 6 * 24 * 2048 * 896 and f["total"] == 6 * linear + 6 * 24 * 2048 * 896
    assert mfu(f["total"], 100_000, 989.4) == pytest.approx(f["total"] * 1e5 / 989.4e12)
    assert mfu(f["total"], 100_000, None) is None
    names = ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA H100 NVL",
             "Tesla T4")
    assert [peak_tflops(n, None) for n in names] == [989.4, 756.0, 989.4, 835.0, 835.0, None]
    assert peak_tflops("Tesla T4", 65.0) == 65.0 and PEAK_BF16_TFLOPS["NVIDIA H100 80GB HBM3"] == 989.4


def test_memory_is_held_against_the_plan_like_with_like():
    """The allocator's peaks hold no CUDA context: against the plan without its assumed 3 GiB; the device's used
    memory (which does) against the whole plan."""
    from gpu_bench import GIB, plan_ratios
    plan = {"total": 13 * GIB, "without_cuda_context": 10 * GIB}
    got = plan_ratios({"max_memory_reserved": 10 * GIB, "max_memory_allocated": 8 * GIB, "device_used": 13 * GIB},
                      plan)
    assert got == {"reserved_over_plan": 1.0, "allocated_over_plan_without_context": 0.8,
                   "device_used_over_plan": 1.0}


def test_gpu_bench_cpu_smoke_runs_every_part_and_never_writes_gpu_results(tmp_path):
    args = ["--device", "cpu", "--tiny", "--out", str(tmp_path)]
    run("gpu_bench", args, 300)
    r = check_provenance(tmp_path, "gpu_bench_cpu_smoke", args, script="gpu_bench")
    eager = r["shapes"]["tiny"]["eager"]
    assert eager["tokens_per_s"] > 0 and eager["mfu"] is None and eager["plan_bytes"]["total"] > 0
    assert r["async_save"]["blocking_s"] > 0 and r["async_save"]["disk_GBps"] > 0
    assert set(r["memory_tier"]["tokens_per_s"]) == {"none", "memory"} and eager["profile"]["top"]
    assert r["gpu"]["name"] == "cpu (smoke run)" and not (tmp_path / "gpu_bench.json").exists()
    refused = subprocess.run([sys.executable, "bench/gpu_bench.py", "--device", "cpu"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "give --out" in refused.stderr


def test_gpu_bench_records_the_test_tier_even_when_it_was_cut_short(tmp_path):
    """bench/gpu_check.sh gives the tier a time limit: killed, pytest writes no junit XML, so the outcomes of the
    tests that ended come from its -v log, and the results say it ran out of time."""
    from gpu_bench import tier_outcome
    log = tmp_path / "tier.log"
    log.write_text("tests/test_gpu.py::test_a[1gpu] PASSED    [ 10%]\n"
                   "tests/test_gpu.py::test_b[1gpu] FAILED    [ 20%]\n"
                   "tests/test_gpu.py::test_c SKIPPED (no flash_attn)    [ 30%]\n")
    collected = tmp_path / "collected.txt"
    collected.write_text("tests/test_gpu.py::test_a[1gpu]\ntests/test_gpu.py::test_b[1gpu]\ntests/test_gpu.py::test_c\n"
                         "tests/test_gpu.py::test_d[1gpu]\n\n4 tests collected in 3.1s\n")
    t = tier_outcome(str(tmp_path / "absent.xml"), str(log), 124, str(collected))
    assert t["timed_out"] and (t["tests"], t["failures"], t["skipped"]) == (3, 1, 1)
    assert t["failed"] == ["tests/test_gpu.py::test_b[1gpu]"] and "log" in t["source"]
    assert t["not_run"] == ["tests/test_gpu.py::test_d[1gpu]"], "the results say which tests did not run"


def test_goodput_bench_smoke_accounts_each_configuration_under_one_schedule(tmp_path):
    """bench/goodput_bench.py --smoke: the three configurations ran under the same one-SIGKILL schedule, each
    with a goodput account from its own metrics.jsonl; the memory tier's runs saved every step."""
    args = ["--smoke", "--out", str(tmp_path)]
    run("goodput_bench", args, 600)
    r = check_provenance(tmp_path, "goodput_bench_smoke", args, script="goodput_bench")
    assert set(r["configs"]) == {"disk", "auto", "memory"} and r["schedule"][0]["signal"] == "SIGKILL"
    for name, c in r["configs"].items():
        (one,) = c["runs"]
        assert one["exit_code"] == 0 and one["last_step"] == 75, (name, one)
        assert 0 < one["goodput"] < 1 and one["lost_s"]["startup"] > 0, (name, one)
        assert one["attempts"] <= 1 + sum(s["signal"] == "SIGKILL" for s in one["signals"]), (name, one)
    # the SIGKILL comes 1.5 s after the first step record (the clock starts there): it lands in training
    assert any(c["runs"][0]["attempts"] == 2 and c["runs"][0]["lost_s"]["downtime"] > 0 for c in r["configs"].values())
    assert r["configs"]["memory"]["runs"][0]["lost_s"]["ckpt"] > r["configs"]["disk"]["runs"][0]["lost_s"]["ckpt"]
    assert (tmp_path / "goodput_bench_smoke.md").read_text().count("| memory |") == 1


def test_suite_bench_times_each_test_groups_them_and_measures_coverage_in_subprocesses(tmp_path):
    """bench/test_suite.py on two tests: their records, their group, their CPU-seconds, coverage of the four
    packages (one test runs `python -m ckpt` in a subprocess: its lines count), a skip counted from its setup
    report; the run summarized again with an earlier run's coverage beside its own (--before); a pytest it did
    not start recorded through its plugin (--ci)."""
    from test_suite import tests_of

    picked = ["tests/test_cli_errors.py::test_verify_of_a_folder_that_is_no_checkpoint_says_so",
              "tests/test_ckpt_policy.py::test_young_daly_and_parse"]
    # -n 1: pytest-xdist as the suite runs it (a worker reporting to the controller), one worker for two tests
    # instead of pytest.ini's three, each importing torch under coverage
    args = ["--out", str(tmp_path), "--work", str(tmp_path / "work"), "-n", "1", *picked]
    run("test_suite", args, 600)
    r = check_provenance(tmp_path, "test_suite", args)
    assert r["tests"] == 2 and r["outcomes"] == {"passed": 2, "skipped": 0, "failed": 0} and r["wall_s"] > 0
    assert {t["test"].split("::")[0] for t in r["top30"]} == {"tests/test_cli_errors.py", "tests/test_ckpt_policy.py"}
    assert sum(g["tests"] for g in r["groups"].values()) == 2
    assert r["coverage"]["modules_percent"]["ckpt/__main__.py"] > 0  # run only as `python -m ckpt`, a subprocess
    assert 0 < r["coverage"]["all"]["covered"] < r["coverage"]["all"]["lines"]
    cpu = {t["test"].split("::")[0]: t["cpu_s"] for t in r["top30_cpu"]}
    assert cpu["tests/test_cli_errors.py"] > 1  # an exec'd `python -m ckpt` (imports torch), counted when reaped
    assert r["test_cpu_s"] <= r["machine_cpu_s"]
    again = ["--out", str(tmp_path / "again"), "--from", str(tmp_path / "work"), "--before",
             str(tmp_path / "test_suite.json")]  # the same run summarized again, beside itself as "before"
    run("test_suite", again, 600)
    r2 = json.loads((tmp_path / "again" / "test_suite.json").read_text())
    assert r2["coverage_before"]["coverage"]["all"] == r["coverage"]["all"] == r2["coverage"]["all"]
    assert r2["coverage_before"]["provenance"]["command"] == r["provenance"]["command"]
    assert "| line coverage | before: covered / lines |" in (tmp_path / "again" / "test_suite.md").read_text()
    # --ci's recording: this module as a plugin of a pytest it did not start (.ci/run's), one record per phase
    record = tmp_path / "ci" / "tests.jsonl"
    record.parent.mkdir()
    env = {**os.environ, "PYTEST_ADDOPTS": "-p test_suite", "TEST_SUITE_RECORD": str(record),
           "PYTHONPATH": os.path.join(ROOT, "bench")}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", picked[1]], cwd=ROOT,
                   env=env, check=True, capture_output=True)
    assert [json.loads(line)["when"] for line in record.read_text().splitlines()] == ["setup", "call", "teardown"]
    (tmp_path / "skip").mkdir()
    (tmp_path / "skip" / "tests.jsonl").write_text("".join(json.dumps(
        {"nodeid": "tests/test_x.py::t", "when": when, "outcome": outcome, "duration": 0.5}) + "\n"
        for when, outcome in (("setup", "skipped"), ("teardown", "passed"))))
    assert tests_of(str(tmp_path / "skip")) == {"tests/test_x.py::t":
                                                {"seconds": 1.0, "cpu_s": 0.0, "outcome": "skipped"}}


def test_scale_sim_reports_a_missing_section_as_missing(tmp_path):
    """A section script the checkout lacks gives no rows and says so in the results and the rendered table."""
    import scale_sim
    got = scale_sim.run_section("scale_not_a_section", [64], str(tmp_path))
    assert got == {"status": "missing", "detail": "bench/scale_not_a_section.py is not in this checkout", "rows": []}
    result = {"worlds": [64], "sections": {"scale_not_a_section": got}, "provenance": {
        "git_commit": "0" * 40, "git_dirty": False, "finished_utc": "2026-12-02T00:00:00Z", "command": "python x",
        "load_average_before": [0, 0, 0], "load_average_after": [0, 0, 0],
        "machine": {"cpu": "c", "cores": 2, "ram_GiB": 1, "kernel": "k"}}}
    text = scale_sim.render(result)
    assert "- scale_not_a_section: missing (bench/scale_not_a_section.py is not in this checkout)" in text
    assert "| per step | FSDP's own collectives" in text  # the unsimulated paths are listed by formula


def test_scale_sim_carries_a_section_not_run_with_the_commit_it_ran_at(tmp_path):
    """--keep: a section not run this time comes from the earlier results file, and the docs say where it ran."""
    import json

    import scale_sim
    at = {"git_commit": "a" * 40, "git_dirty": False, "started_utc": "2026-12-02T01:30:31Z",
          "load_average_before": [3.5, 0, 0]}
    earlier = {"sections": {"scale_coord": {"status": "ok", "rows": [], "seconds": 9.0}}, "provenance": at}
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    kept = scale_sim.carried_over(str(tmp_path / "earlier.json"), ["scale_coord", "scale_gloo"])
    assert kept == {"scale_coord": {"status": "ok", "rows": [], "seconds": 9.0, "ran_at": at}}
    assert scale_sim._ran_at(kept["scale_coord"]) == \
        "; carried over from the run at aaaaaaa, 2026-12-02T01:30:31Z, load 3.5 before"


def test_scale_coord_smoke_runs_every_store_path_without_a_failure(tmp_path):
    """scale_coord calls the project's coordination code by name: a renamed function (common/handoff.py's waiter was)
    made every handoff row 'FAILED' in the full simulation, which no test ran. A smoke at W=8 catches it. Its
    simulated failure writes a traceback file under the run dir: a temporary one, not '/nonexistent' (which, made as
    root, broke test_shared_paths' check of a path no rank sees)."""
    out = tmp_path / "c.json"
    run_python([os.path.join(ROOT, "bench", "scale_coord.py"), "--worlds", "8", "--plan-worlds", "2,4",
                "--layer-worlds", "8", "--handoff-s", "2", "--out", str(out)], timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert {r["path"].split(":")[0] for r in rows} >= {"data-cache handoff", "job failure key"}
    assert not [r["path"] for r in rows if "FAILED" in r["note"]]
    assert not os.path.exists("/nonexistent")
