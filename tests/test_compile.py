"""model.compile=true: torch.compile on each decoder block trains like eager, and its checkpoints are eager's.

    python -m pytest tests/test_compile.py -q

Two gloo ranks under FSDP2 on CPU build the tiny Llama twice from one seed, eager and compiled (inductor), full
fine-tuning and LoRA, and train both on the same micro batches with train_fsdp.train_step: losses and gradient
norms agree to 1e-4 relative, and the compiled blocks were compiled (one graph, no graph break). The compiled
model has the eager model's parameter names and checkpoint keys (no `_orig_mod.`); a checkpoint saved by the
compiled model loads into the eager one through the trainer's own key check, and the reverse, after which both
hold the same tensors and take the same next step. Without a C++ compiler (or Python.h; on CUDA, Triton) a
compiled run of train_fsdp.py stops with one `error:` line naming model.compile, exit 2, under torchrun too.
Compilation is what makes this file slow: tens of seconds of g++ on 2 cores with a cold inductor cache.
"""

import os
import re

import pytest
import torch
import torch.multiprocessing as mp

from conftest import ROOT, run_train, start_on_free_port
from test_bad_input import assert_clear_error

STEPS = 3  # optimizer steps per model before the checkpoints cross
LORA_R = 8


def _micro_batches(rank: int) -> list:
    """Two micro batches of this rank, a masked prompt in each: accumulation runs, and the loss skips labels. The
    same every step, so the loss falls as the model learns them."""
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(2):
        ids = torch.randint(3, 101, (2, 24), generator=gen)
        labels = ids.clone()
        labels[:, :4] = -100
        out.append((ids, labels, None))
    return out


def _build(compiled: bool, lora_r: int):
    from torch.distributed.device_mesh import init_device_mesh

    from finetune.config import LoRAConfig, ModelConfig
    from finetune.lora import init_adapters
    from finetune.model import build_sharded_model, init_random
    cfg = ModelConfig(config_path=os.path.join(ROOT, "assets", "tiny-llama"), compile=compiled,
                      lora=LoRAConfig(r=lora_r))
    model = build_sharded_model(cfg, init_device_mesh("cpu", (2,)), torch.device("cpu"))
    init_random(model, seed=0, std=0.02)
    if lora_r:
        init_adapters(model, seed=0)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)


def _local_state(model, optim) -> dict:
    """Every tensor a checkpoint saves, as this rank's local shard (exact copies, for comparison)."""
    from ckpt import ModelOptimizer
    flat = {}

    def walk(prefix, x):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(x, torch.Tensor):
            flat[prefix[:-1]] = (x.to_local() if hasattr(x, "to_local") else x).detach().clone()
    walk("", ModelOptimizer(model, optim).state_dict())
    return flat


def _cross_load(src, dst, mgr, step: int) -> None:
    """Save `src` (model, optimizer) with the CheckpointManager and load it into `dst` as train_fsdp.py resumes:
    the model's keys checked against the checkpoint's first."""
    from ckpt import ModelOptimizer, step_dir
    mgr.save(step, {"app": ModelOptimizer(*src)}, {"meta.json": "{}"})
    mgr.wait()
    state = ModelOptimizer(*dst)
    mgr.load(step_dir(mgr.dir, step), {"app": state}, model_state=state.state_dict()[ModelOptimizer.MODEL],
             prefix=f"app.{ModelOptimizer.MODEL}.")


