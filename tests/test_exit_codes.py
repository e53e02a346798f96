"""One exit-code contract (common/launcher.py), run against every launcher's own decision logic: each code the workers
can end with, through slurm/train.sbatch, through k8s/entrypoint.sh and then the Kubernetes controllers' rules on
every overlay (tests/test_k8s.py's model of them), and through torchrun --max-restarts; the outcome must be the
one CONTRACT's column says, and docs/reliability.md's table must be CONTRACT's.

    python -m pytest tests/test_exit_codes.py -q -n 0          # seconds; kubectl renders the overlays

The launchers run for real, with fakes only for what they start: a fake `srun`, `scontrol` and `scancel` on PATH
for the batch script (srun ends as torchrun would: 1 for any failed worker, the hang file for a hang, USR1 to the
script for a preemption), a fake `torchrun` for the entrypoint (1 for any failed worker, its error file holding the
worker's code as torchrun copies it, the hang file, or the pod's own SIGTERM). What the workers do to produce each
code is tested where it is made (tests/test_hang.py, tests/test_k8s.py's entrypoint runs).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from common.launcher import CONTRACT, DONE, EXIT_PREEMPTED, FAIL, LAUNCHERS, RESTART, UNCOUNTED, table
from conftest import ROOT, run_python
from test_k8s import job_outcome, needs_kubectl, overlays_of, render

CODES = sorted(CONTRACT)

FAKE_SRUN = """#!/bin/bash
# as srun + torchrun end: 0, or 1 for any failed worker; a hang leaves its file; a preemption is USR1 to the script
case $FAKE_CODE in
  0) exit 0 ;;
  75) kill -USR1 "$PPID"; for _ in $(seq 100); do [ -e "$FAKE_DIR/scancelled" ] && exit 1; sleep 0.1; done; exit 9 ;;
  76) mkdir -p "$(dirname "$FINETUNE_HANG_FILE")"; echo "error: hang: (fake)" > "$FINETUNE_HANG_FILE"; exit 1 ;;
  *) exit 1 ;;
esac
"""
FAKE_SCONTROL = """#!/bin/bash
case $1 in show) echo node1 ;; requeue) touch "$FAKE_DIR/requeued" ;; esac
"""
FAKE_SCANCEL = """#!/bin/bash
touch "$FAKE_DIR/scancelled"
"""
FAKE_TORCHRUN = """#!/bin/bash
# as torchrun ends: 0, or 1 for any failed worker, with the first failed worker's code in its error file when the
# worker wrote one (common/launcher.py tell_torchrun; torchrun copies it and sets errorCode to the worker's exit)
if [ "$FAKE_ROLE" = deleted ]; then  # this pod is being deleted: the kubelet's SIGTERM to the entrypoint (PID 1)
  # the sleep's output not the test's pipes, and ended with this script: the run then waited 30 s for their EOF
  trap 'kill "$sleeper" 2>/dev/null; exit 1' TERM; kill -TERM "$PPID"; sleep 30 >/dev/null 2>&1 & sleeper=$!; wait
  exit 9
fi
case $FAKE_CODE in
  0) exit 0 ;;
  76) echo "error: hang: (fake)" > "$FINETUNE_HANG_FILE"; exit 1 ;;
  1) exit 1 ;;
  *) python3 -c "import sys; sys.path.insert(0, '$ROOT')
