"""The launcher contract: the exit codes a run ends with, what every launcher in this repository does on each,
the restart counter a launcher passes to the workers, and the error file through which torchrun passes a
worker's code on to the launcher above it.

    python -m common.launcher                  # the exit-code table of docs/reliability.md, from CONTRACT below
    python -m pytest tests/test_exit_codes.py -q -n 0

A new launcher (docs/design.md, "a launcher") keeps this contract: it sets RESTART_COUNT_ENV to which start of
the job this is (0 the first) if it restarts torchrun itself, and it acts on the codes as its column below says;
tests/test_exit_codes.py runs every launcher's own decision logic (slurm/train.sbatch, k8s/entrypoint.sh and the
k8s failure rules) on every code and compares it with CONTRACT, and docs/reliability.md's table is this module's
output (the same test).
"""

from __future__ import annotations

import argparse
import json
import os
import time

EXIT_DONE = 0
EXIT_ERROR = 1  # not decided by a rank: a peer lost, a collective's timeout, a crash outside Python's control
EXIT_BAD_INPUT = 2  # config, data, model or checkpoint refused: one error: line
EXIT_PREEMPTED = 75  # SIGTERM/USR1 honoured: an emergency checkpoint committed
EXIT_HANG = 76  # a rank made no progress (finetune/hang.py)
EXIT_FAILED = 77  # a rank's own error (an exception in training: CUDA OOM, a shape error), and its peers' exit

# Which start of the job this is, set by a launcher that starts torchrun again itself (k8s/entrypoint.sh: the
# JobSet's restart attempt plus its in-place attempt); common/dist.py worker_attempt adds torchrun's and SLURM's.
RESTART_COUNT_ENV = "LAUNCH_RESTART_COUNT"

LAUNCHERS = ("torchrun --max-restarts N", "slurm/train.sbatch", "k8s Recreate", "k8s in place")
DONE, FAIL, RESTART, UNCOUNTED = "ends", "fails, no restart", "restarts (counted)", "restarts, not counted"
CONTRACT = {  # code: (meaning, {launcher: outcome}); tests/test_exit_codes.py checks each cell against the launcher
    EXIT_DONE: ("done", dict.fromkeys(LAUNCHERS, DONE)),
    EXIT_ERROR: ("not decided by a rank: a peer pod or node lost, a collective's timeout (`error: rank r: a "
                 "training collective waited ...`), a signal, torchrun's own failure",
                 {LAUNCHERS[0]: RESTART, LAUNCHERS[1]: FAIL, LAUNCHERS[2]: RESTART, LAUNCHERS[3]: RESTART}),
    EXIT_BAD_INPUT: ("bad config, data, model or checkpoint: one `error:` line",
                     {LAUNCHERS[0]: RESTART, LAUNCHERS[1]: FAIL, LAUNCHERS[2]: FAIL, LAUNCHERS[3]: FAIL}),
    EXIT_PREEMPTED: ("preempted (SIGTERM, USR1): emergency checkpoint committed",
                     {LAUNCHERS[0]: RESTART, LAUNCHERS[1]: UNCOUNTED, LAUNCHERS[2]: UNCOUNTED,
                      LAUNCHERS[3]: RESTART}),
    EXIT_HANG: ("hang: a rank made no progress for `train.hang_timeout`; named, stacks in `<run.dir>/hang/`",
                {LAUNCHERS[0]: RESTART, LAUNCHERS[1]: RESTART, LAUNCHERS[2]: RESTART, LAUNCHERS[3]: RESTART}),
    EXIT_FAILED: ("a rank's own error (an exception in training: CUDA OOM, a shape error): `error: rank k: ...` "
                  "from it, `error: rank k failed: ...` from the lowest other rank, which exit 77 too",
                  {LAUNCHERS[0]: RESTART, LAUNCHERS[1]: FAIL, LAUNCHERS[2]: FAIL, LAUNCHERS[3]: FAIL}),
}


def tell_torchrun(exit_code: int, text: str) -> None:
    """Write this worker's code and line into torchrun's error file (TORCHELASTIC_ERROR_FILE): torchrun itself
    exits 1 for any failed worker and copies the first failed worker's file, with its exit code as `errorCode`,
    into its own error file, where a launcher reads it (k8s/entrypoint.sh). Without a file torchrun copies
    nothing. No `error:` in the text: torchrun's summary prints it, and it must not read as a second error line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = f"exit {exit_code}: {text}"
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": text, "errorCode": exit_code,
                                   "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass  # torchrun's summary then shows its default text; the launcher sees torchrun's 1


def table() -> str:
    """docs/reliability.md's exit-code table, one column per launcher."""
    rows = ["| exit | meaning | " + " | ".join(f"`{name}`" for name in LAUNCHERS) + " |",
            "|---|---|" + "---|" * len(LAUNCHERS)]
    for code, (meaning, outcomes) in CONTRACT.items():
        rows.append(f"| {code} | {meaning} | " + " | ".join(outcomes[name] for name in LAUNCHERS) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m common.launcher",
                            description="Print the exit-code table of docs/reliability.md: what every launcher does on "
                                        "each code a run ends with (CONTRACT).").parse_args(argv)
    print(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
