"""When to save: steps, wall-clock minutes and Young/Daly auto; wall-clock rules agree across ranks.

    python -m pytest tests/test_ckpt_policy.py -q
"""

import json
import math

import pytest

from ckpt.policy import SavePolicy, parse_interval, young_daly_s
from conftest import events, start_on_free_port, run_train


def test_young_daly_and_parse():
    assert young_daly_s(0.5, 3600) == pytest.approx(math.sqrt(3600))
    assert parse_interval("auto") is None and parse_interval("20") == 20 and parse_interval(0) == 0
    with pytest.raises(ValueError):
        parse_interval("-1")
    with pytest.raises(ValueError):
        parse_interval("often")


def test_step_interval_needs_no_clock():
    p = SavePolicy("4")
    assert [s for s in range(1, 13) if p.should_save(s)] == [4, 8, 12]
    assert not any(SavePolicy("0").should_save(s) for s in range(1, 50))


class FakeClock:
    """Each rank's clock runs at its own speed: local decisions would differ between ranks."""
    def __init__(self, secs_per_tick):
        self.t, self.dt = 1000.0, secs_per_tick

    def tick(self):
        self.t += self.dt

    def __call__(self):
        return self.t


def _agree_worker(rank, world_size, port, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        found = {}
        rules = {"minutes": dict(interval="0", interval_minutes=3 / 60),        # 3 s
                 "auto": dict(interval="auto", mtbf_hours=16 / 3600)}           # sqrt(2 x 0.5 s x 16 s) = 4 s
        for name, kw in rules.items():
            clock = FakeClock(1.0 if rank == 0 else 7.0)
            logs = []
            p = SavePolicy(**kw, clock=clock, on_log=logs.append)
            steps = []
            for step in range(1, 15):
                clock.tick()  # one training step
                if p.should_save(step):
                    steps.append(step)
                    p.saved(step)
                    p.measured(step, 0.5)
            found[name] = {"steps": steps, "logs": logs}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(found, f)
    finally:
        dist.destroy_process_group()


def test_wall_clock_rules_save_at_the_same_step_on_every_rank(tmp_path):
    out = str(tmp_path / "agree")
    start_on_free_port(_agree_worker, lambda port: (2, port, out), nprocs=2)
    r0, r1 = (json.load(open(f"{out}.{r}")) for r in range(2))
    assert r0["minutes"]["steps"] == r1["minutes"]["steps"] == [3, 6, 9, 12]  # rank 0's clock: 1 s per step
    # auto: first save measures C, then every sqrt(2 C M) = 4 s of rank 0's clock
    assert r0["auto"]["steps"] == r1["auto"]["steps"] == [1, 5, 9, 13]
    assert "sqrt(2 x C 0.500s x MTBF" in r0["auto"]["logs"][0] and "= 4.0s" in r0["auto"]["logs"][0]


def test_auto_interval_in_training(tmp_path):
    run = tmp_path / "r"
    proc = run_train(run, nproc=2, overrides=["train.max_steps=8", "ckpt.interval=auto", "ckpt.mtbf_hours=1e-9",
                                              "ckpt.keep_last=0", "ckpt.async_mode=thread"])
    # an MTBF of microseconds makes the Young/Daly interval shorter than a step: a save after every step
    assert [e["step"] for e in events(run, "checkpoint")] == list(range(1, 9))
    assert "checkpoint interval (auto, Young/Daly): sqrt(2 x C" in proc.stdout
