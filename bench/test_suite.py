"""The test suite's own benchmark: its wall time, each test's duration, grouped by what the test spends its time
on, and line coverage of ckpt/, finetune/, common/ and train_fsdp.py, subprocesses and torchrun workers included
(coverage.py: each Python process the tests start measures itself and writes its own data file).

    python bench/test_suite.py --out bench/results                       # the full suite, as .ci/run runs it
    python bench/test_suite.py --out /tmp/q --name test_suite_quick -m quick    # the quick tier
    python bench/test_suite.py --out bench/results --from WORK --provenance P.json   # a run made before
    python bench/test_suite.py --out bench/results --name test_suite_ci --ci    # `bash .ci/run` itself, timed
    python bench/test_suite.py --out bench/results --name test_suite_plain --no-coverage   # wall time as in CI
    python bench/test_suite.py --out bench/results --name x --no-coverage --exec-all tests/test_faults.py  # exec'd
    python bench/test_suite.py --out bench/results --before OLD.json     # coverage beside an earlier run's

Arguments after the options go to pytest. Writes <out>/<name>.{json,md} (bench/provenance.py) and keeps the run's
raw records (per-test records, coverage data) in --work, by default <tmp>/<name>-work, outside the repository.
docs/testing.md quotes the results.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import provenance  # bench/provenance.py, beside this script

ROOT = provenance.ROOT
PACKAGES = ("ckpt", "finetune", "common", "train_fsdp.py")

# What each test file spends its time on, read from its tests (its dominant cost): the groups of the table.
GROUPS = {
    "object-store servers (moto, Azurite) and runs against them": (
        "test_s3", "test_s3_transfer", "test_store_probe", "test_storage_backends"),
    "SLURM test cluster": ("test_slurm", "test_slurm_multinode"),
    "waits and retries (a frozen rank, a signal, a timeout waited out)": (
        "test_hang", "test_process_lifetime", "test_preemption", "test_launch"),
    "torchrun launches and their training steps": (
        "test_ckpt_resume", "test_faults", "test_memory_tier", "test_memory_replicas", "test_world_size",
        "test_lora", "test_eval", "test_hsdp", "test_export_final", "test_train_e2e", "test_save_errors",
        "test_resume_config", "test_train_state_growth", "test_compile", "test_ckpt_policy", "test_goodput",
        "test_retention", "test_multinode", "test_schedule", "test_loggers", "test_hf", "test_ckpt_verify",
        "test_plan_measured", "test_preflight", "test_k8s", "test_shared_paths", "test_optim"),
    "benchmark smoke runs (bench/ scripts, most of them training under torchrun)": ("test_bench",),
    "process start-up and imports (plain python, CLI subprocesses, runs stopped at start)": (
        "test_bad_input", "test_cli_errors", "test_config", "test_usability", "test_readme", "test_data",
        "test_plan", "test_named_files"),
}
IN_PROCESS = "in-process (unit tests, ranks spawned by the test)"


def group_of(nodeid: str) -> str:
    module = nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    return next((g for g, modules in GROUPS.items() if module in modules), IN_PROCESS)


class Recorder:
    """pytest plugin: one JSON line per test phase, written as it ends (a run cut short keeps what it did)."""

    def __init__(self, path: str):
        self.path = path

    def pytest_runtest_logreport(self, report):
        with open(self.path, "a") as f:
            f.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                                "duration": round(report.duration, 3), "end": round(time.time(), 1),
                                "cpu_s": dict(report.user_properties).get("cpu_s"),
                                "worker": getattr(report, "node", None) and report.node.gateway.id}) + "\n")


_IS_CONTROLLER = [False]


def pytest_configure(config):
    _IS_CONTROLLER[0] = not hasattr(config, "workerinput")  # an xdist worker's config has it


def pytest_runtest_logreport(report):
    """As a plugin of a pytest this script did not start (--ci: `.ci/run`'s own; PYTEST_ADDOPTS="-p test_suite",
    bench/ on PYTHONPATH, TEST_SUITE_RECORD=<work>/tests.jsonl): each phase recorded as --inner records it, by
    the controller only (xdist's workers report to it)."""
    if os.environ.get("TEST_SUITE_RECORD") and _IS_CONTROLLER[0]:
        Recorder(os.environ["TEST_SUITE_RECORD"]).pytest_runtest_logreport(report)


def coverage_rc(work: str) -> str:
    """A .coveragerc with absolute paths: subprocesses start in other folders and read the same settings."""
    rc = os.path.join(work, "coveragerc")
    omit = "\n    ".join(os.path.join(ROOT, d, "*") for d in ("tests", "bench", "slurm", "data", "configs", "docs"))
    with open(rc, "w") as f:
        f.write(f"[run]\nparallel = true\nconcurrency = multiprocessing,thread\npatch = subprocess, _exit, fork\n"
                f"sigterm = true\ndata_file = {os.path.join(work, '.coverage')}\nsource = {ROOT}\n"
                f"omit =\n    {omit}\n")
    return rc


def machine_cpu_seconds() -> float:
    """CPU-seconds the whole machine has spent busy since boot (/proc/stat: user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:8]]
    return (sum(ticks[:3]) + sum(ticks[5:7])) / os.sysconf("SC_CLK_TCK")


def run_suite(work: str, pytest_args: list[str], measure_coverage: bool = True,
              exec_all: bool = False, ci: bool = False) -> tuple[float, float]:
    """The suite (this script again, --inner, as the measured process), under coverage unless told not to (then its
    wall time is what `.ci/run`'s pytest takes), or `ci`: `bash .ci/run` itself, its installs included, each test
    recorded through this module as a plugin; returns its wall time and the machine's CPU-seconds meanwhile."""
    os.makedirs(work, exist_ok=True)
    for name in os.listdir(work):
        if name.startswith(".coverage") or name == "tests.jsonl":
            os.remove(os.path.join(work, name))
    wrapper = ["-m", "coverage", "run", f"--rcfile={coverage_rc(work)}"] if measure_coverage else []
    cmd = [sys.executable, *wrapper, os.path.abspath(__file__),
           "--inner", os.path.join(work, "tests.jsonl"), "-q", "-rs", "-p", "no:cacheprovider", *pytest_args]
    if not any(a.startswith("tests") for a in pytest_args):  # no test named: all of them
        cmd.append("tests")
    # a run started inside a --ci run (test_bench's) records into its own work folder, not into the outer run's
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "TEST_SUITE_RECORD")}
    if exec_all:
        env["TESTS_EXEC_ALL"] = "1"  # tests/forked_run.py: no run forked
    if ci:
        cmd = ["bash", os.path.join(ROOT, ".ci", "run")]
        env.update(PYTEST_ADDOPTS="-p test_suite", TEST_SUITE_RECORD=os.path.join(work, "tests.jsonl"),
                   PYTHONPATH=os.pathsep.join(filter(None, (os.path.dirname(__file__), env.get("PYTHONPATH")))))
    started, cpu = time.monotonic(), machine_cpu_seconds()
    subprocess.run(cmd, cwd=ROOT, check=False, env=env)
    return round(time.monotonic() - started, 1), round(machine_cpu_seconds() - cpu, 1)


