"""Shared helpers for the tests: run train_fsdp.py for real (python or torchrun, gloo, CPU) and read results.

    python -m pytest tests -x -q
"""

from __future__ import annotations

import ctypes
import faulthandler
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from contextlib import contextmanager

import pytest
import torch
import torch.multiprocessing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.procfs import stat_fields  # noqa: E402
from finetune.metrics import read_metrics  # noqa: E402
from forked_run import SERVER_ENV, ForkedRun, can_fork, cpu_seconds, start_ranks  # noqa: E402

# A small, fast variant of configs/tiny.yaml: a few seconds per run on 2 CPU cores.
FAST = ["run.log_interval=1", "run.progress_bar=false", "train.sample_at_end=false", "data.seq_len=32",
        "data.global_batch_size=12", "data.micro_batch_size=3", "train.warmup_steps=3"]


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NO_CUDA = "CUDA is not available (torch.cuda.is_available() is False): the GPU suite runs on a GPU machine"
one_gpu = pytest.mark.skipif(GPUS < 1, reason=NO_CUDA)
two_gpus = pytest.mark.skipif(GPUS < 2, reason=NO_CUDA if GPUS == 0 else f"needs 2 GPUs, found {GPUS}")
ON_CPU = {"CUDA_VISIBLE_DEVICES": ""}  # run_train(env=ON_CPU): CPU ranks (gloo) on a GPU machine