from common.launcher import tell_torchrun; tell_torchrun($FAKE_CODE, 'a worker ended so')"; exit 1 ;;
esac
"""


def fake_bin(tmp_path, **scripts: str) -> str:
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    for name, text in scripts.items():
        (folder / name).write_text(text.replace("$ROOT", ROOT))
        (folder / name).chmod(0o755)
    return str(folder)


def sbatch_outcome(tmp_path, code: int) -> str:
    """slurm/train.sbatch's decision when the workers end with `code`: whether it requeues, and whether a requeue
    is counted (it stops requeueing at MAX_HANG_REQUEUES=0) or not."""
    path = fake_bin(tmp_path, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL, scancel=FAKE_SCANCEL)
    requeued = {}
    for limit in ("3", "0"):
        state = tmp_path / f"state-{limit}"
        state.mkdir()
        env = {**os.environ, "PATH": f"{path}:{os.environ['PATH']}", "FAKE_CODE": str(code), "FAKE_DIR": str(state),
               "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NUM_NODES": "1",
               "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_RESTART_COUNT": "0", "HANG_DIR": str(state / "hangs"),
               "MAX_HANG_REQUEUES": limit}
        out = subprocess.run(["bash", os.path.join(ROOT, "slurm", "train.sbatch"), "configs/tiny.yaml"], env=env,
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
        requeued[limit] = (state / "requeued").exists()
        if limit == "3" and not requeued[limit]:
            return DONE if out.returncode == 0 else FAIL
    return UNCOUNTED if requeued["0"] else RESTART


def entrypoint_exit(tmp_path, code: int, role: str) -> int:
    """k8s/entrypoint.sh's exit code in a pod whose workers end with `code` ('deleted': this pod got the SIGTERM)."""
    path = fake_bin(tmp_path, torchrun=FAKE_TORCHRUN)
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "JOB", "NNODES", "AWS_", "AZURE_"))}
    env = {**keep, "PATH": f"{path}:{os.environ['PATH']}", "FAKE_CODE": str(code), "FAKE_ROLE": role,
           "JOBSET_NAME": "fsdp", "REPLICATED_JOB_NAME": "node", "JOB_COMPLETION_INDEX": "0", "NNODES": "1"}
    out = subprocess.run([os.path.join(ROOT, "k8s", "entrypoint.sh"), "configs/tiny.yaml"], env=env,
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode


def test_the_table_in_docs_is_the_contract():
    with open(os.path.join(ROOT, "docs", "reliability.md")) as f:
        assert table() in f.read(), "regenerate docs/reliability.md's table: python -m common.launcher"


@pytest.mark.parametrize("code", CODES)
def test_slurm_train_sbatch_keeps_the_contract(tmp_path, code):
    assert sbatch_outcome(tmp_path, code) == CONTRACT[code][1][LAUNCHERS[1]]


@needs_kubectl
@pytest.mark.parametrize("mode", LAUNCHERS[2:])
@pytest.mark.parametrize("code", CODES)
def test_the_entrypoint_and_the_failure_rules_keep_the_contract(tmp_path, code, mode):
    """The entrypoint's exit in each pod (the SIGTERMed one and its peers for a preemption), fed to the controllers'
    rules of every overlay of the mode: a deterministic error on one rank (77) fails the job once in both modes."""
    pods = {"deleted": "deleted", "peer": "peer"} if code == EXIT_PREEMPTED else {"peer": "peer"}
    exits = {who: entrypoint_exit(tmp_path, code, role) for who, role in pods.items()}
    assert exits == {who: code for who in pods}, "each pod passes the workers' code on"
    for overlay in overlays_of(mode):
        docs = {d["kind"]: d for d in render(overlay)}
        assert job_outcome(docs, exits) == CONTRACT[code][1][mode], (os.path.basename(overlay), exits)


def test_torchrun_restarts_on_every_failed_code(tmp_path):
    """torchrun --max-restarts restarts whatever the code (it cannot tell them apart): one run whose worker ends
    with each failed code in turn, then 0."""
    failed = [c for c in CODES if c != 0]
    starts = tmp_path / "starts"
    script = tmp_path / "worker.py"
    script.write_text("import os, sys\n"
                      f"n = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
                      f"open({str(starts)!r}, 'a').write(f'{{n}}\\n')\n"
                      f"sys.exit({failed + [0]!r}[n])\n")
    # torchrun's own main() forked from tests/zygote.py (conftest.run_python): its restarts are torchrun's
    out = run_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--max-restarts",
                      str(len(failed)), "--monitor-interval", "0.1", str(script)], {"OMP_NUM_THREADS": "1"},
                     cwd=tmp_path, timeout=240)
    assert out.returncode == 0 and starts.read_text().split() == [str(n) for n in range(len(failed) + 1)], \
        out.stderr[-3000:]
    assert all(CONTRACT[c][1][LAUNCHERS[0]] == RESTART for c in failed) and CONTRACT[0][1][LAUNCHERS[0]] == DONE


