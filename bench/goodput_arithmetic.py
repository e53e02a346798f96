"""Goodput at 8B on 64 GPUs and 70B on 512 GPUs, as arithmetic on results files and stated public figures (issue
40 point 4): disk saves at the preset's interval, at the Young-Daly interval, the memory tier every step, and the
memory tier every Young-Daly interval of its own save cost (whole steps: ckpt.memory_interval, set by hand).

    python bench/goodput_arithmetic.py              # writes bench/results/goodput_arithmetic.{json,md}
    python bench/goodput_arithmetic.py --step-s 5 --restart-s 10 --out /tmp/ga     # other assumptions

Nothing here ran at these sizes. Per configuration, with M the job's mean time between failures (first order:
at most one failure per interval):

    goodput = 1 - b / t - (t / 2 + c + D + R + L) / M

t: seconds between saves; b: what one save blocks training; t / 2 + c: the work a failure loses (half an
interval on average, plus the save in flight, committed c seconds after it began); D: detection (the hang
watchdog's auto timeout, charged to every failure: a crash is seen at once, so this is an upper bound); R: the
restart (the scheduler, the processes, the process group); L: the resume's load. Where each figure comes from:
- bytes per rank and node: finetune/plan.py from each preset's config.json (exact), via bench/realsize_extrapolate.py;
- disk: b = rank bytes / staging rate, c = node bytes / write rate, L = node bytes / load rate, the per-byte rates of
  bench/results/realsize_extrapolate.json (measured at 494M parameters on this machine; a node writes at that rate
  whatever the number of nodes: the shared file system is taken to scale);
- memory tier: b, c (replicated to a peer and marked) and L (resume) per rank byte from
  bench/results/memory_bench.json; every failure is taken to be recoverable from memory (the ring's replica of
  a lost node); its copies run on host cores the GPU step does not need (on this CPU-only machine they do not:
  memory_bench's throughput with a save every step is the share they took), and disk saves run beside it at
  the preset's interval;
- Young-Daly: ckpt/policy.py young_daly_s(b, M), at least c (a save waits for the one in flight);
- failures per GPU-hour: Llama 3 (419 unexpected interruptions in 54 days on 16,384 GPUs, arXiv 2407.21783) and
  Meta RSC (job MTTF 7.9 h at 1,024 GPUs, arXiv 2410.21680), scaled linearly with GPUs;
- R: 130 s (JobSet's job restart at 5,000 nodes before its in-place restart, 2 min 10 s, as DaoCloud's JobSet
  in-place restart write-up reports it), --restart-s;
- the step time: 10 s (an assumption, --step-s; docs/reliability.md's arithmetic takes the same).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from ckpt.policy import young_daly_s  # noqa: E402 - after the path insert
from finetune.config import load_config  # noqa: E402
from finetune.hang import AUTO_AFTER, HangWatchdog  # noqa: E402
import provenance  # noqa: E402 - bench/provenance.py, beside this script
from realsize_extrapolate import row  # noqa: E402 - beside this script

# (preset, nodes, ranks per node)
SIZES = [("configs/llama3-8b-sft.yaml", 8, 8), ("configs/llama3-70b-multinode.yaml", 64, 8)]
# failures per GPU-hour, public figures
RATES = {"Llama 3": 419 / (54 * 24 * 16384), "Meta RSC": 1 / (7.9 * 1024)}
COLUMNS = ["model", "GPUs", "failures as", "job MTBF (h)", "config", "interval (s)", "blocking",
           "rollback per failure (s)", "goodput"]


def read(results: str, name: str) -> dict:
    with open(os.path.join(results, name)) as f:
        return json.load(f)


def detection_s(step_s: float) -> float:
    """The hang watchdog's auto timeout at this step time (finetune/hang.py's rule)."""
    dog = HangWatchdog(None, 0, 1, "", None, None)
    dog.step_times.extend([step_s] * AUTO_AFTER)
    return dog.timeout()


def memory_rates(mem: dict) -> dict:
    """Seconds per GB of a rank's state: a memory save's blocking and commit, a memory resume."""
    gb, saves = mem["rank_state_GB"], mem["saves"]["memory"]
    return {"blocking_s_per_GB": saves["blocking_s"]["median"] / gb,
            "committed_s_per_GB": saves["committed_s"]["median"] / gb,
            "resume_s_per_GB": mem["restart"]["memory"]["resume_s"]["median"] / gb}


def goodput(t: float, b: float, c: float, lost_per_failure_fixed: float, mtbf_s: float) -> dict:
    rollback = t / 2 + c
    lost = b / t + (rollback + lost_per_failure_fixed) / mtbf_s
    return {"interval_s": t, "blocking_share": b / t, "rollback_s": rollback, "goodput": 1 - lost}


def configs(size: dict, preset_interval_s: float, mem: dict, step_s: float, mtbf_s: float, fixed: float) -> dict:
    """The three configurations' goodput at one size and failure rate; `fixed`: D + R per failure."""
    b, c, load = size["async_blocking_s"], size["sync_save_s"], size["load_s"]
    mem_b, mem_c = size["rank_GB"] * mem["blocking_s_per_GB"], size["rank_GB"] * mem["committed_s_per_GB"]
    mem_fixed = fixed + size["rank_GB"] * mem["resume_s_per_GB"]
    every_step = goodput(step_s, mem_b, mem_c, mem_fixed, mtbf_s)
    memory_auto = goodput(step_s * max(1, round(max(young_daly_s(mem_b, mtbf_s), mem_c) / step_s)), mem_b, mem_c,
                          mem_fixed, mtbf_s)
    for memory in (every_step, memory_auto):  # the disk saves beside it
        memory["goodput"] -= b / preset_interval_s
        memory["blocking_share"] += b / preset_interval_s
    return {"disk": goodput(preset_interval_s, b, c, fixed + load, mtbf_s),
            "auto": goodput(max(young_daly_s(b, mtbf_s), c), b, c, fixed + load, mtbf_s),
            "memory": every_step, "memory at Young-Daly": memory_auto}