def free_port() -> int:
    """A port free now; released before the caller binds it, so use it through start_on_free_port (retried)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_was_taken(outputs: list[str]) -> bool:
    """Whether launchers given a free_port() port found it bound by the time their store listened (EADDRINUSE):
    then they are started again on another port."""
    return any("EADDRINUSE" in out or "address already in use" in out for out in outputs)


def start_on_free_port(fn, args_of_port, nprocs: int, start_method: str = "forkserver", tries: int = 3) -> None:
    """torch.multiprocessing.start_processes(fn, args_of_port(port), ...) on a free port (forked_run.start_ranks:
    "forkserver" starts each rank as a spawned one would, with the imports done); when rank 0's store finds the
    port taken (another test bound it between free_port() and the bind: EADDRINUSE), again on another."""
    for attempt in range(tries):
        try:
            start_ranks(fn, args_of_port(free_port()), nprocs, start_method)
            return
        except torch.multiprocessing.ProcessRaisedException as e:
            if not port_was_taken([str(e)]) or attempt == tries - 1:
                raise


def train_cmd(nproc: int, overrides: list[str], restarts: int = 0, script: str = "") -> list[str]:
    script = script or os.path.join(ROOT, "train_fsdp.py")
    cfg = ["--config", os.path.join(ROOT, "configs", "tiny.yaml")]
    if nproc == 0:  # plain python: a world of one without torchrun
        return [sys.executable, script, *cfg, *overrides]
    # --standalone: torchrun's own store binds port 0 and the ranks use it, so no two tests can pick one port
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "--max-restarts", str(restarts), script, *cfg, *overrides]


# The quick tier, `python3 -m pytest tests -q -m quick` (docs/testing.md): in-process tests of every module and one
# torchrun kill and resume, for the edit-test loop; CI runs everything. A file name takes the whole file; a test's
# name all its parameters. A new fast test joins with @pytest.mark.quick where it is written, or here.
QUICK = (
    "test_ckpt_unit.py", "test_ckpt_loop.py", "test_staging_wait.py", "test_loss.py", "test_progress.py",
    "test_storage_backends.py", "test_layers.py", "test_gpu_mechanisms.py", "test_train_step.py",
    "test_docs_figures.py", "test_named_files.py", "test_readme.py::test_readme_test_command_is_what_ci_runs",
    "test_readme.py::test_readme_links_only_existing_docs",
    "test_ckpt_resume.py::test_kill_and_resume_is_bit_identical[thread]",
    "test_bad_input.py::test_bad_config[unknown-key]",
    "test_config.py::test_types_are_coerced_from_strings", "test_config.py::test_every_numeric_field_has_a_range",
    "test_config.py::test_interval_takes_steps_or_auto", "test_config.py::test_unknown_key_in_yaml",
    "test_config.py::test_missing_yaml_file",
    "test_data.py::test_global_batches_identical_for_any_world_size",
    "test_data.py::test_order_is_a_pure_function_of_seed_epoch_index",
    "test_data.py::test_resume_position_continues_the_same_stream", "test_data.py::test_batch_split_errors_name_sizes",
    "test_data.py::test_packing_concatenates_restarts_positions_and_drops_tail",
    "test_data.py::test_padding_truncates_and_masks_pads", "test_data.py::test_chat_prompt_tokens_are_masked",
    "test_data.py::test_text_file_end_to_end_with_cache",
    "test_plan.py::test_plan_says_why_it_does_not_fit", "test_plan.py::test_fsdp_shards_are_padded_on_dim0",
    "test_plan.py::test_plan_knows_hsdp_and_no_sync_accumulation",
    "test_plan.py::test_the_memory_tier_counts_against_host_memory",
    "test_plan.py::test_lora_plan_counts_the_adapters_peft_adds",
    "test_schedule.py::test_cosine_warms_up_then_falls_to_the_floor_at_max_steps",
    "test_schedule.py::test_wsd_holds_the_peak_then_decays_linearly_over_its_last_fraction",
    "test_schedule.py::test_an_unknown_schedule_is_a_config_error",
    "test_hf.py::test_chunk_runs_cover_exactly_the_chunk",
    "test_lora.py::test_check_same_base_rules",
    "test_lora.py::test_adapters_on_meta_freeze_the_base_in_the_compute_dtype",
    "test_lora.py::test_qlora_is_refused_clearly",
    "test_eval.py::test_keep_best_survives_retention_and_restarts",
    "test_goodput.py::test_account_of_known_records_has_every_cause",
    "test_goodput.py::test_records_without_attempt_start_are_one_attempt",
    "test_loggers.py::test_scalars_cover_eval_and_checkpoint_events", "test_hang.py::test_hang_timeout_values",
    "test_faults.py::test_random_trials_replay_and_cover_every_moment",
    "test_memory_tier.py::test_memory_shortfall_names_what_is_short",
    "test_memory_tier.py::test_default_memory_dir_is_per_ckpt_dir_and_in_shm",
    "test_memory_tier.py::test_a_memory_folder_made_by_the_tier_is_this_users_alone",
    "test_memory_tier.py::test_plan_shows_the_memory_tier_per_node",
    "test_memory_replicas.py::test_a_superseded_step_becomes_the_spare_and_the_next_step_writes_over_its_files",
    "test_memory_replicas.py::test_dcp_writing_over_a_longer_file_leaves_exactly_its_bytes",
    "test_preflight.py::test_shortfall_names_what_is_short", "test_preflight.py::test_fd_margin_counts",
    "test_retention.py::test_sync_save_returns_at_its_marker_and_retention_follows",
    "test_retention.py::test_failed_retention_is_a_warning_and_the_committed_step_is_not_saved_again",
    "test_retention.py::test_retention_without_a_rename_deletes_in_place_but_never_a_marked_folder",
    "test_s3_transfer.py::test_part_sizes_stay_within_s3_limits",
    "test_s3_transfer.py::test_ranged_reads_fetch_only_the_wanted_bytes",
    "test_s3_transfer.py::test_deletes_go_in_batches",
    "test_usability.py::test_ckpt_errors_go_to_stderr",  # python -m ckpt's commands, in-process
    "test_resume_config.py::test_rules_per_field",
    "test_resume_config.py::test_moved_model_of_an_older_checkpoint_compared_by_its_saved_folder",
    "test_ckpt_policy.py::test_young_daly_and_parse", "test_ckpt_policy.py::test_step_interval_needs_no_clock",
    "test_usability.py::test_bench_summary_says_faster_or_slower_the_right_way_round",
    "test_compile.py::test_compile_refuses_a_machine_without_what_inductor_needs",
)


def in_quick_tier(nodeid: str) -> bool:
    """Whether `nodeid` (e.g. tests/test_bad_input.py::test_bad_config[unknown-key]) is named by QUICK: its file,
    its test, or itself."""
    name = nodeid.removeprefix("tests/")
    return any(name == q or name.startswith(q + ("[" if "::" in q else "::")) for q in QUICK)


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the quick tier (`-m quick`), every module in a few minutes")


# Tests of these files share one machine-wide resource and run one after another in one xdist worker: SLURM's
# daemons in namespaces on a fixed simulated subnet.
SERIAL_GROUPS = {"test_slurm.py": "slurm", "test_slurm_multinode.py": "slurm"}
# Scheduling only (pytest.ini: -n 3, loadgroup): the files that took longest in a full run start first, so that no
# worker is left with a long file at the end while the other idles (tests/test_suite measurement, docs/testing.md).
# A file not named here runs after them, in collection order.
# test_hub.py, test_moe.py, test_k8s.py: one group each of a minute or more (their module fixtures); unnamed, such a
# group starts in collection order, late, and can keep one worker busy after the others have finished.
LONGEST_FIRST = ("test_slurm_multinode.py", "test_slurm.py", "test_bench.py", "test_hub.py", "test_ckpt_resume.py",
                 "test_memory_replicas.py", "test_moe.py", "test_memory_tier.py", "test_s3.py", "test_k8s.py",
                 "test_faults.py", "test_process_lifetime.py", "test_hang.py", "test_bad_input.py", "test_lora.py",
                 "test_s3_transfer.py", "test_world_size.py", "test_preemption.py", "test_readme.py")


def _file_of(item) -> str:
    return item.nodeid.split("::")[0].removeprefix("tests/")


def _shares_a_file_fixture(item) -> bool:
    """Whether the test uses a fixture of its own file that outlives one test (module, class or session scope):
    such tests stay in one worker, so the fixture (a training run, a server) is made once, not once per worker."""
    module = item.nodeid.split("::")[0]
    return any(d.scope != "function" and d.baseid == module
               for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(items):
    for item in items:
        if in_quick_tier(item.nodeid):
            item.add_marker(pytest.mark.quick)
        file = _file_of(item)
        if file in SERIAL_GROUPS or _shares_a_file_fixture(item):
            item.add_marker(pytest.mark.xdist_group(SERIAL_GROUPS.get(file, file)))  # else: any worker
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_file_of(item), len(rank)))  # stable: a file's own order is kept


_SESSION_PID = os.getpid()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Before each test: a process forked by a test (a data-map worker, a spawned rank) whose exception escaped
    into pytest's own frames would go on to run the rest of the session beside its parent, in the same temp
    folders: it ends here. After it: a copy of this pytest process the test forked and left running is killed,
    with a line naming the test; it holds this worker's pipe to pytest-xdist's controller, so at the session's end
    the controller would wait for it forever. And the signal handlers and environment variables a test's
    in-process code set are put back (RESTORED_SIGNALS; the environment: see below)."""
    if os.getpid() != _SESSION_PID:
        os._exit(70)
    item.cpu_mark = cpu_seconds()
    handlers = {sig: signal.getsignal(sig) for sig in RESTORED_SIGNALS}
    environ = dict(os.environ)
    yield
    if os.getpid() != _SESSION_PID:
        os._exit(70)
    for sig, handler in handlers.items():
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    end_strays(f"{item.nodeid} left")


