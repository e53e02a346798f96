"""Per-rank values (finetune/per_rank.py): each rank's peak memory, what counts as far above the others, the
step line that names such a rank, the scalars and the per-rank plot panel. The W=2 run's records, TensorBoard
and W&B are checked in tests/test_loggers.py (one run for all loggers).

    python -m pytest tests/test_per_rank.py -q
"""

import json
import types

import pytest
import torch

from finetune.loggers import ScalarStream
from finetune.metrics import StepLog, StepResult, loss_figure
from finetune.per_rank import FAR_GIB, FAR_RATIO, PeakMemory, RankPeaks, far_above


def test_far_above_is_a_ratio_and_a_gap_over_the_others_median():
    assert far_above([10.0, 10.5, 15.0]) == (2, 10.25)
    assert far_above([20.0, 30.0]) == (1, 20.0)
    assert far_above([1.0, 1.9]) is None  # 90% above, but under FAR_GIB: noise on a small run
    assert far_above([40.0, 40.0 * FAR_RATIO - 0.01]) is None  # over FAR_GIB, under FAR_RATIO
    assert far_above([9.0]) is None and FAR_GIB == 1.0


def test_cpu_peak_is_this_intervals_own():
    """The peak resident set is read, then reset: a 512 MiB tensor shows in the interval it lived in only."""
    memory = PeakMemory(torch.device("cpu"))
    memory.read()
    base = memory.read()[0]
    big = torch.ones(2 ** 27)  # 512 MiB, touched
    del big
    assert memory.read()[0] > base + 0.4
    assert memory.read()[0] < base + 0.2


class Lines:
    def __init__(self):
        self.lines, self.records = [], []

    def info(self, line):
        self.lines.append(line)

    def record(self, **fields):
        self.records.append(fields)


def test_step_line_names_the_rank_far_above_and_the_record_holds_every_rank(monkeypatch):
    cfg = types.SimpleNamespace(run=types.SimpleNamespace(log_interval=2, progress_bar=False),
                                train=types.SimpleNamespace(max_steps=10), data=types.SimpleNamespace(seq_len=4))
    log = Lines()
    steps = StepLog(cfg, log, 0, 1, types.SimpleNamespace(global_batch=2), 0, torch.device("cpu"))
    monkeypatch.setattr(steps.peaks, "gather", lambda: {"peak_memory_gib": [20.0, 20.5, 31.2, 19.8]})
    for step in (1, 2):
        steps.step(types.SimpleNamespace(step=step, tokens=8 * step, loss_tokens=step), types.SimpleNamespace(
            position=step), [], StepResult(1.0, 2, 0.5), 1e-3, 0.1)
    assert "peak_memory_gib" not in log.records[0]  # between intervals: no gather
    assert log.records[1]["peak_memory_gib"] == [20.0, 20.5, 31.2, 19.8]
    assert len(log.lines) == 1 and log.lines[0].endswith(
        "| peak memory: rank 2 31.20 GiB, 1.6x the others' median 20.00 GiB")
    assert RankPeaks.warning({"peak_memory_gib": [20.0, 20.5]}) == ""


def test_per_rank_fields_become_one_scalar_per_rank():
    got = ScalarStream().scalars({"step": 4, "loss": 1.0, "peak_memory_gib": [1.5, 2.5], "peak_reserved_gib": [3.0]})
    assert ("memory/peak_gib/rank_0", 1.5, 4) in got and ("memory/peak_gib/rank_1", 2.5, 4) in got
    assert ("memory/peak_reserved_gib/rank_0", 3.0, 4) in got


@pytest.mark.parametrize("ranks", [2, 12])
def test_plot_has_a_per_rank_memory_panel(tmp_path, ranks):
    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as f:
        for s in range(1, 7):
            peaks = {"peak_memory_gib": [1.0 + r + 0.1 * s for r in range(ranks)]} if s % 2 == 0 else {}
            f.write(json.dumps({"step": s, "loss": 2.0 / s, "world_size": ranks, **peaks}) + "\n")
    fig = loss_figure(str(path))
    assert len(fig.axes) == 2
    labels = fig.axes[1].get_legend_handles_labels()[1]
    want = ["rank 0", "rank 1"] if ranks == 2 else [f"{ranks} ranks: min to max", "median", "rank 11 (highest peak)"]
    assert labels == want
    assert fig.axes[1].get_ylabel() == "peak memory per rank (GiB)"


def test_peaks_are_gathered_as_cpu_tensors_whatever_the_device(monkeypatch):
    """On CUDA the default group is "cpu:gloo,cuda:nccl" and routes by the tensor's device: the peaks (host numbers)
    go as CPU tensors, to gloo's open mesh, never as a NCCL gather of CUDA tensors to rank 0 (W-1 point-to-point
    connections on GPU 0). Checked on the CPU: what the collective receives, for a rank on a CUDA device."""
    import torch.distributed as dist
    seen = []
    def gather(tensor, gather_list=None, dst=0):
        seen.append([tensor.device.type] + [t.device.type for t in gather_list or []])
        for r, t in enumerate(gather_list or []):
            t.copy_(tensor + r)
    monkeypatch.setattr(dist, "gather", gather)
    for rank in (0, 1):
        peaks = RankPeaks(rank, 3, torch.device("cuda", rank))
        monkeypatch.setattr(peaks.memory, "read", lambda: [1.5, 2.5])
        got = peaks.gather()
        assert got == ({"peak_memory_gib": [1.5, 2.5, 3.5], "peak_reserved_gib": [2.5, 3.5, 4.5]} if rank == 0 else {})
    assert seen == [["cpu"] * 4, ["cpu"]]
