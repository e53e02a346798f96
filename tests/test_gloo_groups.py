"""The job's gloo groups do not connect a full mesh through the store: counted store requests at W=4 real processes.

    python -m pytest tests/test_gloo_groups.py -q -n 0

bench/scale_gloo.py's measure() starts a real TCPStore (as torchrun's agent) and W processes that run the project's
own start-up (train_fsdp.init_distributed, then ckpt.manager.checkpoint_groups for the disk and the memory tier: 5
gloo groups) and a first save's collectives (dcp.save on the save group, first_problem on the agreement group),
every store request counted. With gloo's default each group costs every rank W waits and W gets at creation (2W^2 + W
requests per group, 180 at W=4); with the pairs connected lazily (common/dist.py lazy_gloo_pairs, set by
init_distributed) each rank sets one key per group, and the first save connects only the pairs its collectives use.
"""

import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import scale_gloo  # noqa: E402 - bench/scale_gloo.py

GROUPS_AT_START = 5  # the default group, 2 checkpoint groups, 2 memory-tier groups


@pytest.fixture
def project_default(monkeypatch):
    """The environment a user starts with: no TORCH_GLOO_LAZY_INIT of their own."""
    monkeypatch.delenv("TORCH_GLOO_LAZY_INIT", raising=False)


def test_start_up_store_requests_grow_linearly_with_world_size(project_default):
    world = 4
    phases = scale_gloo.measure(world, lazy=None)["phases"]
    at_start = sum(phases[p]["requests"] for p in ("init", "ckpt_groups", "memory_groups"))
    # one set per rank per group; a full mesh would add 2W per rank per group (W waits + W gets)
    assert at_start == GROUPS_AT_START * world, phases
    # the first save connects what its collectives use (rank 0 to every rank of the save group for DCP's gather and
    # scatter, the rest to their ring and tree neighbours), each pair with one wait + get: fewer than the full
    # meshes of the two groups it uses
    assert 0 < phases["first_save"]["requests"] < 2 * 2 * world * world, phases


def test_a_user_setting_is_kept(monkeypatch):
    """TORCH_GLOO_LAZY_INIT=0 from the user: full meshes, as gloo's default (and the count says so)."""
    world = 2
    phases = scale_gloo.measure(world, lazy="0")["phases"]
    assert sum(phases[p]["requests"] for p in ("init", "ckpt_groups", "memory_groups")) == \
        GROUPS_AT_START * (2 * world * world + world)