# An in-process train_fsdp.main() that reports bad input installs a SIGTERM handler (finetune/launch.py: exit with
# the bad-input code). Left in the pytest worker, every process a later test forks inherits it: a data map's pool
# worker then handles Pool.terminate()'s SIGTERM in Python, and one in a few dozen never exits, so the map waits
# for it forever (a .ci/run here hung 10+ minutes in test_data's bad-conversation test; reproduced outside pytest).
RESTORED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# The environment too: torch's inductor sets TORCHINDUCTOR_CACHE_DIR in os.environ the first time in-process code
# asks for its cache folder (four tests of the suite do). Left in the worker, every later run differed from
# tests/zygote.py's environment in a variable read at import, so forked_run.can_fork refused, and each run of the
# worker's remaining tests was exec'd: a full run here took 34.8 min instead of 24.2, its runs' CPU tripled.


@pytest.hookimpl(trylast=True)  # after the session's fixtures are torn down
def pytest_sessionfinish(session):
    end_strays("the session left")


def pytest_unconfigure(config):
    """An xdist worker whose exit is stuck (interpreter shutdown joins non-daemon threads and multiprocessing's
    children) would leave the controller waiting without end if it could not report its finish: 60 s after its
    exit began its threads' stacks are printed and it exits. Not 60 s after its session: a worker that finished
    early waits, idle, for the controller to let it go (a run of two files waited minutes for SLURM's)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and os.getpid() == _SESSION_PID:
        threading.Thread(target=_exit_if_stuck, args=(60.0,), daemon=True).start()


def _exit_if_stuck(after_s: float) -> None:
    threading.main_thread().join()  # returns when the interpreter's shutdown begins (execnet's serve has returned)
    time.sleep(after_s)
    print(f"conftest: worker {os.environ['PYTEST_XDIST_WORKER']} still exiting after {after_s:.0f} s; its threads:",
          file=sys.__stderr__, flush=True)
    faulthandler.dump_traceback(sys.__stderr__, all_threads=True)
    os._exit(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report (setup, call, teardown) carries the CPU-seconds it used (forked_run.cpu_seconds), for
    bench/test_suite.py: on 2 cores the suite's wall time has a floor of half its CPU time."""
    outcome = yield
    now = cpu_seconds()
    report = outcome.get_result()
    report.user_properties = [*report.user_properties, ("cpu_s", round(now - item.cpu_mark, 2))]
    item.cpu_mark = now


