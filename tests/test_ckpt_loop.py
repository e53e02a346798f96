"""The loop's checkpoint API (ckpt/loop.py) and the checkpoint schema (ckpt/schema.py), without a process group.

    python -m pytest tests/test_ckpt_loop.py -q

A recording stand-in for CheckpointManager shows which calls each failure rule makes; the end-to-end
versions of these rules run in tests/test_faults.py and tests/test_save_errors.py.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from types import SimpleNamespace

from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ckpt import CheckpointError, CheckpointSchema, DiskFullError, TrainingCheckpoints
from ckpt.checksum import ChecksummingWriter
from ckpt.commit_protocol import commit_checkpoint
from ckpt.manager import CheckpointManager
from ckpt.memory_tier.tier import MemoryTier
from ckpt.describe import inspect_path, world_size_problem
from ckpt.schema import schema_of


NO_STOP, STOP = (lambda flags: (False, flags)), (lambda flags: (True, flags))  # the loop's all-reduce at W=1


class RecordingManager:
    def __init__(self, fail_save: Exception | None = None):
        self.calls, self.fail_save, self.last_saved_step = [], fail_save, None

    def wait_for_staging(self):
        self.calls.append("wait_for_staging")

    def flags(self):  # no save in flight
        return ()

    def prepare_staging(self, state):  # allocating staging buffers early changes no decision of the loop
        pass

    def wait(self):
        self.calls.append("wait")

    def save(self, step, state, files, blocking=False):
        self.calls.append(("save", step, blocking))
        if self.fail_save:
            raise self.fail_save
        self.last_saved_step = step
        return 0.01

    def close(self):
        self.calls.append("close")


class StagingManager(RecordingManager):
    """As on CUDA: save() returns after its blocking part; its copy to host memory is waited for in
    wait_for_staging, which sleeps `staging_s` once after each save."""
    def __init__(self, staging_s: float):
        super().__init__()
        self.staging_s, self.staging = staging_s, False

    def save(self, step, state, files, blocking=False):
        blocking_s = super().save(step, state, files, blocking)
        self.staging = True
        return blocking_s

    def wait_for_staging(self):
        super().wait_for_staging()
        if self.staging:
            time.sleep(self.staging_s)
            self.staging = False


def checkpoints(mgr, continue_on_save_error=False, save_at_end=True, interval="2", lines=None):
    options = SimpleNamespace(interval=interval, interval_minutes=0.0, mtbf_hours=24.0, save_at_end=save_at_end,
                              continue_on_save_error=continue_on_save_error)
    lines = [] if lines is None else lines
    ck = TrainingCheckpoints(mgr, options, 10, SimpleNamespace(info=lines.append, event=lambda *a, **k: None))
    ck.track({}, lambda step: {"meta.json": "{}"})
    return ck


def test_interval_and_stop_request():
    mgr = RecordingManager()
    ck = checkpoints(mgr)
    assert not ck.after_step(1, NO_STOP) and ("save", 1, False) not in mgr.calls
    assert not ck.after_step(2, NO_STOP) and ("save", 2, False) in mgr.calls
    assert ck.after_step(3, STOP)  # a stop request: no periodic save, the caller's finish saves
    assert ("save", 3, False) not in mgr.calls
    assert not ck.after_step(10, STOP)  # at the last step a request just finishes


def test_auto_interval_counts_the_staging_wait_of_the_last_save():
    lines = []
    mgr = StagingManager(staging_s=0.2)
    ck = checkpoints(mgr, interval="auto", lines=lines)
    assert not ck.after_step(1, NO_STOP) and ("save", 1, False) in mgr.calls  # auto: a first save measures C
    ck.before_optimizer_step()  # the next step waits for step 1's staged copy
    costs = [float(c) for c in re.findall(r"sqrt\(2 x C (\d+\.\d+)s", "\n".join(lines))]
    assert len(costs) == 1 and costs[0] >= 0.2  # save() alone reported 0.01 s
    ck.before_optimizer_step()  # no save since: nothing more is measured
    assert len(re.findall("Young/Daly", "\n".join(lines))) == 1


def test_failed_periodic_save_stops_or_is_tolerated():
    with pytest.raises(CheckpointError):
        checkpoints(RecordingManager(CheckpointError("boom"))).after_step(2, NO_STOP)
    lines = []
    checkpoints(RecordingManager(CheckpointError("boom")), continue_on_save_error=True, lines=lines).after_step(
        2, NO_STOP)
    assert any(line.startswith("warning: checkpoint failed, training continues") for line in lines)


@pytest.mark.parametrize("where, error, saved", [
    ("between steps", RuntimeError("x"), True),
    ("mid step", RuntimeError("x"), False),     # a half-done step is never checkpointed
    ("between steps", DiskFullError("full"), False),
    ("between steps", KeyboardInterrupt(), False),
])
def test_emergency_save_rules(where, error, saved):
    mgr = RecordingManager()
    ck = checkpoints(mgr)
    with pytest.raises(type(error)):
        with ck.emergency_save_on_error(lambda: 4):
            if where == "mid step":
                with ck.step_in_progress(5):
                    raise error
            raise error
    assert (("save", 4, True) in mgr.calls) == saved
    assert ("wait" in mgr.calls) == (not isinstance(error, (DiskFullError, KeyboardInterrupt)))
    if saved:  # the save's retention runs in the background: drained before the exception ends the process group
        assert "wait" in mgr.calls[mgr.calls.index(("save", 4, True)):]


def test_finish_saves_once_and_closes():
    mgr = RecordingManager()
    ck = checkpoints(mgr)
    ck.finish(5)
    ck.finish(5)  # already committed: not rewritten
    assert [c for c in mgr.calls if c[0] == "save"] == [("save", 5, True)] and mgr.calls[-1] == "close"


def test_finish_saves_without_save_at_end_only_after_a_preemption():
    mgr = RecordingManager()
    checkpoints(mgr, save_at_end=False).finish(5)
    assert not [c for c in mgr.calls if c[0] == "save"] and mgr.calls[-1] == "close"
    checkpoints(mgr, save_at_end=False).finish(5, preempted=True)  # the requeued job resumes at this step
    assert [c for c in mgr.calls if c[0] == "save"] == [("save", 5, True)]


def test_schema_round_trip_and_batch_rule(tmp_path):
    schema = CheckpointSchema(model_prefix="m.", optim_prefix="o.", train_state_keys=("p.",), step_key="p.step",
                              position_key="d.position", divides={"data.global_batch_size": 6}, model_dir="x",
                              tokenizer_dir="x", pretrained=False, optimizer="sgd", optimizer_state_bytes=4)
    (tmp_path / "meta.json").write_text(json.dumps({"step": 1, "schema": schema.to_meta()}))
    assert schema_of(str(tmp_path)) == schema
    older = {k: v for k, v in schema.to_meta().items() if not k.startswith("optimizer")}  # before it named one
    (tmp_path / "meta.json").write_text(json.dumps({"step": 1, "schema": older}))
    assert (schema_of(str(tmp_path)).optimizer, schema_of(str(tmp_path)).optimizer_state_bytes) == ("adamw", 8)
    assert world_size_problem(str(tmp_path), 3) is None
    assert "data.global_batch_size=6 is not divisible by world size 4; world sizes that work: [1, 2, 3, 6]" == \
        world_size_problem(str(tmp_path), 4)


def test_schema_of_an_older_checkpoint_comes_from_config_yaml(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"step": 1}))
    (tmp_path / "config.yaml").write_text("model:\n  name_or_path: base\ndata:\n  global_batch_size: 8\n")
    schema = schema_of(str(tmp_path))
    assert schema.divides == {"data.global_batch_size": 8} and schema.model_dir == "base" and schema.pretrained


def test_a_checkpoint_without_schema_still_inspects(tmp_path, capsys):
    """The keys and config.yaml of a checkpoint written before meta.json carried a schema (the export of one
    runs in tests/test_hf.py::test_import_w2_bit_exact_then_export_round_trip)."""
    path = str(tmp_path / "step-000003")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process" is the intent
        metadata = dcp.save({"app": {"model": {"w": torch.ones(4)}, "optim": {"state": {"w": {"exp_avg": torch.ones(4)}}}},
                             "progress": {"step": 3}, "data": {"position": 12}}, no_dist=True,
                            storage_writer=ChecksummingWriter(path))
    (tmp_path / "step-000003" / "meta.json").write_text(json.dumps({"step": 3, "world_size": 2, "seed": 1}))
    (tmp_path / "step-000003" / "config.yaml").write_text("data:\n  global_batch_size: 4\n")
    commit_checkpoint(path, 1, metadata.file_digests, metadata, ["meta.json", "config.yaml"])
    assert inspect_path(path) == 0
    out = capsys.readouterr().out
    assert "progress.step = 3" in out and "data.position = 12" in out and "app.optim.state.*.exp_avg" in out
    assert inspect_path(path, world_size=3) == 1
    assert "data.global_batch_size=4 is not divisible by world size 3" in capsys.readouterr().out
    assert inspect_path(path, world_size=2) == 0
    assert "data: continues at global sample 12" in capsys.readouterr().out


def test_a_save_in_flight_adds_no_collective_to_a_step(monkeypatch, tmp_path):
    """While a disk save and a memory save are in flight, a step's one collective is the loop's own all-reduce
    (`agree`), which carries their (failed, running) flags: none on the checkpoint groups (there were two a step,
    a gloo ring each, 2(W-1) hops). A disk save that failed on another rank (its flag OR-ed in) raises on this
    rank at that same call."""
    reduced, other_rank_failed = [], []  # the checkpoint groups' all-reduces; once set, another rank's flags are 1
    def all_reduce(t, op=None, group=None):
        reduced.append(group)
        t.fill_(1.0 if other_rank_failed else 0.0)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    log = SimpleNamespace(info=lambda line: None, event=lambda *a, **k: None)
    disk = CheckpointManager(str(tmp_path / "disk"), groups=(None, "disk agreement group"))
    memory = MemoryTier(log, interval=100)
    memory.mgr = CheckpointManager(str(tmp_path / "memory"), groups=(None, "memory agreement group"))
    disk._inflight, memory.mgr._inflight = Future(), Future()  # both uploads still running on this rank
    options = SimpleNamespace(interval="100", interval_minutes=0.0, mtbf_hours=24.0, save_at_end=True,
                              continue_on_save_error=False)
    ck = TrainingCheckpoints(disk, options, 10, log, memory)
    ck.track({}, lambda step: {})
    agreed = []
    for step in (1, 2, 3):
        assert not ck.after_step(step, lambda flags: agreed.append(flags) or (False, flags))
    assert reduced == [], "a checkpoint group's own all-reduce in a step"
    assert agreed == [[False, True, False, True]] * 3, "the loop's one all-reduce carries both saves' flags"
    disk._inflight.set_result(None)  # done here; on another rank it failed
    other_rank_failed.append(True)
    with pytest.raises(CheckpointError, match="failed on another rank"):
        ck.after_step(4, lambda flags: (False, [True, False, *flags[2:]]))
    assert reduced == ["disk agreement group"], "wait()'s agreement on the outcome: once, at the failure"
