"""The one checkpoint handle a training loop holds: it says which step it is at; this decides whether to save,
what a failure means, how to resume, and exports the final checkpoint.

    python -m pytest tests/test_save_errors.py tests/test_faults.py tests/test_ckpt_loop.py -q

    checkpoints, log = open_checkpoints(options, max_steps, timeout, open_log)   # the lock, then the log
    checkpoints.check_staging(model, optimizer_state)  # once, before the data is built
    resumed = checkpoints.resume(state, files_for, seed, lora_base, check_config)  # state: what every save writes
    with checkpoints.emergency_save_on_error(lambda: progress.step):
        while ...:
            with checkpoints.step_in_progress(step + 1):   # a failure in here is never checkpointed
                train_step(..., before_optimizer_step=checkpoints.before_optimizer_step)
            if checkpoints.after_step(step, agree):   # agree(flags): the loop's all-reduce; True: stop now
                break
    checkpoints.finish(step, preempted=stopped)    # saves if options.save_at_end or preempted
    checkpoints.export(step, out_dir, dtype)       # a HF folder of the final checkpoint

- at the end: the last step is saved when `save_at_end`, and always after a preemption (the requeued job
  must resume at the step this one stopped at).
- interval rules (steps, minutes, auto) live in policy.py; `after_step` asks them at every step.
- a failed periodic save stops training unless `continue_on_save_error`; the failed folder has no commit
  marker, so no resume takes it.
- on an exception: no emergency save after a collective timed out (a save needs every rank), on a full
  disk, or in the middle of a step (the batch would be recorded as trained on); otherwise the last
  finished step is saved synchronously, after the in-flight save is drained.
- the memory tier (memory_tier/tier.py, ckpt.memory_interval): a save to node-local memory, copied to other nodes; at a
  step the disk tier saves too, it saves the disk save's staged copy; resume takes the newest step of either
  tier; the memory folder goes when the run ends normally.
`options` is any object with the attributes dir, async_mode, keep_last, keep_best, resume, interval,
interval_minutes, mtbf_hours, save_at_end, continue_on_save_error (the trainer's checkpoint config), and
optionally upload_nice, unchecked_store, memory_interval, memory_dir, memory_keep, memory_replicas; nothing here
imports it. `log`, the event sink: any object with info(line) and event(name, **fields).
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Callable

from common.progress import phase
from .errors import CheckpointError, DiskFullError, collective_timed_out
from .faults import fault_at, fault_point
from .hf.export import export_final
from .layout import step_dir
from .lock import lock_for_job
from .manager import CheckpointManager, checkpoint_groups
from .memory_tier.peers import NodeLayout
from .memory_tier.tier import MemoryTier
from .policy import SavePolicy
from .resume import Resumed, restore
from .state import staging_need


def open_checkpoints(options, max_steps: int, timeout: timedelta | None, open_log: Callable[[], object]):
    """(TrainingCheckpoints, log): the ckpt.dir lock first (a second job on this ckpt.dir stops here), then
    `open_log()`, the trainer's log (it writes into the run folder, which that second job must not touch),
    which becomes the handle's event sink. `timeout`: checkpoint collectives' (manager.py checkpoint_groups)."""
    groups = checkpoint_groups(timeout)
    lock = lock_for_job(options.dir, groups[0], getattr(options, "unchecked_store", False), NodeLayout.here().nodes)
    log = open_log()
    mgr = CheckpointManager(options.dir, options.async_mode, options.keep_last, log.event, log.info,
                            keep_best=options.keep_best, groups=groups, lock=lock,
                            upload_nice=getattr(options, "upload_nice", 0))
    return TrainingCheckpoints(mgr, options, max_steps, log, MemoryTier.open(options, timeout, log)), log


class TrainingCheckpoints:
    def __init__(self, mgr, options, max_steps: int, log, memory: MemoryTier | None = None):
        """`mgr`: the CheckpointManager (how to save); `log`: the event sink (info and event); `memory`: the
        memory tier (memory_tier/tier.py), off when None."""
        self.mgr, self.options, self.max_steps, self.log = mgr, options, max_steps, log
        self.memory = memory or MemoryTier(log)
        self.state, self.files_for, self.policy = {}, None, None  # track() sets them, right before the loop
        self.mid_step = False  # True from taking a batch until the step's counters moved: the state is half updated
        self.unmeasured: tuple[int, float] | None = None  # (step, blocking s) of a save whose staging wait is to come

    def check_staging(self, model, optimizer_state) -> None:
        """Process-mode async saves: fall back to thread mode (all ranks together) if this node cannot stage
        every local rank's share of `model` + optimizer state in /dev/shm. Once, before the data takes memory.
        `optimizer_state`: its size, any object with state_bytes and state_tensors (state.py staging_need)."""
        need, local_ranks = staging_need(model, optimizer_state), NodeLayout.here().ranks_per_node
        self.mgr.check_staging(*need, local_ranks)
        self.memory.check_budget(need[1], local_ranks, self.mgr.any_rank, self.mgr.async_mode)  # one verdict

    def track(self, state: dict, files_for: Callable[[int], dict[str, str]]) -> None:
        """`state`: the Statefuls every save writes; `files_for(step)`: the small files written beside them.
        The interval rules' wall clock starts here, where the loop is about to begin."""
        self.state, self.files_for = state, files_for
        self.policy = SavePolicy(self.options.interval, self.options.interval_minutes, self.options.mtbf_hours,
                                 on_log=self.log.info)

    def resume(self, state: dict, files_for: Callable[[int], dict[str, str]], seed: int, lora_base: dict | None,
               check_config: Callable[[str, str | None], None]) -> Resumed:
        """Load into `state` what options.resume names, or with the memory tier on the newest step of either tier
        (resume.py restore: the base check, `check_config`, the RNG rule), then track it; returns what was
        loaded."""
        mgr, path, tier = self.memory.choose_checkpoint(self.mgr, self.options.resume)  # disk only when it is off
        resumed = restore(mgr, path, tier, state, seed, lora_base, self.log, check_config)
        self.track(state, files_for)
        return resumed

    def before_optimizer_step(self) -> None:
        """After the last backward: the staged copy must be complete before the optimizer changes parameters.
        That wait (CUDA: staging runs beside forward and backward) is part of the last save's cost to training."""
        t0 = time.perf_counter()
        self.mgr.wait_for_staging()
        self.memory.wait_for_staging()
        if self.unmeasured is not None:
            (step, blocking_s), self.unmeasured = self.unmeasured, None
            self.policy.measured(step, blocking_s + time.perf_counter() - t0)

    @contextlib.contextmanager
    def step_in_progress(self, step: int):
        """Around taking a batch and training `step` on it: an error inside saves no half-done step."""
        self.mid_step = True
        fault_point("mid_step", step)
        yield
        self.mid_step = False

    @fault_at("after_step")
    def after_step(self, step: int, agree: Callable[[list[bool]], tuple[bool, list[bool]]]) -> bool:
        """Raise a finished background save's error; save if an interval rule says so. `agree(flags)`: the loop's one
        per-step all-reduce, (any rank asks to stop, each of `flags` OR-ed over all ranks); `flags`: the saves in
        flight's (failed, running) here, so a save adds no collective to a step. True: stop now (`finish` saves)."""
        disk, memory = self.mgr.flags(), self.memory.flags()  # () when none in flight: the same on every rank
        stop, agreed = agree([*disk, *memory]) if step < self.max_steps or disk or memory else (False, [])
        if disk:
            self._tolerated(step, lambda: self.mgr.settle(*agreed[:len(disk)]))
        self.memory.settle(step, agreed[len(disk):])
        self.mgr.prepare_staging(self.state)  # once: the optimizer state exists after a step; a no-op after
        self.memory.prepare_staging(self.state)
        if step < self.max_steps and stop:
            return True
        if step < self.max_steps and self.policy.should_save(step):  # the same answer on all ranks
            self.memory.before_disk_save(step)
            self._tolerated(step, self.mgr.wait)  # a failed previous save must not skip this one
            self._tolerated(step, lambda: self._save(step))
        self.memory.maybe_save(step, self.state, self.files_for, self.max_steps, self.mgr)  # reuses the disk's staging
        return False

    def _save(self, step: int) -> None:
        blocking_s = self.mgr.save(step, self.state, self.files_for(step))
        self.policy.saved(step)
        self.unmeasured = (step, blocking_s)  # its cost is known once before_optimizer_step has waited for staging

    def _tolerated(self, step: int, checkpoint_call: Callable[[], object]) -> None:
        try:
            checkpoint_call()
        except CheckpointError as e:
            if not self.options.continue_on_save_error:
                raise
            self.log.info(f"warning: checkpoint failed, training continues (ckpt.continue_on_save_error=true): {e}")
            self.log.event("checkpoint_failed", step=step, error=str(e))

    def finish(self, step: int, preempted: bool = False) -> None:
        """The end of training: a synchronous save of `step` (unless already committed) if a step was taken and
        `save_at_end` is on or the run was `preempted`; then release everything (the lock last)."""
        try:
            if (self.options.save_at_end or preempted) and step > 0:
                self.final_save(step)
            self.memory.close(remove=not preempted)  # a normal end: the memory steps are no longer needed
        finally:
            self.memory.close(remove=False)  # after an error they stay, for the restart
            self.mgr.close()

    def export(self, step: int, out_dir: str, dtype: str) -> None:
        """The final checkpoint, `step`, saved by this job, as a HF folder in `out_dir`; every rank writes its
        share of the tensors (hf/export.py export_final). One log line says what was written."""
        if self.mgr.last_saved_step != step:
            raise CheckpointError(f"export.at_end: no checkpoint of the final step {step} (ckpt.save_at_end=false?)")
        with phase(self.log.info, f"export: writing step {step} to {out_dir}"):
            line = export_final(step_dir(self.mgr.dir, step), out_dir, dtype, group=self.mgr.pg)
        self.log.info(line)

    def final_save(self, step: int, save_now: bool = True) -> None:
        """Drain the in-flight save, then save synchronously unless this step is already committed (or save_now
        is False: the state is half a step and only the in-flight save, of an earlier step, is worth keeping)."""
        pending_error = None
        self.memory.drain(step)
        try:
            self.mgr.wait()
        except Exception as e:  # a failed background save must not stop the final one, but is re-raised
            pending_error = e
            self.log.info(f"error: in-flight checkpoint failed: {e}")
        if save_now and (self.mgr.last_saved_step != step or pending_error is not None):
            self.mgr.save(step, self.state, self.files_for(step), blocking=True)
            self.mgr.wait()  # its retention, in the background: done before an exception ends the process group
        if pending_error is not None and not self.options.continue_on_save_error:
            raise pending_error

    @contextlib.contextmanager
    def emergency_save_on_error(self, current_step: Callable[[], int]):
        """On an exception inside, save the last finished step before it propagates, where that is safe."""
        try:
            yield
        except BaseException as e:
            if not isinstance(e, KeyboardInterrupt) and self.options.save_at_end:
                self._emergency_save(e, current_step())
            raise

    def _emergency_save(self, e: BaseException, step: int) -> None:
        if collective_timed_out(e):  # a save needs every rank, and one of them is stuck or gone
            self.log.info(f"error at step {step}: a collective timed out; no emergency checkpoint without all ranks")
            return
        if isinstance(e, DiskFullError):  # another save on that filesystem cannot succeed
            self.log.info(f"error at step {step}: {e}; no emergency checkpoint on a full disk")
            return
        if self.mid_step:  # saving now would record a batch as consumed that was never (fully) trained on
            self.log.info(f"error inside step {step + 1}: {type(e).__name__}: {e}; no checkpoint of a half-done step: "
                     "finishing the in-flight one, if any, before exiting")
        else:
            self.log.info(f"error at step {step}: {type(e).__name__}: {e}; saving the last state before exiting")
        try:
            self.final_save(step, save_now=not self.mid_step)
        except Exception as save_err:  # noqa: BLE001 - the original error is the one to report
            self.log.info(f"error: emergency save failed too: {save_err}")