# ---------------------------------------------------------------- the restart counter

def test_a_launchers_restart_count_makes_a_new_attempt_so_attempt_faults_fire_once(monkeypatch):
    """worker_attempt adds LAUNCH_RESTART_COUNT (a launcher that starts torchrun again itself, as
    k8s/entrypoint.sh) to torchrun's and SLURM's counts: a fault for attempt 0 does not fire again there, and the hang
    stack files (rank<r>-attempt<k>.txt) of the next attempt do not overwrite this one's."""
    from ckpt.faults import fault_point
    from common.dist import worker_attempt
    from common.launcher import RESTART_COUNT_ENV
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", RESTART_COUNT_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CKPT_FAULT", "oserror@mid_step:3,attempt=0")
    with pytest.raises(OSError):
        fault_point("mid_step", 3)
    monkeypatch.setenv(RESTART_COUNT_ENV, "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert worker_attempt() == 3
    fault_point("mid_step", 3)  # attempt 3: not fired


def test_the_entrypoint_counts_the_jobsets_restarts_and_in_place_attempts(tmp_path):
    """k8s/entrypoint.sh sets LAUNCH_RESTART_COUNT to the pod's JobSet restart attempt plus its in-place attempt
    (the downward-API annotations of k8s/base/jobset.yaml; empty ones are 0)."""
    path = fake_bin(tmp_path, torchrun='#!/bin/bash\necho "count=$LAUNCH_RESTART_COUNT"\n')
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "JOB", "NNODES", "LAUNCH_"))}
    for attempts, count in (({}, "0"), ({"JOBSET_RESTART_ATTEMPT": "2", "JOBSET_IN_PLACE_ATTEMPT": ""}, "2"),
                            ({"JOBSET_RESTART_ATTEMPT": "1", "JOBSET_IN_PLACE_ATTEMPT": "4"}, "5")):
        out = subprocess.run([os.path.join(ROOT, "k8s", "entrypoint.sh"), "configs/tiny.yaml"],
                             env={**keep, "PATH": f"{path}:{os.environ['PATH']}", "JOBSET_NAME": "fsdp",
                                  "REPLICATED_JOB_NAME": "node", "JOB_COMPLETION_INDEX": "0", "NNODES": "1",
                                  **attempts}, capture_output=True, text=True, timeout=60, cwd="/")
        assert out.returncode == 0 and f"count={count}" in out.stdout, out


def test_the_entrypoint_keeps_its_state_in_dev_shm_on_a_read_only_root(tmp_path):
    """readOnlyRootFilesystem: no writable $TMPDIR (here a path that cannot be made), so the entrypoint's hang and
    error files go to /dev/shm, the pod's memory emptyDir; a hang there is still read as 76."""
    path = fake_bin(tmp_path, torchrun='#!/bin/bash\necho "state=$(dirname "$FINETUNE_HANG_FILE")"\n'
                                       'echo "error: hang: (fake)" > "$FINETUNE_HANG_FILE"; exit 1\n')
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "JOB", "NNODES", "LAUNCH_"))}
    out = subprocess.run([os.path.join(ROOT, "k8s", "entrypoint.sh"), "configs/tiny.yaml"],
                         env={**keep, "PATH": f"{path}:{os.environ['PATH']}", "TMPDIR": "/proc/no-such-folder",
                              "JOBSET_NAME": "fsdp", "REPLICATED_JOB_NAME": "node", "JOB_COMPLETION_INDEX": "0",
                              "NNODES": "1"}, capture_output=True, text=True, timeout=60, cwd="/")
    state = out.stdout.split("state=", 1)[-1].split()[0]
    if state.startswith("/dev/shm/fsdp-entrypoint."):
        subprocess.run(["rm", "-rf", state])
    assert out.returncode == 76 and state.startswith("/dev/shm/fsdp-entrypoint."), out