_session: dict[str, str] = {}  # what the session fixtures below made, for the plain helpers (run_train) to use


@pytest.fixture(scope="session", autouse=True)
def shared_token_cache(tmp_path_factory):
    """One token cache for the session's runs (see token_cache)."""
    _session["token_cache"] = str(tmp_path_factory.mktemp("tok-cache"))


def token_cache() -> str:
    """The data.cache_dir of every run_train: each data set is tokenized once per session, not once per test
    (the datasets import and the tokenizing were a second or two of every run). Sharing is safe: a cache folder
    is named by its data files' paths, sizes and mtimes and the tokenizer, and appears only when committed."""
    return _session["token_cache"]


def kill_workers(parent_pid: int) -> None:
    """SIGKILL the process group of every child of `parent_pid` (ranks and their uploader processes)."""
    for pid in children(parent_pid):
        try:  # never our own group: a child of plain `python train_fsdp.py` shares pytest's
            group = int(stat_fields(pid)[2])  # state, ppid, pgrp, ...
            os.killpg(group, signal.SIGKILL) if group != os.getpgrp() else os.kill(pid, signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            pass


def end_strays(who: str) -> None:
    """SIGKILL this process's children that are forks of it, after 2 s to end on their own; print a line on stderr
    for each that had to be killed. Not reaped: multiprocessing reaps its own."""
    deadline = time.monotonic() + 2.0
    while (strays := _live_forks()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid, cmdline in strays:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        print(f"conftest: {who} process {pid} running ({cmdline[:120]}); killed it", file=sys.__stderr__, flush=True)


def _live_forks() -> list[tuple[int, str]]:
    """This process's live children that are copies of it (its command line; a zombie's is empty, an exec'd
    child's differs), as (pid, command line)."""
    with open("/proc/self/cmdline", "rb") as f:
        mine = f.read()
    found = []
    for pid in children(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read() == mine:
                    found.append((pid, mine.replace(b"\0", b" ").decode(errors="replace").strip()))
        except OSError:
            continue
    return found


def children(parent_pid: int) -> list[int]:
    """The pids whose parent is `parent_pid`."""
    out = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if int(stat_fields(pid)[1]) == parent_pid:
                out.append(pid)
        except (OSError, IndexError, ValueError):
            continue
    return out


NVML_ERROR_INSUFFICIENT_SIZE = 7  # nvml.h: the count is set, the array (none passed) too short


def gpu_contexts(nvml=None) -> dict[int, int] | None:
    """{GPU index: processes with a CUDA context on it}, from NVML's compute processes (what nvidia-smi's
    --query-compute-apps reads), counted, not identified: inside a container the pids are the host's or missing, the
    count is right. None where libnvidia-ml cannot be loaded. An open /dev/nvidia<N> is no context: driver
    initialisation alone (cudaGetDeviceCount, which a dist.barrier() reaches) may open every GPU's node (bash
    bench/gpu_check.sh prints which a process that only counted the GPUs holds). `nvml`: a stand-in, for the test."""
    if nvml is None:
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        n = ctypes.c_uint(0)
        nvml.nvmlDeviceGetCount_v2(ctypes.byref(n))
        out = {}
        for i in range(n.value):
            handle, count = ctypes.c_void_p(), ctypes.c_uint(0)
            nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle))
            # no array: NVML answers with the count alone (NVML_ERROR_INSUFFICIENT_SIZE when there are any)
            processes = (getattr(nvml, "nvmlDeviceGetComputeRunningProcesses_v3", None)  # drivers >= 510
                         or nvml.nvmlDeviceGetComputeRunningProcesses)  # the count is the same in every version
            rc = processes(handle, ctypes.byref(count), None)
            if rc not in (0, NVML_ERROR_INSUFFICIENT_SIZE):
                return None
            out[i] = count.value
        return out
    finally:
        nvml.nvmlShutdown()


def run_train(run_dir, nproc: int = 2, overrides: list[str] = (), env: dict | None = None, timeout: float = 300,
              check: bool = True, restarts: int = 0, script: str = "",
              forked: bool = True) -> subprocess.CompletedProcess:
    """Run the tiny config into `run_dir` (cwd = repo root so relative asset paths resolve); `restarts`:
    torchrun's --max-restarts; `script`: another entry point than train_fsdp.py (a test's changed trainer).
    `forked`: from tests/zygote.py, imports done (a few CPU-seconds less per rank); False execs python or torchrun,
    for a test of what the launch itself does (a run whose environment changes what imports read is exec'd anyway)."""
    args = [*FAST, f"run.dir={run_dir}", f"data.cache_dir={token_cache()}", *overrides]
    with start_python(train_cmd(nproc, args, restarts, script)[1:], env, ROOT, forked) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_workers(p.pid)  # torchrun starts each rank in its own session: killing torchrun alone orphans them
            p.kill()
            out, err = p.communicate()
            raise AssertionError(f"train_fsdp.py hung: killed after {timeout}s\n--- stdout\n{out[-4000:]}"
                                 f"\n--- stderr\n{err[-6000:]}") from None
    proc = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"train_fsdp.py exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def start_python(args: list[str], env: dict | None, cwd, forked: bool) -> subprocess.Popen | ForkedRun:
    """`python *args` started with ROOT importable, one OpenMP thread and unbuffered output (SERVER_ENV) on top of
    pytest's environment and `env`, stdout and stderr piped: forked from tests/zygote.py unless `forked` is False
    or `env` changes what imports read, else exec'd."""
    full_env = {**os.environ, **SERVER_ENV, **(env or {})}
    if forked and can_fork(full_env):
        return ForkedRun(list(args), str(cwd), full_env)
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run_python(args: list[str], env: dict | None = None, cwd=ROOT, timeout: float = 300,
               forked: bool = True) -> subprocess.CompletedProcess:
    """`python *args` (a script or `-m module`, e.g. the `python -m ckpt` commands) through start_python, its
    output captured; subprocess.TimeoutExpired after `timeout` seconds, the process killed."""
    with start_python(args, env, cwd, forked) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def ckpt_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m ckpt *args` (verify, inspect, reshard, export) through run_python."""
    return run_python(["-m", "ckpt", *args], env, timeout=timeout)


@pytest.fixture(scope="session")
def finished_two_step_run(tmp_path_factory):
    """One W=1 run of 2 steps ending in its final checkpoint, step-000002; tests use copies (two_step_run)."""
    run = tmp_path_factory.mktemp("two-step") / "run"
    run_train(run, nproc=0, overrides=["train.max_steps=2", "ckpt.interval=0"])
    return run


@pytest.fixture
def two_step_run(finished_two_step_run, tmp_path):
    """This test's own copy of finished_two_step_run (to damage or resume): one launch for the session, not one
    per test that needs a small finished run and its checkpoint."""
    shutil.copytree(finished_two_step_run, tmp_path / "run")
    return tmp_path / "run"


def kill_after_commit(run_dir, saved_step: int, kill_step: int) -> str:
    """CKPT_FAULT: the step before `kill_step` waits for step `saved_step`'s commit marker (an async save;
    process mode's uploader starts slowly on a loaded machine), then every rank is SIGKILLed after `kill_step`."""
    marker = os.path.join(str(run_dir), "checkpoints", f"step-{saved_step:06d}", "commit.json")
    return f"wait_for@after_step:{kill_step - 1},secs=120,file={marker};kill@after_step:{kill_step}"


@contextmanager
def small_filesystem(mnt, size_bytes: int, subdir: str, fault_steps: range):
    """(mnt/subdir, env, how): a tmpfs of `size_bytes` mounted at `mnt` (root only), unmounted afterwards; where
    mounting is not allowed, a roomy folder whose checkpoint writes of `fault_steps` fail with ENOSPC instead."""
    mnt.mkdir()
    try:
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes // 1024}k", "tmpfs", str(mnt)],
                               capture_output=True, text=True)
        why = mount.stderr.strip() if mount.returncode else ""
    except OSError as e:  # no mount binary
        why = str(e)
    if not why:
        try:
            yield mnt / subdir, {}, "tmpfs"
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        return
    warnings.warn(f"disk-full test ran with an injected ENOSPC, not a tmpfs: {why}")
    yield mnt / subdir, {"CKPT_FAULT": ";".join(f"oserror@write:{s}" for s in fault_steps)}, "injected"


def assert_loss_falls(run_dir, n: int = 5) -> None:
    """The mean loss of the last `n` steps is below 0.8 x that of the first `n`: the tiny job learns."""
    steps = [loss for _, loss in sorted(losses(run_dir).items())]
    first, last = sum(steps[:n]) / n, sum(steps[-n:]) / n
    assert last < 0.8 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"


def losses(run_dir) -> dict[int, float]:
    steps, _ = read_metrics(os.path.join(str(run_dir), "metrics.jsonl"))
    return {s: r["loss"] for s, r in steps.items()}


def read_hf_tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a HF folder's *.safetensors files, by name."""
    from safetensors.torch import load_file
    out = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(f))
    return out


def events(run_dir, name: str | None = None) -> list[dict]:
    _, evs = read_metrics(os.path.join(str(run_dir), "metrics.jsonl"))
    return [e for e in evs if name is None or e["event"] == name]


@pytest.fixture(scope="session")
def repo_root():
    return ROOT


@pytest.fixture
def exits_raise(monkeypatch):
    """os._exit(code) raises SystemExit(code) for this test: in-process code that ends its process (the hang
    watchdog's verdicts, an orphaned worker) is asserted on instead of ending pytest's worker."""
    def exit_(code):
        raise SystemExit(code)
    monkeypatch.setattr(os, "_exit", exit_)