def _case(rank: int, lora_r: int, ckpt_dir: str) -> dict:
    """Eager and compiled models of one kind: STEPS steps each, then compiled -> eager, a step, eager -> compiled."""
    from torch._dynamo.utils import counters

    from ckpt import CheckpointManager
    from train_fsdp import train_step
    cpu = torch.device("cpu")
    models = {"eager": _build(False, lora_r), "compiled": _build(True, lora_r)}
    graphs_before = counters["stats"]["unique_graphs"]
    steps = {way: [train_step(m, o, _micro_batches(rank), cpu, 2, 1.0) for _ in range(STEPS)]
             for way, (m, o) in models.items()}
    out = {"losses": {way: [r.loss for r in v] for way, v in steps.items()},
           "grad_norms": {way: [r.grad_norm for r in v] for way, v in steps.items()},
           "graphs": counters["stats"]["unique_graphs"] - graphs_before,
           "graph_breaks": sum(counters["graph_break"].values()),
           # the names that init, HF loading and LoRA go by, and what a checkpoint saves: DCP's state_dict API
           # would hide an `_orig_mod.` wrapper from the second, not from the first
           "names": {way: [n for n, _ in m.named_parameters()] for way, (m, _) in models.items()},
           "keys": {way: sorted(_local_state(*mo)) for way, mo in models.items()}}
    eager, compiled = models["eager"], models["compiled"]
    mgr = CheckpointManager(ckpt_dir, "off", keep_last=0)
    _cross_load(compiled, eager, mgr, STEPS)  # a compiled run's checkpoint, resumed eager
    a, b = _local_state(*compiled), _local_state(*eager)
    out["compiled_to_eager_equal"] = sorted(k for k in a if torch.equal(a[k], b[k])) == sorted(a)
    out["next_step"] = [train_step(m, o, _micro_batches(rank), cpu, 2, 1.0)[0] for m, o in (eager, compiled)]
    _cross_load(eager, compiled, mgr, STEPS + 1)  # and an eager run's, resumed compiled
    a, b = _local_state(*eager), _local_state(*compiled)
    out["eager_to_compiled_equal"] = sorted(k for k in a if torch.equal(a[k], b[k])) == sorted(a)
    mgr.close()
    return out


def _worker(rank: int, port: int, root: str, results: dict) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1  # no pool of compile processes, each importing torch, on 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results[rank] = {kind: _case(rank, r, os.path.join(root, kind)) for kind, r in (("full", 0), ("lora", LORA_R))}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    results = mp.Manager().dict()
    start_on_free_port(_worker, lambda port: (port, str(root), results), nprocs=2)
    return dict(results)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_compiled_blocks_train_like_eager(runs, kind):
    for rank in (0, 1):
        r = runs[rank][kind]
        assert r["graphs"] >= 1, f"rank {rank}: nothing was compiled"
        assert r["graph_breaks"] == 0, f"rank {rank}: a decoder block did not compile in one graph"
        losses, norms = r["losses"], r["grad_norms"]  # norms: of the gradients, before clipping
        assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4), f"rank {rank}: losses left eager's"
        assert norms["compiled"] == pytest.approx(norms["eager"], rel=1e-4), f"rank {rank}: gradients left eager's"
        assert losses["eager"][-1] < losses["eager"][0], "the steps did not train"


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_checkpoints_cross_between_compiled_and_eager(runs, kind):
    for rank in (0, 1):
        r = runs[rank][kind]
        assert r["names"]["compiled"] == r["names"]["eager"] and r["keys"]["compiled"] == r["keys"]["eager"]
        assert not any("_orig_mod" in k for k in r["names"]["compiled"] + r["keys"]["compiled"])
        assert kind == "full" or not any("base_layer" in k for k in r["keys"]["eager"])  # LoRA saves adapters only
        assert r["compiled_to_eager_equal"] and r["eager_to_compiled_equal"], f"rank {rank}: a tensor changed"
        eager, compiled = r["next_step"]  # from the same state, the same batch
        assert compiled == pytest.approx(eager, rel=1e-4)


def test_compile_without_a_cpp_compiler_is_one_error_line(tmp_path):
    """CXX names no compiler: inductor could build no CPU kernel. Under torchrun, 2 ranks: one line from rank 0 naming
    the key, no traceback from a rank, every rank's exit code 2 (torchrun's own summary follows, exit 1)."""
    proc = run_train(tmp_path / "r", 2, ["model.compile=true"], check=False, env={"CXX": "/no/such/g++"})
    assert_clear_error(proc, "model.compile=true needs a C++ compiler to build CPU kernels: No working C++ compiler "
                             "found in torch._inductor.config.cpp.cxx: (None, '/no/such/g++')", torchrun=True)
    assert len(re.findall(r"^\s*exitcode\s+:\s*2\b", proc.stderr, re.M)) == 2, proc.stderr[-3000:]


