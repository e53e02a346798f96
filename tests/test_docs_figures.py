"""Every benchmark figure the docs quote is the value in a committed results file, formatted as quoted.

    python -m pytest tests/test_docs_figures.py -q

FIGURES is the table: (doc, phrase with a `{}` where each figure stands, and per figure the results file
under bench/results/, the path into its JSON and the format). The test formats the JSON's values and looks
for the phrase in the doc, so a rerun of a benchmark that changes a figure fails here until the doc says
the new figure (or the row goes). TABLES: results tables a doc quotes whole. A doc
figure that no results file holds has no row and does not belong in the docs (issue 30).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import scale_sim  # noqa: E402 - bench/scale_sim.py renders docs/scale.md's table

RESULTS = os.path.join(ROOT, "bench", "results")


CKL = "ckpt_bench_large/ckpt_bench.json"
CKL_BEFORE = "ckpt_bench_large/runs/ckpt_bench/2026-11-25T231911Z-fb82b9288.json"
CK, CK_BEFORE = "ckpt_bench.json", "runs/ckpt_bench/2026-11-24T234537Z-ca4f07c-before-provenance.json"
SCALE_BEFORE = "runs/ckpt_scale/2026-11-24T234537Z-ca4f07c-before-provenance.json"
SUM_BEFORE = "runs/checksum_bench/2026-11-24T230419Z-f3c8b99-before-provenance.json"
LORA_BEFORE = "runs/lora_bench/2026-11-22T094701Z-a3ffeaa-before-provenance.json"
LOSS_FP32 = "runs/loss_memory/2026-11-25T083001Z-a2fee93f3.json"
EXPORT_FP32 = "runs/export_rss/2026-11-25T083411Z-496f60d3e.json"
PERF, INTEGRITY, LORA, GPU = "docs/performance.md", "docs/checkpoint-integrity.md", "docs/lora.md", "docs/gpu.md"
CHECKPOINTS, PLANNER, DATA = "docs/checkpoints.md", "docs/planner.md", "docs/data.md"
DATA_20K = "runs/data_bench/2026-11-25T083322Z-a2fee93f3.json"
RS, RS8, RST = "realsize_bench.json", "realsize_bench-8blocks.json", "realsize_bench-thread.json"
MEM, MEMORY = "memory_bench.json", "docs/memory-tier.md"
BEFORE_SPARE = "runs/memory_bench/2026-11-25T234616Z-f9daa0bdf.json"  # memory_bench before steps reused the spare's pages
GOODPUT, GOODPUT_ARITH = "goodput_bench.json", "goodput_arithmetic.json"
GOODPUT_BEFORE = "runs/goodput_bench/2026-11-26T205412Z-1cd4c7ab6.json"  # the preset's batch, no watchdog
MB = 1048576
SM = "scale_metadata.json"
OUTCOMES = ("passed", "skipped", "failed")


def med(method: str, key: str) -> str:
    return f"methods.{method}.{key}.median"


def each(results: str, fmt: str, *paths: str) -> list:
    return [(results, p, fmt) for p in paths]


# (doc, phrase with a {} per figure, [(results file under bench/results/, JSON path, format), ...]).
# A path is a dotted key path, or `a / b` or `a - b` of two such paths or numbers.
FIGURES = [
    # reliability.md: the hang watchdog's store traffic at W=2048 (bench/scale_watchdog.py --worlds 2048)
    *[("docs/reliability.md", phrase, [("scale_watchdog-2048.json", path, fmt) for path, fmt in sources])
      for phrase, sources in (
          ("({} a second in all at W=2048)", [("rows.0.requests_total", ",.0f")]),
          ("Measured at W=2048: {} records read per check ({}W)",
           [("rows.1.records_read_total", ",.0f"), ("rows.1.records_read_per_W", ".1f")]),
          ("no verdict; {} at a SIGTERM to every rank", [("rows.2.records_read_total", ",.0f")]),
          ("had exited 76 {} s after the timeout", [("rows.3.seconds", ".1f")]))],
    # reliability.md: rank 0's beat during the DCP coordinator's work at 70B (bench/scale_beat.py)
    ("docs/reliability.md", "took {} CPU-seconds at W=64 and {} at W=256, growing with the objects (T x W), so about "
     "8 x {} = ~{} CPU-seconds at W=2048; on this loaded 2-core machine rank 0's beats were up to {} s apart",
     [("scale_beat.json", "rows.6.probe_gap_cpu_s", ".2f"), *each("scale_beat.json", ".1f", "rows.14.probe_gap_cpu_s",
                                                                   "rows.14.probe_gap_cpu_s"),
      ("scale_beat.json", "rows.14.probe_gap_cpu_s / 0.125", ".0f"), ("scale_beat.json", "rows.14.beat_gap_s", ".1f")]),
    ("docs/reliability.md", "a full one after it takes {} s at W=256; the longest GIL hold left is in the save's "
     "finish (`.metadata` and its index): {} CPU-seconds at W=64 and {} at W=256. That one grows with W too: about "
     "8 x {} = ~{} CPU-seconds at W=2048",
     [("scale_beat-paused.json", "rows.18.gc2_longest_s", ".3f"), ("scale_beat-paused.json", "rows.5.probe_gap_cpu_s",
                                                                    ".2f"),
      *each("scale_beat-paused.json", ".2f", "rows.15.probe_gap_cpu_s", "rows.15.probe_gap_cpu_s"),
      ("scale_beat-paused.json", "rows.15.probe_gap_cpu_s / 0.125", ".1f")]),
    # testing.md: line coverage before issue 48's changes and now, one results file (bench/test_suite.py --before)
    *[("docs/testing.md", f"| {p} | {{}} / {{}} | {{}} | {{}} / {{}} | {{}} |",
       [("test_suite.json", f"{side}coverage.{p}.{k}", fmt) for side in ("coverage_before.", "")
        for k, fmt in (("covered", "d"), ("lines", "d"), ("percent", ".1f"))])
      for p in ("ckpt", "finetune", "common", "all")],  # train_fsdp.py: a dotted key the paths cannot name
    # testing.md: `.ci/run` timed (--ci), beside the two-worker run of the suite alone
    *[("docs/testing.md", f"{run} | {{}} min | {{}} / {{}} / {{}} | {{}} | {{}} min |",
       [*each(results, ".1f", "wall_s / 60"), *each(results, "d", *(f"outcomes.{k}" for k in OUTCOMES)),
        *each(results, ".1f", "machine_cpu_s / 60", "machine_cpu_s / 120")])
      for run, results in (("three workers, 98d89e0", "test_suite_ci.json"),
                           ("two workers, 863c875 (above)", "test_suite_plain.json"))],
    ("docs/testing.md", "the README test's CPU-seconds were {} and {} in them",
     [("test_suite_plain.json", "top30_cpu.0.cpu_s", ".0f"), ("test_suite_ci.json", "top30_cpu.0.cpu_s", ".0f")]),
    ("docs/testing.md", "with two workers the machine kept {} of its 2 cores busy on average, with three {}.",
     [("test_suite_plain.json", "machine_cpu_s / wall_s", ".2f"), ("test_suite_ci.json", "machine_cpu_s / wall_s",
                                                                   ".2f")]),
    # performance.md: today's run, the run before, the verdicts and the default's reasons
    (PERF, "the 1-min load average was {} before and {} after",
     each(CK, ".2f", "provenance.load_average_before.0", "provenance.load_average_after.0")),
    *[(PERF, f"`{m}`) | {{}} | {{}} | {{}} |",
       each(CK, ".2f", f"methods.{m}.first_blocking_s", med(m, "blocking_s"), med(m, "committed_s")))
      for m in ("rank0_torch_save", "dcp_sync", "dcp_async_thread", "dcp_async_process")],
    (PERF, "memcpy floor of the rank's state bytes | | {} |", each(CK, ".2f", "memcpy_floor_s")),
    (PERF, "load: {} s at the same world size, {} s at 1 rank", each(CK, ".2f", "load_s.same_world", "load_s.world_1")),
    (PERF, "(worst of our modes) | {} | {} | met in both", [(CK, "ratios.commit_overhead_over_upload", ".1%"),
                                                             (CK_BEFORE, "ratios.commit_overhead_over_upload", ".1%")]),
    (PERF, "| thread {}, process {} | thread {}, process {} | missed in both, by both modes",
     [*each(CK, ".1%", "ratios.async_blocking_over_sync_thread", "ratios.async_blocking_over_sync_process"),
      *each(CK_BEFORE, ".1%", f"{med('dcp_async_thread', 'blocking_s')} / {med('dcp_sync', 'blocking_s')}",
            f"{med('dcp_async_process', 'blocking_s')} / {med('dcp_sync', 'blocking_s')}")]),
    (PERF, "| thread {}x, process {}x | thread {}x, process {}x | met today by both; missed before",
     [*each(CK, ".2f", "ratios.async_blocking_over_memcpy_thread", "ratios.async_blocking_over_memcpy_process"),
      *each(CK_BEFORE, ".2f", f"{med('dcp_async_thread', 'blocking_s')} / memcpy_floor_s",
            f"{med('dcp_async_process', 'blocking_s')} / memcpy_floor_s")]),
    (PERF, "| thread {}x, process {}x | thread {}x, process {}x | met today by both; missed before",
     [*each(CK, ".2f", "ratios.async_committed_over_plain_dcp_thread", "ratios.async_committed_over_plain_dcp_process"),
      *each(CK_BEFORE, ".2f", f"{med('dcp_async_thread', 'committed_s')} / {med('dcp_plain', 'committed_s')}",
            f"{med('dcp_async_process', 'committed_s')} / {med('dcp_plain', 'committed_s')}")]),
    (PERF, "at 2 ranks | {}x | {}x | met today; missed before", [(CK, "ratios.rank0_torch_save_over_dcp_sync", ".2f"),
                                                        (CK_BEFORE, "ratios.rank0_torch_save_over_dcp_sync", ".2f")]),
    (PERF, "({} s vs {} s today, {} s vs {} s before) and its first save",
     [*each(CK, ".2f", med("dcp_async_thread", "committed_s"), med("dcp_async_process", "committed_s")),
      *each(CK_BEFORE, ".2f", med("dcp_async_thread", "committed_s"), med("dcp_async_process", "committed_s"))]),
    (PERF, "({} s vs {} s today, {} s vs {} s before: process mode starts",
     [*each(CK, ".2f", "methods.dcp_async_thread.first_blocking_s", "methods.dcp_async_process.first_blocking_s"),
      *each(CK_BEFORE, ".2f", "methods.dcp_async_thread.first_blocking_s", "methods.dcp_async_process.first_blocking_s")]),
    (PERF, "({} s vs {} s today, {} s vs {} s before). At the real size the order turns",
     [*each(CK, ".2f", med("dcp_async_thread", "blocking_s"), med("dcp_async_process", "blocking_s")),
      *each(CK_BEFORE, ".2f", med("dcp_async_thread", "blocking_s"), med("dcp_async_process", "blocking_s"))]),
    (PERF, "our sync save went from {} s to {} s", [(CK_BEFORE, med("dcp_sync", "blocking_s"), ".2f"),
                                                    (CK, med("dcp_sync", "blocking_s"), ".2f")]),
    (PERF, "commit sooner than a stock `dcp.save` ({}x, thread mode)",
     [(CK, "ratios.async_committed_over_plain_dcp_thread", ".2f")]),
    (PERF, "a steady async save blocks {} s, {}x the bare copy", [(CK, med("dcp_async_thread", "blocking_s"), ".2f"),
                                                                  (CK, "ratios.async_blocking_over_memcpy_thread", ".2f")]),
    (PERF, "now takes only {} s, so the blocking is {} of it", [(CK, med("dcp_sync", "blocking_s"), ".2f"),
                                                                (CK, "ratios.async_blocking_over_sync_thread", ".0%")]),
    (PERF, "(`write / disk's`, {}-{}x)", [(CK, "ratios.write_over_disk_dcp_plain", ".1f"),
                                         (CK, "ratios.write_over_disk_dcp_sync", ".1f")]),
    # performance.md: the real-size run against issue 29's goals
    (PERF, "each rank's peak VmRSS | {}x / {}x of the plan (rank 0 / 1) | met",
     each(RS, ".2f", "plan_check.3.measured_over_planned.0", "plan_check.3.measured_over_planned.1")),
    (PERF, "first save blocks at most 1.5x a steady one | {}x | met", [(RS, "blocking.first_over_steady", ".2f")]),
    (PERF, "steady blocking at most 1.5x the memcpy floor | {}x | met", [(RS, "blocking.steady_over_floor", ".2f")]),
    (PERF, "| {}x at `ckpt.upload_nice=19`, {}x at 0 | met at both",
     each(RS, ".2f", "upload_nice.19.overlap.ratio", "upload_nice.0.overlap.ratio")),
    (PERF, "final sync save {}x; async uploads {}x (nice 19), {}x (nice 0)",
     each(RS, ".2f", "upload_nice.19.sync_write_over_disk", "upload_nice.19.async_write_over_disk",
          "upload_nice.0.async_write_over_disk")),
    (PERF, "reaches {} of dd in the final sync save", [(RS, "upload_nice.19.sync_write_over_disk", ".0%")]),
    (PERF, "at 0 the upload took {} s to commit against {} s at 19, and the overlapping steps were {}x against {}x",
     each(RS, ".2f", "upload_nice.0.committed_s_median", "upload_nice.19.committed_s_median",
          "upload_nice.0.overlap.ratio", "upload_nice.19.overlap.ratio")),
    *[(PERF, phrase, [(RS, f"plan_check.{i}.measured_over_planned.{r}", ".2f") for r in (0, 1)])
      for i, phrase in ((0, "parameter shards came in at {}x / {}x of the plan"), (1, "the staging buffers at {}x / {}x"),
                        (2, "logits) at {}x / {}x: that last one"))],
    (PERF, "The machine's smallest MemAvailable was {} GiB", [(RS, "machine_min_available_GiB", ".2f")]),
    (PERF, "the uploader process peaked at {} GiB", [(RS, "uploader_peak_rss_GiB", ".2f")]),
    # the memory tier's benchmark
    *[(PERF, phrase, [(MEM, path, fmt)]) for phrase, path, fmt in (
        ("a memory save every step {} of none", "ratios.throughput_memory_every_step_over_none", ".1%"),
        ("disk / memory {}x (goal >= 5x", "ratios.restart_disk_over_memory", ".2f"),
        ("the resume alone {}x", "ratios.resume_disk_over_memory", ".2f"),
        ("blocks {}x an async disk save", "ratios.memory_blocking_over_disk_blocking", ".2f"),
        ("replicated and marked in {}x the disk save's time to commit", "ratios.memory_replicated_over_disk_committed", ".2f"))],
    (MEMORY, "| {} | missed |", [(MEM, "ratios.throughput_memory_every_step_over_none", ".1%")]),
    (MEMORY, "| {}x (resume alone {}x) | missed |", each(MEM, ".2f", "ratios.restart_disk_over_memory",
                                                       "ratios.resume_disk_over_memory")),
    (MEMORY, "| {}x | (no goal) |", [(MEM, "ratios.memory_blocking_over_disk_blocking", ".2f")]),
    (MEMORY, "replicated and marked against the disk save until committed | {}x |", [(MEM, "ratios.memory_replicated_over_disk_committed", ".2f")]),
    (MEMORY, "the memory tier resumed in {} s against the disk tier's {} s",
     each(MEM, ".2f", "restart.memory.resume_s.median", "restart.disk.resume_s.median")),
    (MEMORY, "a memory save writes a rank's {} GB", [(MEM, "rank_state_GB", ".2f")]),
    (MEMORY, "Rank 0's process used {} s of CPU per step without checkpoints and {} s with a memory save every step: {} s of CPU per save",
     each(MEM, ".2f", "cpu_s_per_step.none.median", "cpu_s_per_step.memory.median", "memory_save_cpu_s")),
    (PERF, "a memory save takes {} s of CPU per rank", [(MEM, "memory_save_cpu_s", ".2f")]),
    (PERF, "the least this design can take, its pieces measured bare, is {} s, {}x what 97% leaves",
     [(MEM, "design_floor_cpu_s", ".2f"), (MEM, "ratios.design_floor_cpu_over_budget", ".2f")]),
    (PERF, "a resume that took no time would give {}x", [(MEM, "ratios.restart_disk_over_instant_memory", ".2f")]),
    (MEMORY, "Writing the state into the memory folder took {} s of CPU, sending it to the peer while the "
             "peer's arrived {} s; with the second write (what arrives) {} s of CPU per save at the least. A save may "
             "take {} s per step",
     each(MEM, ".2f", "floors.write_cpu_s.median", "floors.wire_cpu_s.median", "floor_cpu_s", "budget_cpu_s")),
    (MEMORY, "plus the {} s per step the training process leaves its",
     [(MEM, "1 / throughput_steps_per_s.none.median - cpu_s_per_step.none.median", ".2f")]),
    (MEMORY, "The bare floor alone is {}x of that", [(MEM, "ratios.floor_cpu_over_budget", ".2f")]),
    (MEMORY, "the snapshot copy of the state ({} s; on a GPU a device-to-host DMA, not host CPU), reading each file "
             "back to send it ({} s) and a checksum at each end ({} s each): {} s of CPU per save at the least, {}x",
     [(MEM, "floors.copy_cpu_s.median", ".2f"), (MEM, "floors.read_cpu_s.median", ".2f"),
      (MEM, "floors.hash_cpu_s.median", ".2f"), (MEM, "design_floor_cpu_s", ".2f"),
      (MEM, "ratios.design_floor_cpu_over_budget", ".2f")]),
    (MEMORY, "the save as built takes {}x that floor", [(MEM, "memory_save_cpu_s / design_floor_cpu_s", ".1f")]),
    (MEMORY, "would give {}x (`ratios.restart_disk_over_instant_memory`)", [(MEM, "ratios.restart_disk_over_instant_memory", ".2f")]),
    (MEMORY, "the run before (`bench/results/runs/memory_bench/2026-11-25T234616Z-f9daa0bdf.json`, {}, a memory save committed in {} s)",
     [(BEFORE_SPARE, "ratios.throughput_memory_every_step_over_none", ".1%"), (BEFORE_SPARE, "saves.memory.committed_s.median", ".2f")]),
    (PERF, "{} before the next step wrote over", [(BEFORE_SPARE, "ratios.throughput_memory_every_step_over_none", ".1%")]),
    (MEMORY, "pages (step 6 of the protocol above): {}, and committed in {} s, {}x an async disk save's",
     [(MEM, "ratios.throughput_memory_every_step_over_none", ".1%"), (MEM, "saves.memory.committed_s.median", ".2f"),
      (MEM, "ratios.memory_replicated_over_disk_committed", ".2f")]),
    (MEMORY, "a step went from {} s without checkpoints to {} s with a memory save every step",
     each(MEM, ".2f", "1 / throughput_steps_per_s.none.median", "1 / throughput_steps_per_s.memory.median")),
    (MEMORY, "but the first step after it ({} s)",
     [(MEM, "restart.memory.resume_and_first_step_s.median - restart.memory.resume_s.median", ".2f")]),
    (MEMORY, "instead of the config's 19 and measured {} and {}x",
     [("runs/memory_bench/2026-11-25T225315Z-dc4c8062a.json", "ratios.throughput_memory_every_step_over_none", ".1%"),
      ("runs/memory_bench/2026-11-25T225315Z-dc4c8062a.json", "ratios.restart_disk_over_memory", ".2f")]),
    (MEMORY, "against the {} of the run after it", [(BEFORE_SPARE, "ratios.throughput_memory_every_step_over_none", ".1%")]),
    (MEMORY, "the process start and build ({} s, `startup_s`)", [(MEM, "startup_s", ".1f")]),
    (PERF, "A save to the local S3 server took {}x the local folder's time and a resume {}x; to Azurite {}x and {}x",
     [*each("s3_bench.json", ".2f", "s3_over_local.committed_s", "s3_over_local.resume_s"),
      *each("az_bench.json", ".2f", "az_over_local.committed_s", "az_over_local.resume_s")]),
    (PERF, "compiled blocks give {}x eager's tokens/s, after {} s of compiling that {} steps",
     [("compile_bench.json", "ratios.compiled_over_eager_tokens_per_s", ".2f"), ("compile_bench.json", "compile_s", ".1f"),
      ("compile_bench.json", "breakeven_steps", ".0f")]),
    (PLANNER, "planned {} GiB per rank, measured peak VmRSS {} / {} GiB ({}x / {}x)",
     [(RS, "plan_check.3.planned_GiB", ".2f"), *each(RS, ".2f", "plan_check.3.measured_GiB.0", "plan_check.3.measured_GiB.1"),
      *each(RS, ".2f", "plan_check.3.measured_over_planned.0", "plan_check.3.measured_over_planned.1")]),
    (PLANNER, "(255M) planned {} GiB, measured {} / {} GiB ({}x / {}x)",
     [(RS8, "plan_check.3.planned_GiB", ".2f"), *each(RS8, ".2f", "plan_check.3.measured_GiB.0", "plan_check.3.measured_GiB.1"),
      *each(RS8, ".2f", "plan_check.3.measured_over_planned.0", "plan_check.3.measured_over_planned.1")]),
    (PERF, "the same goals read: plan total {}x / {}x, first save {}x a steady one, steady blocking {}x the memcpy floor, "
           "overlapping steps {}x a quiet one at `ckpt.upload_nice=19` and {}x at 0, with commits in {} s against {} s",
     [*each(RS8, ".2f", "plan_check.3.measured_over_planned.0", "plan_check.3.measured_over_planned.1",
            "blocking.first_over_steady", "blocking.steady_over_floor", "upload_nice.19.overlap.ratio",
            "upload_nice.0.overlap.ratio", "upload_nice.19.committed_s_median", "upload_nice.0.committed_s_median")]),
    (PERF, "committed in {} s against process mode's {} s and blocked {} s per steady save against {} s; the "
           "overlapping steps ({}x vs {}x a quiet one) and the peak VmRSS ({} / {} vs {} / {} GiB)",
     [*each(RST, ".2f", "upload_nice.19.committed_s_median"), *each(RS, ".2f", "upload_nice.19.committed_s_median"),
      *each(RST, ".2f", "upload_nice.19.steady_blocking_s"), *each(RS, ".2f", "upload_nice.19.steady_blocking_s"),
      *each(RST, ".2f", "upload_nice.19.overlap.ratio"), *each(RS, ".2f", "upload_nice.19.overlap.ratio"),
      *each(RST, ".2f", "peak_rss_GiB.0", "peak_rss_GiB.1"), *each(RS, ".2f", "peak_rss_GiB.0", "peak_rss_GiB.1")]),
    (PERF, "Writes with nothing training beside them, at {} GB per rank", [(CKL, "rank_state_GB", ".2f")]),
    (PERF, "our sync save {}x, thread mode {}x, process mode {}x, stock `dcp.save` {}x",
     each(CKL, ".2f", *(f"ratios.write_over_disk_{m}" for m in ("dcp_sync", "dcp_async_thread", "dcp_async_process",
                                                              "dcp_plain")))),
    (PERF, "thread mode committed sooner than process mode ({} s vs {} s)",
     each(CKL, ".2f", med("dcp_async_thread", "committed_s"), med("dcp_async_process", "committed_s"))),
    (PERF, "with nothing training beside them (1.73 GB per rank, below): sync {}x, thread {}x, process {}x",
     each(CKL, ".2f", *(f"ratios.write_over_disk_{m}" for m in ("dcp_sync", "dcp_async_thread", "dcp_async_process")))),
    (PERF, "measured that hand-off at {} s per save for {} DTensors against {} s when shared by file name",
     [("handoff_bench.json", "handoff_s.file_descriptor.median_s", ".3f"), ("handoff_bench.json", "tensors", "d"),
      ("handoff_bench.json", "handoff_s.file_system.median_s", ".3f")]),
    (PERF, "measured process mode at {}x dd and thread mode at {}x",
     each(CKL_BEFORE, ".2f", "ratios.write_over_disk_dcp_async_process", "ratios.write_over_disk_dcp_async_thread")),
    # checkpoint-integrity.md: checksums, the targets per mode, the controls, the scale table's run before
    *[(INTEGRITY, f"| {algo} | {{}} ({{}}-{{}}) | {{}} ({{}}-{{}}) |",
       each(SUM_BEFORE, ".2f", *(f"rates.{algo}/{where}.{k}_GBps" for where in ("memory", "file")
                                 for k in ("median", "min", "max"))))
      for algo in ("sha256", "xxh3_128", "crc32c", "blake3")],
    (INTEGRITY, "{}x SHA-256 in memory and {}x from a file on the idle machine ({}x and {}x today",
     [(SUM_BEFORE, "rates.xxh3_128/memory.median_GBps / rates.sha256/memory.median_GBps", ".0f"),
      (SUM_BEFORE, "rates.xxh3_128/file.median_GBps / rates.sha256/file.median_GBps", ".1f"),
      ("checksum_bench.json", "rates.xxh3_128/memory.median_GBps / rates.sha256/memory.median_GBps", ".0f"),
      ("checksum_bench.json", "rates.xxh3_128/file.median_GBps / rates.sha256/file.median_GBps", ".1f")]),
    (INTEGRITY, "| {} | {} | {} / {} | met |",
     [*each(CK, ".1%", "ratios.commit_overhead_over_upload_dcp_async_thread",
            "ratios.commit_overhead_over_upload_dcp_async_process"),
      *each(CK_BEFORE, ".1%", "ratios.commit_overhead_over_upload_dcp_async_thread",
            "ratios.commit_overhead_over_upload_dcp_async_process")]),
    (INTEGRITY, "| {}x | {}x | {}x / {}x | met today by both; missed before",
     [*each(CK, ".2f", "ratios.async_committed_over_plain_dcp_thread", "ratios.async_committed_over_plain_dcp_process"),
      *each(CK_BEFORE, ".2f", f"{med('dcp_async_thread', 'committed_s')} / {med('dcp_plain', 'committed_s')}",
            f"{med('dcp_async_process', 'committed_s')} / {med('dcp_plain', 'committed_s')}")]),
    (INTEGRITY, "(`ratios.rank0_torch_save_over_dcp_sync`) | {}x | | {}x | met today; missed before",
     [(CK, "ratios.rank0_torch_save_over_dcp_sync", ".2f"), (CK_BEFORE, "ratios.rank0_torch_save_over_dcp_sync", ".2f")]),
    (INTEGRITY, "blocking medians: {} / {} s today, {} / {} s before)",
     [*each(CK, ".2f", med("rank0_torch_save", "blocking_s"), med("dcp_plain", "blocking_s")),
      *each(CK_BEFORE, ".2f", med("rank0_torch_save", "blocking_s"), med("dcp_plain", "blocking_s"))]),
    (INTEGRITY, "deleting the previous 1.1 GB checkpoint took {} / {} / {} s",
     each(CK, ".2f", *(med(m, "retention_s") for m in ("dcp_sync", "dcp_async_thread", "dcp_async_process")))),
    (INTEGRITY, "near the 3x target on this machine ({}x today)",
     [(CK, f"{med('rank0_torch_save', 'blocking_s')} / {med('dcp_plain', 'blocking_s')}", ".1f")]),
    (INTEGRITY, "today our sync save ({} s) took less than the plain one ({} s) in the same rounds, after {} vs {} s",
     [*each(CK, ".2f", med("dcp_sync", "blocking_s"), med("dcp_plain", "blocking_s")),
      *each(CK_BEFORE, ".2f", med("dcp_sync", "blocking_s"), med("dcp_plain", "blocking_s"))]),
    (INTEGRITY, "committed in {}x of a plain save today and {}x before; ours, thread mode, in {}x and {}x",
     [(CK, "ratios.bare_async_committed_over_plain_dcp", ".2f"), (CK_BEFORE, "ratios.bare_async_committed_over_plain_dcp", ".2f"),
      (CK, "ratios.async_committed_over_bare_async_thread", ".2f"), (CK_BEFORE, "ratios.async_committed_over_bare_async", ".2f")]),
    (INTEGRITY, "`ratios.plain_keep_old_over_plain` is {}x today and was {}x before",
     [(CK, "ratios.plain_keep_old_over_plain", ".2f"), (CK_BEFORE, "ratios.plain_keep_old_over_plain", ".2f")]),
    (INTEGRITY, "W=2 parallel XXH3 {} s vs rank 0 SHA-256 of everything {} s today ({}x; {}x in the idle run",
     [*each(CK, ".2f", "verify_s.w2.parallel_xxh3_s", "verify_s.w2.rank0_sha256_s"),
      (CK, "ratios.verify_rank0_sha256_over_parallel_w2", ".1f"), (CK_BEFORE, "ratios.verify_rank0_sha256_over_parallel_w2", ".1f")]),
    (INTEGRITY, "verify {} min for 70B, new resume verify {} s at W=8 and {} s at W=64 ({} s at W=512",
     [(SCALE_BEFORE, "rows.3.old_verify_s / 60", ".1f"), *each(SCALE_BEFORE, ".1f", "rows.3.new_verify_s",
                                                              "rows.4.new_verify_s", "rows.5.new_verify_s")]),
    (INTEGRITY, "{} s for 7B and {} s for 70B at W=512 today; {} s and {} s in the run before",
     [*each("ckpt_scale.json", ".0f", "rows.2.check_manifest_s", "rows.5.check_manifest_s"),
      (SCALE_BEFORE, "rows.2.check_manifest_s", ".1f"), (SCALE_BEFORE, "rows.5.check_manifest_s", ".0f")]),
    # lora.md
    *[(LORA, f"| {kind} | {mode} | {{}} MiB | {{}} s ({{}}-{{}}) |",
       [("lora_bench.json", f"cases.{case}.bytes / {MB}", ".2f"),
        *each("lora_bench.json", ".3f", *(f"cases.{case}.blocking_{k}_s" for k in ("median", "min", "max")))])
      for kind, mode, case in (("full", "sync (`off`)", "full/off"), ("LoRA", "sync (`off`)", "lora/off"),
                               ("full", "async `thread`", "full/thread"), ("LoRA", "async `thread`", "lora/thread"))],
    (LORA, "The LoRA checkpoint is {}x smaller here, below the ratio of trained parameters ({}x;",
     [("lora_bench.json", "ratios.bytes_full_over_lora", ".1f"),
      ("lora_bench.json", "model.params / model.lora_trainable_params", ".1f")]),
    (LORA, "the adapters are {} of the weights", [("lora_bench.json", "model.lora_trainable_params / model.params", ".1%")]),
    (LORA, "A synchronous save blocks {}x less", [("lora_bench.json", "ratios.sync_blocking_full_over_lora", ".1f")]),
    (LORA, "so there the gain is small ({}x)", [("lora_bench.json", "ratios.async_blocking_full_over_lora", ".2f")]),
    (LORA, "load average {} before, {} after, on 2 cores",
     each("lora_bench.json", ".2f", "provenance.load_average_before.0", "provenance.load_average_after.0")),
    (LORA, "The previous record, {}x for a sync save", [(LORA_BEFORE, "ratios.sync_blocking_full_over_lora", ".1f")]),
    # gpu.md: the loss's memory, fp32 and bf16 runs
    *[(GPU, f"| {dtype} | {{}} MiB | {{}} MiB, {{}} copies | {{}} MiB, {{}} copies |",
       [(results, f"logits_bytes / {MB}", ".0f"), (results, "methods.plain.peak_median_MiB", ".0f"),
        (results, "methods.plain.logits_copies", ".2f"), (results, "methods.chunked.peak_median_MiB", ".0f"),
        (results, "methods.chunked.logits_copies", ".2f")])
      for dtype, results in (("fp32", LOSS_FP32), ("bf16", "loss_memory.json"))],
    (PLANNER, "`bench/loss_memory.py` measured {} copies above the logits in bf16",
     [("loss_memory.json", "methods.chunked.logits_copies", ".1f")]),
    # data.md: the tenth-size run (its table is checked through these ratios; the 200k run's in TABLES)
    *[(DATA, f"{kind}: new / old = {{}}x rows/s", [(DATA_20K, f"new_over_old_rows_per_s.{kind}", ".2f")])
      for kind in ("chat", "text")],
    (DATA, "met at the issue's 200k conversations, {}x", [("data_bench.json", "new_over_old_rows_per_s.chat", ".2f")]),
    (DATA, "At 20k conversations, {}x", [(DATA_20K, "new_over_old_rows_per_s.chat", ".2f")]),
    (DATA, "idle machine; {}x in the loaded run before",
     [("runs/data_bench/2026-11-25T084333Z-87d6218b1.json", "new_over_old_rows_per_s.chat", ".2f")]),
    (DATA, "Text, for reference, at 100k lines: {}x", [(DATA_20K, "new_over_old_rows_per_s.text", ".2f")]),
    # the Hugging Face export's peak memory, fp32 and bf16 runs
    (CHECKPOINTS, "peak RSS above the baseline: {} MiB for fp32 and {} MiB for bf16, against {} / {} MiB for loading",
     [(EXPORT_FP32, "modes.stream.peak_above_baseline_MiB", ".0f"),
      ("export_rss.json", "modes.stream.peak_above_baseline_MiB", ".0f"),
      (EXPORT_FP32, "modes.naive.peak_above_baseline_MiB", ".0f"),
      ("export_rss.json", "modes.naive.peak_above_baseline_MiB", ".0f")]),
    (PERF, "the streaming export peaked {} MiB above its baseline ({} of the model), against {} MiB ({}) for",
     [(EXPORT_FP32, "modes.stream.peak_above_baseline_MiB", ".0f"), (EXPORT_FP32, "modes.stream.peak_above_baseline_over_model", ".0%"),
      (EXPORT_FP32, "modes.naive.peak_above_baseline_MiB", ".0f"), (EXPORT_FP32, "modes.naive.peak_above_baseline_over_model", ".0%")]),
    # goodput under one failure schedule: disk, auto interval, memory tier
    (PERF, "The 1-min load average was {} before and {} after. The goals: the memory tier loses {}x less work",
     [*each(GOODPUT, ".2f", "provenance.load_average_before.0", "provenance.load_average_after.0"),
      (GOODPUT, "ratios.rollback_disk_over_memory", ".1f")]),
    (PERF, "and keeps {} goodput (goal >= 90%: missed)", [(GOODPUT, "configs.memory.goodput_median", ".1%")]),
    (PERF, "in the memory configuration's medians over {} s of wall time", each(GOODPUT, ".1f",
                                                                                "configs.memory.wall_s_median")),
    *[(PERF, f"{what}: {{}} s.", each(GOODPUT, ".1f", f"configs.memory.lost_s_median.{cause}"))
      for what, cause in (("of each attempt", "startup"), ("a memory save every step", "ckpt"),
                          ("the watchdog's wait", "hang"), ("torchrun's restart", "downtime"), ("rollback", "rollback"))],
    (PERF, "({} s of rollback)", each(GOODPUT, ".1f", "configs.disk.rollback_s_median")),
    (PERF, "little to rollbacks ({} s)", each(GOODPUT, ".1f", "configs.auto.lost_s_median.rollback")),
    # the run before: the preset's batch, the stopped rank SIGKILLed by the script
    (PERF, "kept {} goodput with the memory tier", [(GOODPUT_BEFORE, "configs.memory.goodput_median", ".1%")]),
    (PERF, "blocked the loop ({} s of {} s)", each(GOODPUT_BEFORE, ".1f", "configs.memory.lost_s_median.ckpt",
                                                   "configs.memory.wall_s_median")),
    # goodput at 8B/64 and 70B/512, arithmetic on results files
    (PERF, "Here the step is {} s, R {} s and D {} s", each(GOODPUT_ARITH, ".0f", "assumptions.step_s",
                                                            "assumptions.restart_s", "assumptions.detection_s")),
    (PERF, "a job MTBF of {} h to {} h", each(GOODPUT_ARITH, ".1f", "rows.3.mtbf_h", "rows.0.mtbf_h")),
    (PERF, "At {} to {} GB per rank", each(GOODPUT_ARITH, ".2f", "rows.0.rank_GB", "rows.2.rank_GB")),
    # checkpoint-integrity.md: DCP metadata at 70B on 2,048 ranks (rows 49-55: 70B, W=2048; bench/scale_metadata.py)
    (INTEGRITY, "the global `.metadata` is {} MB", [(SM, "rows.49.bytes_total / 1000000", ".0f")]),
    (INTEGRITY, "receives {} bytes instead of it", [(SM, "rows.51.bytes_per_rank", "d")]),
    (INTEGRITY, "the busiest rank reads {} MB of the index, {} of the global file",
     [(SM, "rows.54.bytes_per_rank / 1000000", ".2f"), (SM, "rows.54.bytes_per_rank / rows.49.bytes_total", ".2%")]),
    (INTEGRITY, "({} MB resuming at W=1536, {})",
     [(SM, "rows.55.bytes_per_rank / 1000000", ".2f"), (SM, "rows.55.bytes_per_rank / rows.49.bytes_total", ".2%")]),
]

# results tables quoted whole: every table row of the .md a run wrote is in the doc
TABLES = [(INTEGRITY, "ckpt_bench.md"), (INTEGRITY, "ckpt_scale.md"), (INTEGRITY, "checksum_bench.md"),
          (DATA, "data_bench.md"), (PERF, "realsize_bench.md"),
          (PERF, "realsize_extrapolate.md"), (MEMORY, "memory_bench.md"), (PERF, "s3_bench.md"), (PERF, "az_bench.md"),
          (PERF, "compile_bench.md"), (PERF, "goodput_bench.md"),
          (PERF, "goodput_arithmetic.md"), ("docs/testing.md", "test_suite_quick.md"),
          ("docs/testing.md", "test_suite_plain.md"), ("docs/testing.md", "test_suite_quick_plain.md"),
          ("docs/multinode.md", "shared_paths_bench.md")]


def value_at(results: dict, path: str) -> float:
    if " - " in path:
        a, b = path.split(" - ")
        return value_at(results, a) - value_at(results, b)
    if " / " in path:
        a, b = path.split(" / ")
        return value_at(results, a) / value_at(results, b)
    try:
        return float(path)
    except ValueError:
        pass
    for key in path.split("."):
        results = results[int(key)] if isinstance(results, list) else results[key]
    return results


def load(results: str) -> dict:
    with open(os.path.join(RESULTS, results)) as f:
        return json.load(f)


def quoted(row) -> str:
    _, phrase, sources = row
    return phrase.format(*(format(value_at(load(results), path), fmt) for results, path, fmt in sources))


def doc_text(doc: str) -> str:
    with open(os.path.join(ROOT, doc)) as f:
        return " ".join(f.read().split())  # a phrase may wrap over lines


@pytest.mark.parametrize("row", FIGURES, ids=[f"{r[0]}:{r[1][:40]}" for r in FIGURES])
def test_doc_quotes_the_results_file(row):
    assert quoted(row) in doc_text(row[0]), f"{row[0]} should say {quoted(row)!r} ({row[2]})"


@pytest.mark.parametrize("doc,md", TABLES)
def test_doc_quotes_the_results_table(doc, md):
    with open(os.path.join(RESULTS, md)) as f:
        rows = [line for line in f.read().splitlines() if line.startswith("| ") and not line.startswith("|---")]
    text = doc_text(doc)
    assert rows and [r for r in rows if " ".join(r.split()) not in text] == []


def test_scale_table_is_the_results_file():
    """docs/scale.md's table is what `bench/scale_sim.py --from bench/results/scale_sim.json --write-docs` renders
    from the committed results file, whose run names a clean commit and its command."""
    result = load("scale_sim.json")
    with open(os.path.join(ROOT, "docs", "scale.md")) as f:
        assert scale_sim.render(result) in f.read()
    p = result["provenance"]
    assert len(p["git_commit"]) == 40 and p["command"].startswith("python bench/scale_sim.py") and not p["git_dirty"]


def test_every_quoted_run_names_its_commit_and_command():
    """Runs made since provenance was recorded: clean commit, command; older ones are named before-provenance."""
    for results in sorted({src[0] for row in FIGURES for src in row[2]}):
        if results.endswith("-before-provenance.json"):
            continue
        p = load(results)["provenance"]
        assert len(p["git_commit"]) == 40 and p["command"].startswith("python bench/") and not p["git_dirty"], results


def test_a_wrong_figure_is_caught():
    """The check can fail: the same row with another value is not in the doc."""
    doc, phrase, sources = FIGURES[1]
    wrong = phrase.format(*(format(value_at(load(r), p) + 1, fmt) for r, p, fmt in sources))
    assert wrong not in doc_text(doc)