def compute(args) -> dict:
    ext, mem_result = read(args.results, "realsize_extrapolate.json"), read(args.results, "memory_bench.json")
    mem = memory_rates(mem_result)
    detect = detection_s(args.step_s)
    rows = []
    for preset, nodes, per_node in SIZES:
        size = row(ext["rates"], preset, nodes, per_node)
        preset_interval_s = int(load_config(os.path.join(ROOT, preset), []).ckpt.interval) * args.step_s
        for source, per_gpu_hour in RATES.items():
            mtbf_s = 3600 / (per_gpu_hour * size["world"])
            rows.append({"preset": preset, "world": size["world"], "rank_GB": size["rank_GB"],
                         "failures_from": source, "mtbf_h": mtbf_s / 3600,
                         "configs": configs(size, preset_interval_s, mem, args.step_s, mtbf_s,
                                            detect + args.restart_s)})
    sources = {name: {"git_commit": r["provenance"]["git_commit"], "finished_utc": r["provenance"]["finished_utc"]}
               for name, r in (("realsize_extrapolate.json", ext), ("memory_bench.json", mem_result))}
    return {"assumptions": {"step_s": args.step_s, "restart_s": args.restart_s, "detection_s": detect,
                            "failures_per_gpu_hour": RATES},
            "rates": {"disk": ext["rates"], "memory": mem}, "sources": sources, "rows": rows}


def to_markdown(res: dict) -> list[str]:
    a = res["assumptions"]
    head = (f"Arithmetic, not measured: goodput = 1 - b/t - (t/2 + c + D + R + L)/M (bench/goodput_arithmetic.py's "
            f"docstring). Step {a['step_s']:g} s and restart R {a['restart_s']:g} s assumed; detection D "
            f"{a['detection_s']:g} s (the hang watchdog's auto timeout); disk rates from realsize_extrapolate.json, "
            f"memory-tier rates from memory_bench.json. " + provenance.markdown_line(res))
    cells = [[os.path.basename(r["preset"]), r["world"], r["failures_from"], f"{r['mtbf_h']:.1f}", name,
              f"{c['interval_s']:.0f}", f"{c['blocking_share']:.3%}", f"{c['rollback_s']:.0f}", f"{c['goodput']:.2%}"]
             for r in res["rows"] for name, c in r["configs"].items()]
    table = ["| " + " | ".join(map(str, line)) + " |" for line in [COLUMNS, *cells]]
    return [head, "", table[0], "|---" * len(COLUMNS) + "|", *table[1:]]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-s", type=float, default=10.0, help="seconds per training step (assumed)")
    p.add_argument("--restart-s", type=float, default=130.0, help="seconds from a failure's detection to the new "
                   "processes' process group (assumed: JobSet's figure at 5,000 nodes)")
    p.add_argument("--results", default=os.path.join(ROOT, "bench", "results"), help="folder of the results read")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args(argv)
    started = provenance.start(argv)
    res = compute(args)
    provenance.record(res, "goodput_arithmetic", args.out, started)
    provenance.write_markdown(args.out, "goodput_arithmetic", to_markdown(res))


if __name__ == "__main__":
    main()