def test_compile_refuses_a_machine_without_what_inductor_needs(monkeypatch, tmp_path):
    """No Python.h where inductor's CPU kernels look for it; on CUDA, no Triton: one ModelError naming the key."""
    import sysconfig

    import torch.utils._triton

    from finetune.config import ModelConfig
    from finetune.model import ModelError, check_compile
    check_compile(ModelConfig(compile=False))  # off: nothing is checked
    real = sysconfig.get_path
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: str(tmp_path) if name == "include" else
                        real(name, *a, **k))
    with pytest.raises(ModelError, match=re.escape(f"model.compile=true: inductor's CPU kernels include Python.h, "
                                                   f"which is not in {tmp_path}; install the Python headers")):
        check_compile(ModelConfig(compile=True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: False)
    with pytest.raises(ModelError, match="model.compile=true needs Triton to build CUDA kernels"):
        check_compile(ModelConfig(compile=True))


def test_plan_says_what_it_does_not_plan_for_compiled_blocks(capsys, monkeypatch):
    import train_fsdp
    monkeypatch.chdir(ROOT)  # the preset names assets/ relative to the repository root
    preset = ["--config", "configs/tiny.yaml", "--plan", "--gpu-memory", "80"]
    assert train_fsdp.main(preset) == 0
    eager = capsys.readouterr().out
    assert train_fsdp.main([*preset, "model.compile=true"]) == 0
    compiled = capsys.readouterr().out
    assert compiled.replace("model.compile: activations above are eager's estimate; what compiled blocks keep is not "
                            "planned\n", "") == eager


class _RecordedEvent:
    """torch.cuda.Event's part the straggler monitor uses, on CPU: each record() counted."""
    records = 0

    def __init__(self, enable_timing=False):
        pass

    def record(self):
        _RecordedEvent.records += 1

    def elapsed_time(self, _end):
        return 1.0


@pytest.mark.parametrize("on_device", [True, False], ids=["cuda-events", "host-clock"])
def test_straggler_hooks_stay_out_of_a_compiled_block(monkeypatch, on_device):
    """Issue 58 point 8: model.compile=true compiles each block's call, its hooks included. Dynamo traced the
    straggler monitor's hooks: torch.cuda.Event (an in-graph class for dynamo on CUDA) and time.perf_counter broke
    the graph, and its guards on the monitor's state recompiled the block at every call (6 graphs and 19 frames in
    6 calls here, before the fix). Kept out with torch._dynamo.disable, as FSDP keeps its own hooks out: one graph,
    no graph break, no recompile, and the hooks still run (backend="eager": no code generated, CPU-seconds)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from finetune.stragglers import StragglerMonitor
    monkeypatch.setattr(torch.cuda, "Event", _RecordedEvent)
    graphs = []

    def backend(gm, _example_inputs):
        graphs.append(gm)
        return gm.forward
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    monitor = StragglerMonitor(0.2, 1, 0, 2, torch.device("cpu"), None)
    monitor.on_device = on_device
    monitor.watch_blocks([block])
    block.compile(backend=backend)
    torch._dynamo.reset()
    counters.clear()
    _RecordedEvent.records = 0
    monitor.in_step = True
    for _ in range(6):
        block(torch.randn(2, 4))
    assert len(graphs) == 1 and dict(counters["frames"]) == {"total": 1, "ok": 1}, (len(graphs), counters["frames"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    if on_device:
        assert _RecordedEvent.records == 12 and monitor._device_compute_s() == 6 / 1000, "2 events per call"
    else:
        assert monitor.compute_s < 0, "the hooks took the all-gather wait out of the host's compute"
    torch._dynamo.reset()