def tests_of(work: str) -> dict[str, dict]:
    """nodeid -> {seconds, cpu_s (setup + call + teardown), outcome} from the run's records."""
    out: dict[str, dict] = {}
    with open(os.path.join(work, "tests.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            t = out.setdefault(r["nodeid"], {"seconds": 0.0, "cpu_s": 0.0, "outcome": "passed"})
            t["seconds"] = round(t["seconds"] + r["duration"], 2)
            t["cpu_s"] = round(t["cpu_s"] + (r.get("cpu_s") or 0.0), 2)  # absent in records made before it was
            if r["outcome"] == "failed" or (r["outcome"] == "skipped" and t["outcome"] == "passed"):
                t["outcome"] = r["outcome"]  # a skip is reported at setup, a failure at any phase
    return out


def coverage_of(work: str) -> dict[str, dict]:
    """Line coverage per package (and all four together) from the run's combined coverage data."""
    rc = os.path.join(work, "coveragerc")
    report = os.path.join(work, "coverage.json")
    # coverage.py 7.17's reports combine the processes' data files into .coverage themselves (an empty file, of a
    # process that ended before writing, is skipped); --keep-combined: each stays beside it, to find whose lines a
    # run lacks. A work folder combined before (--from) has only .coverage: read as it is
    subprocess.run([sys.executable, "-m", "coverage", "json", "-q", "--keep-combined", f"--rcfile={rc}", "-o", report],
                   cwd=ROOT, check=True)
    with open(report) as f:
        files = json.load(f)["files"]
    with open(rc) as f:  # the checkout that run measured (an earlier run's may be another clone)
        root = next(line.split("=", 1)[1].strip() for line in f if line.startswith("source ="))
    per = {p: [0, 0] for p in (*PACKAGES, "all")}
    modules = {}
    for path, data in files.items():
        rel = os.path.relpath(os.path.join(ROOT, path), root)
        if rel.split(os.sep)[0] not in PACKAGES:
            continue
        modules[rel] = data["summary"]["percent_covered"]
        for key in (rel.split(os.sep)[0], "all"):
            per[key][0] += data["summary"]["covered_lines"]
            per[key][1] += data["summary"]["num_statements"]
    out = {p: {"lines": n, "covered": c, "percent": round(100 * c / n, 1) if n else 0.0} for p, (c, n) in per.items()}
    return {**out, "modules_percent": {m: round(v, 1) for m, v in sorted(modules.items())}}


def summarize(tests: dict[str, dict], wall_s: float | None, cover: dict, machine_cpu_s: float | None = None) -> dict:
    groups: dict[str, dict] = {}
    for nodeid, t in tests.items():
        g = groups.setdefault(group_of(nodeid), {"tests": 0, "seconds": 0.0, "cpu_s": 0.0})
        g["tests"] += 1
        g["seconds"] = round(g["seconds"] + t["seconds"], 1)
        g["cpu_s"] = round(g["cpu_s"] + t["cpu_s"], 1)
    outcomes = {o: sum(t["outcome"] == o for t in tests.values()) for o in ("passed", "skipped", "failed")}
    top = sorted(tests.items(), key=lambda kv: -kv[1]["seconds"])[:30]
    return {"wall_s": wall_s, "machine_cpu_s": machine_cpu_s, "tests": len(tests), "outcomes": outcomes,
            "test_seconds": round(sum(t["seconds"] for t in tests.values()), 1),
            "test_cpu_s": round(sum(t["cpu_s"] for t in tests.values()), 1),
            "top30_cpu": [{"test": n, **t, "group": group_of(n)}
                          for n, t in sorted(tests.items(), key=lambda kv: -kv[1]["cpu_s"])[:30]],
            "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1]["seconds"])),
            "top30": [{"test": n, **t, "group": group_of(n)} for n, t in top], "coverage": cover}


def note_of(r: dict) -> str:
    """A run's provenance note (what was special about it), as a sentence to follow its provenance line."""
    return f" Note: {r['provenance']['note']}." if r["provenance"].get("note") else ""


def table(r: dict) -> list[str]:
    wall = f"{r['wall_s'] / 60:.1f} min wall" if r["wall_s"] else "wall time not recorded (run cut short)"
    lines = [provenance.markdown_line(r) + note_of(r), "", f"{r['tests']} tests ({r['outcomes']['passed']} passed, "
             f"{r['outcomes']['skipped']} skipped, {r['outcomes']['failed']} failed); {wall}; "
             f"{r['test_seconds'] / 60:.1f} min summed over tests.", ""]
    if r.get("machine_cpu_s"):
        lines += [f"CPU: {r['machine_cpu_s'] / 60:.1f} CPU-min used by the machine while the suite ran, "
                  f"{r['test_cpu_s'] / 60:.1f} of them counted to a test (forked_run.cpu_seconds: not the servers, "
                  "SLURM's daemons or its job steps).", ""]
    lines += ["| what the tests spend time on | tests | minutes | CPU-min |", "|---|---|---|---|"]
    lines += [f"| {g} | {v['tests']} | {v['seconds'] / 60:.1f} | {v.get('cpu_s', 0) / 60:.1f} |"
              for g, v in r["groups"].items()]
    if r["coverage"] and r.get("coverage_before"):
        before = r["coverage_before"]
        o = before["outcomes"]
        lines += ["", f"Coverage before: {provenance.markdown_line(before)} {before['tests']} tests ({o['passed']} "
                  f"passed, {o['skipped']} skipped, {o['failed']} failed).{note_of(before)}", "",
                  "| line coverage | before: covered / lines | % | now: covered / lines | % |", "|---|---|---|---|---|"]
        lines += [f"| {p} | {before['coverage'][p]['covered']} / {before['coverage'][p]['lines']} | "
                  f"{before['coverage'][p]['percent']} | {v['covered']} / {v['lines']} | {v['percent']} |"
                  for p, v in r["coverage"].items() if p in (*PACKAGES, "all")]
    elif r["coverage"]:
        lines += ["", "| line coverage | covered / lines | % |", "|---|---|---|"]
        lines += [f"| {p} | {v['covered']} / {v['lines']} | {v['percent']} |" for p, v in r["coverage"].items()
                  if p in (*PACKAGES, "all")]
        low = [m for m, v in r["coverage"]["modules_percent"].items() if v < 50]
        lines += ["", f"Modules under 50% line coverage: {', '.join(low) or 'none'}."]
    lines += ["", "| slowest tests | s | group |", "|---|---|---|"]
    lines += [f"| {t['test']} | {t['seconds']:.1f} | {t['group']} |" for t in r["top30"]]
    if r.get("top30_cpu"):
        lines += ["", "| most CPU | CPU-s | s |", "|---|---|---|"]
        lines += [f"| {t['test']} | {t['cpu_s']:.1f} | {t['seconds']:.1f} |" for t in r["top30_cpu"]]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--inner"]:  # the measured process: pytest with the recorder
        import pytest
        return pytest.main(argv[2:], plugins=[Recorder(argv[1])])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="test_suite")
    p.add_argument("--work", help="where the run's raw records go (default: <tmp>/<name>-work)")
    p.add_argument("--from", dest="earlier", help="summarize this earlier run's --work folder instead of running")
    p.add_argument("--provenance", help="with --from: a JSON file holding that run's provenance")
    p.add_argument("--no-coverage", action="store_true", help="time the suite as .ci/run runs it, without coverage")
    p.add_argument("--ci", action="store_true", help="run `bash .ci/run` itself (its installs, its pytest "
                   "command, no coverage) and time it, each test recorded")
    p.add_argument("--before", help="an earlier run's results JSON: its coverage and provenance are recorded "
                   "beside this run's (coverage_before), the table shows both")
    p.add_argument("--exec-all", action="store_true", help="exec every run the tests start instead of forking "
                   "it from tests/zygote.py (to time what the forks save, side by side)")
    args, pytest_args = p.parse_known_args(argv)
    started = provenance.start(argv)
    if args.earlier:
        work, wall_s, cpu_s = args.earlier, None, None
    else:
        work = os.path.abspath(args.work or os.path.join(tempfile.gettempdir(), f"{args.name}-work"))
        wall_s, cpu_s = run_suite(work, pytest_args, not (args.no_coverage or args.ci), args.exec_all, args.ci)
    cover = {} if args.no_coverage or args.ci else coverage_of(work)
    result = summarize(tests_of(work), wall_s, cover, cpu_s)
    if args.before:
        with open(args.before) as f:
            earlier = json.load(f)
        result["coverage_before"] = {k: earlier[k] for k in ("coverage", "provenance", "tests", "outcomes")}
    given = {}
    if args.provenance:  # the run summarized was made earlier: its commit, dates, loads and command
        with open(args.provenance) as f:
            given = json.load(f)
        result["wall_s"] = given.pop("wall_s", None)
        result["machine_cpu_s"] = given.pop("machine_cpu_s", None)
    result = provenance.record(result, args.name, args.out, started)
    if given:
        result["provenance"].update(given)
        runs = os.path.join(args.out, "runs", args.name)
        newest = max((os.path.join(runs, n) for n in os.listdir(runs)), key=os.path.getmtime)
        for path in (newest, os.path.join(args.out, args.name + ".json")):
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
    provenance.write_markdown(args.out, args.name, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
