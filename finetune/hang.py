"""Hang detection: a rank that stops making progress ends the job with EXIT_HANG (76) within train.hang_timeout,
naming the rank, instead of the whole job waiting train.collective_timeout_minutes with no word of which rank.

    python -m pytest tests/test_hang.py -q

Each rank runs two threads. The training loop tells them the phase it enters (`enter("step", 8)`: an attribute write and
two Event.sets, no I/O on the training thread); the beat thread then, and every CHECK_S, publishes this rank's record
(step, phase, a heartbeat counter, host, pid) under its own key in the process group's store (torchrun's store, whose
keys init_distributed prefixes by the restart attempt), one `set`, on its own cadence whatever the watchdog thread is
doing; the watchdog thread looks at its own phase: O(1) per rank per step, nothing grows with the world size. A record
is as fresh as the last publish: a rank frozen a few microseconds after entering a phase may still show the phase
before. Why the store and not a file in run.dir: the store is reachable from every node, run.dir may not be.

The rule, on each rank: a `step` phase (a training step and its log line) lasting longer than the timeout is a hang.
Every other phase (startup and the first steps under `auto`, eval, checkpoint) may legitimately take long: past the
timeout (and every timeout after) the two readers, rank 0 and rank W/2 (hang_records.py: on two nodes whenever there are
two, so a frozen reader is named by the other), read every other rank's record twice, in one `multi_get` each time, a
window apart, and call it a hang only if a rank's heartbeat stopped (SIGSTOP, a dead machine): a slow save or a long
eval is not a hang. The window is 3 x CHECK_S plus twice the slowest store time the reader saw (its pass, its own last
beat): a beat that waited behind a slow pass in the store's one queue still lands inside it, so a slow pass never makes
a verdict. A record the store cannot give, even once retried, names no one. The backup, rank 3W/4 (a third node whenever
there are three), reads the two readers' records the same way, and only if both stopped beating reads every record
itself (`_check`): both readers frozen no longer leaves a slow phase without a verdict. A verdict (who stopped, where)
is published as the job's first news under FAILED_KEY, which every rank reads anyway (below), and every rank acts on it:
per check 2(W-1) keys per reader (W-1 more once, the first time, to see that every record exists) and 4 for the backup
(2(W-1) more once both readers stopped), at most 8W in all, where every rank reading every record cost 4W^2 (16.8M keys
at W=2048). A TCPStore client serialises its requests: a reader's beat waits for its one multi_get in flight at most,
never for a pass. A beat also needs the GIL: a C call holding it longer than about 2 x CHECK_S stops the beat as SIGSTOP
would (Python's full collections over DCP's plans on the coordinator: seconds at W=64; ckpt/collector.py keeps them out
of its saves; other holds, as the coordinator's finish pickling .metadata, last seconds at W=2048: in a slow phase a
rank is called frozen only if it still has not beaten HOLD_CHECKS x CHECK_S later). On a `step` overrun a reader judges
at once, naming the frozen ranks or else those elsewhere; the backup waits one timeout more for that verdict, then
judges itself (both readers frozen, or not in this step); every other rank
only acts on a verdict (none at all, readers and backup gone: NCCL's collective timeout ends the job).

On a hang every live rank writes its Python stacks (all threads) to <run.dir>/hang/rank<r>-attempt<k>.txt (k counts
torchrun's restarts and SLURM's requeues: common/dist.py worker_attempt) and the collectives' flight records
(dump_flight_records: which collective a rank never joined); the lowest live rank prints one line naming the rank(s)
that stopped, their host, step and phase, and records a `hang` event (step, phase, ranks, waited_s, exit_code) in
metrics.jsonl; frozen ranks on this host are SIGKILLed (torchrun would otherwise wait 30 s after its SIGTERM, which a
stopped process never handles); then os._exit(EXIT_HANG) from the watchdog thread, since the main thread is blocked in a
collective. `torchrun --max-restarts` or a SLURM requeue restarts the job and ckpt.resume=auto continues from the newest
checkpoint (the memory tier's when on). A launcher that cannot see the 76 (torchrun without --max-restarts reports any
failed worker as 1) sets HANG_FILE_ENV to a path of its own for this attempt: the rank that prints the line writes it
there too (slurm/train.sbatch requeues on it). The watch ends with the loop: the final save and export wait
ckpt.timeout_minutes like every checkpoint collective, and an error's emergency save must not be called a hang.

A rank that fails is no hang. An exception leaving the loop (`failed`, before the emergency save) writes its full
traceback to <run.dir>/hang/rank<r>-attempt<k>-traceback.txt, publishes the terminal phase `failed`, and, if it is the
job's first failure, prints its first line and that traceback whatever its rank and publishes the line under one key
(FAILED_KEY: `add` picks the first). Every watchdog reads that key once per CHECK_S (one `check`: O(1) per rank per
second, 512 store round trips a second at 512 ranks, as many as the records' `set`s; read once it exists: the first news
never changes); a rank that is not failing itself FAIL_GRACE_S after it appeared (an error raised on every rank needs
them all for its emergency save) exits with EXIT_FAILED (77, as the failed rank itself: common/launcher.py), the lowest
of them printing `error: rank k failed: <its line>` and a `failed` event: no stacks, no hang file, no restart. A SIGTERM
(torchrun stopping the workers once one exited) reaches the loop only at a step boundary, and a Python signal handler
runs only once the main thread is out of the collective it is blocked in; the watchdog hears the signal through
signal.set_wakeup_fd (written by the C handler at once) and ends the rank at once when a rank failed (EXIT_FAILED) or
stopped beating (EXIT_ERROR: its peer is gone, the collective never returns; a reader that finds one tells the others,
signalled too, with a `signal` verdict); a SIGTERM with every rank alive (a preemption) waits for the step boundary as
before.

The step limit stays below the collective timeout (`cap`): NCCL's watchdog would otherwise abort the process
first, with no stacks, no line and no exit 76. The verdict itself takes seconds (3 x CHECK_S of frozen checks and
the store reads) while NCCL counts from the same moment, so auto is held to CAP_SHARE of it and a fixed
train.hang_timeout above that share is refused (finetune/config.py).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import deque

from common.dist import worker_attempt
from common.launcher import EXIT_ERROR, EXIT_FAILED, EXIT_HANG, tell_torchrun  # the launcher contract
from finetune.flight_record import dump_flight_records, no_recorder_line
from finetune.hang_records import ProgressRecords

FAILED_KEY = "finetune/failed"  # the job's first failure: {"rank", "step", "phase", "error"}
FAIL_GRACE_S = 3.0  # how long a rank waits to see whether it fails too before it exits on another's failure
CAP_SHARE = 0.8  # auto's step limit: at most this share of the collective timeout
HANG_FILE_ENV = "FINETUNE_HANG_FILE"  # a path: on a hang, the error line is written there too
CHECK_S = 1.0  # how often each rank publishes its record and looks at its own phase
HOLD_CHECKS = 20  # x CHECK_S: how much longer a rank in a slow phase may not beat before it is frozen (`_confirmed`)
SAID_KEY = FAILED_KEY + "/said"  # set once the hang's line is printed: the other ranks exit only after it
SAID_WAIT_S = 15.0  # how long they wait for it (a printer that died meanwhile says nothing)
AUTO_FLOOR_S = 60.0  # auto: never less than this
AUTO_STEPS = 10.0  # auto: this many times the median step time
AUTO_AFTER = 3  # auto: steps timed before `step` phases are held to the timeout (first steps compile, warm up)


def parse_hang_timeout(text: str) -> float | None:
    """train.hang_timeout: seconds (0: off) or auto (None). ValueError on anything else."""
    if str(text).strip() == "auto":
        return None
    seconds = float(text)
    if not (seconds >= 0 and seconds != float("inf")):
        raise ValueError(text)
    return seconds


def tell_launcher(line: str, frozen_hosts: list[str] = ()) -> None:
    """Write the hang's line to $FINETUNE_HANG_FILE, if the launcher set it: its sign that this attempt hung; and,
    where ranks stopped beating (a machine's fault, not a deadlock), a second line `frozen hosts: <h>,<h>` for a
    launcher that keeps the next attempt off them (slurm/train.sbatch)."""
    path = os.environ.get(HANG_FILE_ENV)
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(line + "\n" + (f"frozen hosts: {','.join(frozen_hosts)}\n" if frozen_hosts else ""))
    except OSError as e:
        print(f"warning: could not write the hang to {path} ({HANG_FILE_ENV}): {e}", file=sys.stderr, flush=True)


class HangWatchdog(ProgressRecords):
    """One per rank; `enter(phase, step)` from the training loop, `close()` when the loop is over."""

    def __init__(self, timeout: float | None, rank: int, world_size: int, run_dir: str, log, store,
                 cap: float | None = None):
        """`timeout`: seconds, None for auto; `log`: the run's RankZeroLog; `store`: a c10d Store all ranks share;
        `cap`: the collective timeout in seconds, which auto stays below."""
        self.fixed, self.rank, self.world_size, self.run_dir, self.log, self.store, self.cap = (
            timeout, rank, world_size, run_dir, log, store, cap)
        self.state = ("startup", 0, time.monotonic())  # (phase, step, since): one tuple, swapped atomically
        self.step_times = deque(maxlen=50)  # recent `step` phases, for auto: bounded, O(1)
        self.heartbeat, self.where = 0, {"host": socket.gethostname(), "pid": os.getpid()}
        self._last_records: dict[int, dict] = {}
        self._held: set[int] = set()  # ranks `_confirmed` frozen
        self._stop, self._signals = False, None  # (read, write) of the wakeup fd
        self._changed, self._wake = threading.Event(), threading.Event()  # the beat thread's; the watchdog thread's
        self._ended: dict | None = None  # FAILED_KEY's record once read: the first failure or hang never changes
        self._seen, self.beat_s = set(), 0.0  # the ranks whose record exists; the last beat's store time
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self._beater = threading.Thread(target=self._beat_on, name="hang-beat", daemon=True)

    @classmethod
    def start(cls, timeout: float | None, rank: int, world_size: int, run_dir: str, log, store,
              cap: float | None = None) -> "HangWatchdog":
        dog = cls(timeout, rank, world_size, run_dir, log, store, cap)
        if timeout != 0:
            dog._publish()  # every rank has a record before any rank could look for it
            dog._hear_signals()
            dog._beater.start()
            dog._thread.start()
        return dog

    def _hear_signals(self) -> None:
        """Main thread: the signals that have a Python handler are written to a pipe the watchdog reads."""
        self._signals = os.pipe()
        for fd in self._signals:
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._signals[1], warn_on_full_buffer=False)

    def _signalled(self) -> bool:
        """Whether a stop signal (SIGTERM, SIGUSR1, SIGINT) arrived since the last look."""
        try:
            got = os.read(self._signals[0], 512) if self._signals else b""
        except OSError:  # none arrived (EAGAIN)
            return False
        return any(sig in got for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT))

    def enter(self, phase: str, step: int) -> None:
        """The main thread moved to `phase` of `step` (`step`: the step being trained, or the last finished)."""
        now = time.monotonic()
        old_phase, _, since = self.state
        if old_phase == "step":
            self.step_times.append(now - since)
        self.state = (phase, step, now)
        self._changed.set()  # publish it now, from the beat thread
        self._wake.set()

    def close(self) -> None:
        """Main thread, once the loop and its emergency save are over. Its record says `done`: a closed watchdog
        beats no more, and the others must not take that for a frozen rank (a preempted rank's final save may
        still run on the others)."""
        self.state = ("done", self.state[1], time.monotonic())
        self._stop = True
        self._changed.set()
        self._wake.set()
        if self._beater.ident is not None:  # a beat of the phase before, in flight, must not land after `done`
            self._beater.join(timeout=5)
        self._publish()
        if self._signals:  # the pipe stays open: the thread may still read it once, and a closed fd number is reused
            signal.set_wakeup_fd(-1)

    @contextlib.contextmanager
    def failures_told(self, reported_elsewhere=lambda e: False):
        """Around the training loop, inside its emergency save: an exception is `failed` first, unless
        `reported_elsewhere(e)` (the caller's own line for it: raised on every rank alike, or a collective's
        timeout); the phase is `failed` either way, so the emergency save is no hang."""
        try:
            yield
        except BaseException as e:
            if reported_elsewhere(e):
                self.state = ("failed", self.state[1], time.monotonic())
            else:
                self.failed(e)
            raise

    def failed(self, error: BaseException) -> None:
        """The main thread raised `error`: keep its full traceback in <run.dir>/hang/ now (torchrun may end this rank
        during its emergency save, before the error is re-raised and printed), print its first line and the traceback
        if it is the job's first failure, publish phase `failed` and the line; the watchdog beats on through the
        emergency save."""
        line = (f"{type(error).__name__}: {error}".strip().splitlines() or [""])[0]
        phase, step, _ = self.state
        self.state = ("failed", step, time.monotonic())
        self._changed.set()
        self._wake.set()
        trace = "".join(traceback.format_exception(error))  # kept now: torchrun may end this rank before the
        kept = self._keep("-traceback.txt", trace.encode(), "the traceback")  # emergency save is over and re-raises
        first = True
        try:
            first = self.store.add(FAILED_KEY + "/count", 1) == 1
            if first:
                self.store.set(FAILED_KEY, json.dumps({"rank": self.rank, "step": step, "phase": phase, "error": line}))
        except Exception:  # noqa: BLE001 - no store (agent gone): the line below is all there is
            pass
        if first:
            print(f"error: rank {self.rank}: {line} (traceback in {kept})\n{trace}", file=sys.stderr, end="",
                  flush=True)

    def _keep(self, suffix: str, data: bytes, what: str) -> str:
        """Write `data` to <run.dir>/hang/rank<r>-attempt<k><suffix>; a warning line if it cannot. Returns the path."""
        path = self._hang_path(suffix)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        except OSError as e:
            print(f"warning: could not write {what} to {path}: {e}", file=sys.stderr, flush=True)
        return path

    def timeout(self) -> float | None:
        """The `step` phase's limit in seconds; None while auto has too few steps timed."""
        if self.fixed is not None:
            return self.fixed
        if len(self.step_times) < AUTO_AFTER:
            return None
        return self._capped(max(AUTO_FLOOR_S, AUTO_STEPS * statistics.median(tuple(self.step_times))))  # a copy

    def _capped(self, seconds: float) -> float:
        """auto: below the collective timeout, which would otherwise end the job first."""
        return seconds if self.cap is None else min(seconds, CAP_SHARE * self.cap)

    # ---- the beat thread: this rank's record, on its own cadence, whatever the watchdog thread is reading

    def _beat_on(self) -> None:
        while True:
            self._changed.wait(CHECK_S)
            self._changed.clear()
            if self._stop:
                return
            self._beat()

    # ---- the watchdog thread

    def _run(self) -> None:
        checked, failure_seen = None, None  # (since, how many timeouts) of the slow phase last checked; when seen
        while True:
            self._wake.wait(CHECK_S)
            self._wake.clear()
            if self._stop:
                return
            phase, step, since = self.state
            failure, verdict = self._failure(), self._verdict()  # one look at FAILED_KEY: one of them, or none
            if verdict:  # a reader's: every rank acts on it
                return self._obey(verdict)
            if failure and failure_seen is None:
                failure_seen = time.monotonic()
            if failure and phase != "failed" and time.monotonic() - failure_seen >= FAIL_GRACE_S:
                return self._failed_elsewhere(failure)
            if self._signalled():
                frozen = [] if failure else self._check()
                blocked = self.state == (phase, step, since)  # a preempted rank moves on meanwhile
                if self._stop:  # the loop ended meanwhile: this rank is not blocked in a collective
                    return
                if frozen and blocked and not failure:  # the other ranks, signalled too, cannot see it themselves
                    self._tell("signal", frozen, frozen)
                if failure or (frozen and blocked):  # a peer is gone: the collective this rank waits in never ends
                    self._kill_frozen_here(frozen, self._last_records)
                    sys.stdout.flush()
                    os._exit(EXIT_FAILED if failure else EXIT_ERROR)  # a frozen peer: not this job's own error
            if phase == "failed":
                continue  # its emergency save may take long: beating on is all this rank does
            limit = self.timeout()
            waited = time.monotonic() - since
            if phase == "step" and limit is not None:
                # a reader judges at once; the backup a timeout later, if no reader's verdict came (both frozen, or
                # in another phase); the others act on a verdict
                due = 1 if self.reads() else 2 if self.rank == self.backup() else None
                if due and waited > limit * due:
                    return self._hang(phase, step, since, limit)
                continue
            limit = self._limit()
            periods = int(waited // limit)
            if self.watches() and periods >= 1 and checked != (since, periods):
                checked = (since, periods)
                frozen = self._check()
                if self._stop:  # the loop ended meanwhile (its peers' records may not say `done` yet)
                    return
                if frozen:
                    return self._hang(phase, step, since, limit, self._tell("hang", frozen, frozen))

    def _limit(self) -> float:
        """The limit this rank holds its current phase to: the step limit, auto's floor before it is known."""
        limit = self.timeout()
        return limit if limit is not None else self._capped(AUTO_FLOOR_S)

    def _news(self) -> dict | None:
        """FAILED_KEY's record: the job's first failure, or a reader's verdict. One key per look until it exists,
        then kept: the first one never changes."""
        if self._ended is None:
            try:
                if self.store.check([FAILED_KEY]):
                    self._ended = json.loads(self.store.get(FAILED_KEY))
            except Exception:  # noqa: BLE001 - the store gone (agent stopping): torchrun ends this rank
                pass
        return self._ended

    def _failure(self) -> dict | None:
        """The job's first failure, if another rank published one."""
        news = self._news()
        return news if news and "verdict" not in news and news["rank"] != self.rank else None

    def _verdict(self) -> dict | None:
        """A reader's verdict, if one was the job's first news as last read (`_news`): {why, by, frozen, stuck,
        records}."""
        news = self._ended
        if not news or "verdict" not in news:
            return None
        verdict = dict(news["verdict"])
        verdict["records"] = {int(r): rec for r, rec in verdict["records"].items()}  # JSON keys are strings
        return verdict

    def _tell(self, why: str, frozen: list[int], stuck: list[int]) -> dict:
        """A reader's verdict (why: "hang", or "signal": frozen ranks heard at a SIGTERM), published as the job's
        first news if it is (one `add`, one `set`, of O(stuck) bytes); the verdict to act on: the first one."""
        records = {r: self._last_records[r] for r in {*frozen, *stuck} if r in self._last_records}
        verdict = {"why": why, "by": self.rank, "frozen": frozen, "stuck": stuck, "records": records}
        try:
            if self.store.add(FAILED_KEY + "/count", 1) == 1:
                self.store.set(FAILED_KEY, json.dumps({"rank": self.rank, "verdict": verdict}))
                return verdict
        except Exception:  # noqa: BLE001 - no store: this rank acts on its own verdict
            return verdict
        time.sleep(CHECK_S)  # another rank's news: between its `add` and its `set`, at worst
        self._news()
        return self._verdict() or verdict

    def _obey(self, verdict: dict) -> None:
        """A reader's verdict: a hang (stacks, the line if this rank tells it, exit 76), or ranks frozen at a
        SIGTERM (the collective this rank waits in never ends: exit 1)."""
        if verdict["why"] == "signal":
            self._kill_frozen_here(verdict["frozen"], verdict["records"])
            sys.stdout.flush()
            os._exit(EXIT_FAILED)
        phase, step, since = self.state
        self._hang(phase, step, since, self._limit(), verdict)

    def _failed_elsewhere(self, failure: dict) -> None:
        """Another rank failed and this one did not: its error ends the job, with EXIT_FAILED (77: the launchers do not
        restart it), not as a hang."""
        k = failure["rank"]
        if self.rank == (0 if k != 0 else 1):  # one line: the lowest rank but the failed one
            line = (f"error: rank {k} failed: {failure['error']} (step {failure['step']}, phase {failure['phase']}); "
                    f"rank {self.rank} exiting with {EXIT_FAILED}")
            print(line, file=sys.stderr, flush=True)
            self.log.event_from_any_rank("failed", step=failure["step"], phase=failure["phase"], rank=k,
                                         error=failure["error"], exit_code=EXIT_FAILED, detected_by=self.rank)
        tell_torchrun(EXIT_FAILED, f"rank {k} failed: {failure['error']}")
        sys.stdout.flush()
        os._exit(EXIT_FAILED)

    def _beat(self) -> None:
        self.heartbeat += 1
        t0 = time.monotonic()
        self._publish()
        self.beat_s = time.monotonic() - t0  # how long the store took: a reader's window allows for it

    def _check(self) -> list[int]:
        """This rank's part of a slow-phase or SIGTERM check, the frozen ranks it finds: a reader reads every
        record; the backup the two readers' (4 keys), and every record only when both readers stopped beating
        (their verdict would never come); any other rank nothing."""
        if self.reads():
            return self._frozen_ranks()
        readers = list(self.readers())
        if self.rank == self.backup() and self._frozen_ranks(readers) == readers:
            return self._frozen_ranks()
        return []

    def _frozen_ranks(self, ranks=None) -> list[int]:
        """Those of `ranks` (None: every rank) whose heartbeat did not move over 3 x CHECK_S plus twice the slowest
        store time seen (this pass, this rank's last beat): a beat that waited behind a slow pass in the store's
        queue still lands inside the window. This rank excluded; their records in _last_records; [] when the store
        could not be read."""
        ranks = [r for r in (range(self.world_size) if ranks is None else ranks) if r != self.rank]
        t0 = time.monotonic()
        before = self._records(ranks)
        if before is None:
            return []
        time.sleep(3 * CHECK_S + 2 * max(time.monotonic() - t0, self.beat_s))
        after = self._records(ranks)
        if after is None:
            return []
        frozen = [r for r in ranks if
                  (r not in after or r not in before or after[r]["heartbeat"] == before[r]["heartbeat"])
                  and not (r in after and after[r]["phase"] == "done")]
        self._last_records = after
        return self._confirmed(frozen, after, HOLD_CHECKS * CHECK_S)

    def _hang(self, phase: str, step: int, since: float, limit: float, verdict: dict | None = None) -> None:
        """A hang: `verdict` a reader's; None: this rank judges (reading the records) and tells the others."""
        if verdict is None:
            frozen = self._frozen_ranks()
            verdict = self._tell("hang", frozen, self._stuck_ranks(frozen, step))
        failure = self._failure()
        if failure:  # the rank that stopped raised: its error, not a hang
            return self._failed_elsewhere(failure)
        waited = time.monotonic() - since  # from the last progress to this verdict: what the hang cost
        frozen, stuck, records = verdict["frozen"], verdict["stuck"], verdict["records"]
        stacks = self._dump_stacks()
        flights = dump_flight_records(self.run_dir, self.rank)
        if self.rank == min((r for r in range(self.world_size) if r not in stuck), default=verdict["by"]):
            if not flights:
                print(no_recorder_line(os.path.dirname(stacks)), file=sys.stderr, flush=True)
            where = "; ".join(f"rank {r} on {records[r]['host']}: step {records[r]['step']}, phase "
                              f"{records[r]['phase']}" if r in records else f"rank {r}: no record" for r in stuck)
            line = (f"error: hang: no progress for {waited:.0f}s (train.hang_timeout {limit:g}s) on rank {self.rank} "
                    f"at step {step}, phase {phase}; stopped making progress: {where}; Python stacks"
                    f"{' and flight records' if flights else ''} in {os.path.dirname(stacks)}; exiting with "
                    f"{EXIT_HANG} so that the launcher restarts the job")
            print(line, file=sys.stderr, flush=True)
            tell_launcher(line, sorted({records[r]["host"] for r in frozen if r in records}))
            first = records.get(stuck[0], {}) if stuck else {}
            self.log.event_from_any_rank("hang", step=first.get("step", step), phase=first.get("phase", phase),
                                         ranks=stuck, waited_s=round(waited, 3), exit_code=EXIT_HANG,
                                         detected_by=self.rank)
            self._said()
        else:
            self._await_said()
        self._kill_frozen_here(frozen, records)
        sys.stdout.flush()
        os._exit(EXIT_HANG)

    def _said(self) -> None:
        with contextlib.suppress(Exception):  # noqa: BLE001 - no store: the others' wait ends on its own
            self.store.set(SAID_KEY, "1")

    def _await_said(self) -> None:
        """Until the printing rank said the line (one server-side wait, bounded): torchrun stops every worker as soon as
        one exits or a frozen one is killed, and the printer, reading the verdict up to CHECK_S after the rank that
        told it, would otherwise be stopped before its line (the backup's verdict, told by rank 3W/4, printed by the
        lowest live rank)."""
        with contextlib.suppress(Exception):  # noqa: BLE001 - timed out, or no store: exit as before
            self.store.wait([SAID_KEY], datetime.timedelta(seconds=SAID_WAIT_S))

    def _hang_path(self, suffix: str) -> str:
        """<run.dir>/hang/rank<r>-attempt<k><suffix>: where this rank leaves what a hang or a failure should keep."""
        return os.path.join(self.run_dir, "hang", f"rank{self.rank}-attempt{worker_attempt()}{suffix}")

    def _dump_stacks(self) -> str:
        path = self._hang_path(".txt")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                faulthandler.dump_traceback(f, all_threads=True)
        except OSError as e:
            print(f"warning: could not write the Python stacks to {path}: {e}", file=sys.stderr, flush=True)
        return path

    def _kill_frozen_here(self, frozen: list[int], records: dict[int, dict]) -> None:
        """A stopped process never handles torchrun's SIGTERM (it waits 30 s, then SIGKILLs): do it now."""
        for r in frozen:
            rec = records.get(r)
            if r != self.rank and rec and rec["host"] == socket.gethostname() and rec["pid"] != os.getpid():
                try:
                    os.kill(rec["pid"], signal.SIGKILL)
                except OSError:
                    pass
