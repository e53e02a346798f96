"""Multi-node: two torchrun agents acting as two nodes of one job (c10d rendezvous on 127.0.0.1) train and
save; the checkpoint then resumes on one node and continues the same samples and loss curve.

    python -m pytest tests/test_multinode.py -q

The same train_fsdp.py as on one node: nothing in it knows about nodes, only RANK / WORLD_SIZE / LOCAL_RANK.
On a real cluster run the agent command below once per node (slurm/train.sbatch does), with the endpoint on
the first node's address and ckpt.dir on a shared filesystem.
"""

import os
import sys
import uuid

import pytest

from conftest import FAST, ROOT, free_port, kill_workers, port_was_taken, run_train, start_python, token_cache
from finetune.metrics import read_metrics

STEPS = ["train.max_steps=16", "ckpt.interval=8", "ckpt.keep_last=0"]


def node_agent_cmd(nnodes: int, endpoint: str, rdzv_id: str, overrides: list[str]) -> list[str]:
    """One torchrun agent = one node with one process; all agents meet at the c10d rendezvous endpoint."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node", "1",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", rdzv_id,
            os.path.join(ROOT, "train_fsdp.py"), "--config", os.path.join(ROOT, "configs", "tiny.yaml"), *overrides]


def step_records(run_dir) -> dict[int, dict]:
    return read_metrics(os.path.join(str(run_dir), "metrics.jsonl"))[0]


def test_two_nodes_train_and_save_then_resume_on_one_node(tmp_path):
    run_dir = tmp_path / "two-nodes"
    overrides = [*FAST, *STEPS, f"run.dir={run_dir}", f"data.cache_dir={token_cache()}"]
    for attempt in range(3):  # the port is free when picked, not always when the store binds it: then another one
        cmd = node_agent_cmd(2, f"127.0.0.1:{free_port()}", f"test-{uuid.uuid4().hex[:8]}", overrides)
        # forked from tests/zygote.py (docs/testing.md, "Forked runs"): torchrun's agents and rendezvous, forked ranks
        nodes = [start_python(cmd[1:], None, ROOT, forked=True) for _ in range(2)]
        try:
            outputs = ["".join(n.communicate(timeout=300)) for n in nodes]  # stdout, then stderr
        finally:
            for n in nodes:
                if n.returncode is None:  # its communicate did not finish
                    kill_workers(n.pid)
                    n.kill()
        if not port_was_taken(outputs):
            break
    for i, (n, out) in enumerate(zip(nodes, outputs)):
        assert n.returncode == 0, f"node agent {i} exited {n.returncode}\n{out[-4000:]}"

    two = step_records(run_dir)
    assert sorted(two) == list(range(1, 17)) and {r["world_size"] for r in two.values()} == {2}
    step8 = run_dir / "checkpoints" / "step-000008"
    assert sorted(n for n in os.listdir(step8) if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    one = tmp_path / "one-node"
    run_train(one, 1, [*STEPS, f"ckpt.resume={step8}"])  # torchrun, one node of one process
    resumed = step_records(one)
    assert sorted(resumed) == list(range(9, 17))
    for s in range(9, 17):
        assert resumed[s]["world_size"] == 1
        assert resumed[s]["sample_ids"] == two[s]["sample_ids"], f"step {s}: a different global batch"
        assert resumed[s]["loss"] == pytest.approx(two[s]["loss"], rel=1e-4), f"step {s}"
