"""Hugging Face Hub model ids in model.name_or_path (and config_path, tokenizer_path), against a local stand-in for
the Hub (tests/hub_server.py, huggingface_hub pointed at it through HF_ENDPOINT): a run, its offline resume, the
refusal of another commit, --plan's one file, the exports, and the error lines; and on several nodes (two torchrun
agents, or two node leaders with a store of this process): one commit for the job though main moves, a node's slow
download awaited past the collective timeout, one download into a shared cache, caches at other commits and a
stale lock each named in one line.

    python -m pytest tests/test_hub.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import FAST, ROOT, free_port, run_train, token_cache
from hub_server import GATED, MODEL, TOKEN, HubServer, tiny_model_files

from common.peer_wait import PeerWaitError, once_per_node, wait_for_file

TIMEOUT = 240
RUN = ["train.max_steps=2", "ckpt.interval=2", "ckpt.async_mode=off", f"model.name_or_path={MODEL}"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    server = HubServer()
    server.commits = [server.add(MODEL, tiny_model_files(seed=1))]
    server.add(GATED, tiny_model_files(seed=1))
    yield server
    server.close()


def hub_env(hub, home, **more) -> dict:
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_TOKEN": "", **more}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def python(args: list[str], env: dict, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=timeout)


def meta(run, step: int) -> dict:
    with open(os.path.join(str(run), "checkpoints", f"step-{step:06d}", "meta.json")) as f:
        return json.load(f)


def test_a_hub_id_trains_resumes_offline_and_refuses_another_commit(hub, tmp_path):
    """One run from a Hub id on 2 ranks: each file fetched once (local rank 0; the other rank waits), no .bin/.pth/
    gguf; meta.json records the commit. The resume with HF_HUB_OFFLINE=1 makes no request. After the model's main
    branch moved, a resume is refused naming both commits; ckpt.resume_config_check=warn goes on with one warning.
    The checkpoint exports offline from the cache."""
    home, run = tmp_path / "hf", tmp_path / "run"
    hub.requests.clear()
    first = run_train(run, nproc=2, overrides=RUN, env=hub_env(hub, home), timeout=TIMEOUT)
    got = [path for method, path in hub.requests if method == "GET" and "/resolve/" in path]
    assert sorted(os.path.basename(p) for p in got) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja"]), got  # once each, though two ranks started; no decoy
    asked = [path for _, path in hub.requests if "/api/" in path]
    assert len(asked) == 2, asked  # the revision and the file list, asked by local rank 0 alone
    commit_a = hub.commits[0]
    assert meta(run, 2)["schema"]["hub_commits"] == {MODEL: commit_a}
    assert f"model: loading the weights of {MODEL}" in first.stdout

    hub.requests.clear()
    offline = run_train(run, nproc=2, overrides=[*RUN, "train.max_steps=3"], env=hub_env(hub, home, HF_HUB_OFFLINE="1"))
    assert hub.requests == [] and "resume:" in offline.stdout and meta(run, 3)["schema"]["hub_commits"][MODEL] == commit_a

    commit_b = hub.add(MODEL, tiny_model_files(seed=2))  # a push to main
    try:
        refused = run_train(run, nproc=2, overrides=[*RUN, "train.max_steps=4"], env=hub_env(hub, home), check=False)
        assert refused.returncode != 0, refused.stderr[-3000:]  # torchrun exits 1 whatever its workers did
        [line] = error_lines(refused.stderr)
        assert f"{MODEL}@{commit_a}" in line and f"{MODEL}@{commit_b}" in line and "model.name_or_path" in line, line
        warned = run_train(run, nproc=2, overrides=[*RUN, "train.max_steps=4", "ckpt.resume_config_check=warn"],
                           env=hub_env(hub, home))
        warnings = [ln for ln in warned.stdout.splitlines() if commit_b in ln and "warned" in ln]
        assert len(warnings) == 1, warned.stdout[-3000:]
    finally:
        hub.move_branch(MODEL, "main", commit_a)

    out = tmp_path / "hf-export"  # the step-3 checkpoint, trained at commit A, exported with no network
    export = python(["-m", "ckpt", "export", str(run / "checkpoints" / "step-000003"), str(out)],
                    hub_env(hub, home, HF_HUB_OFFLINE="1"))
    assert export.returncode == 0, export.stderr[-3000:]
    assert os.path.isfile(out / "model.safetensors") and os.path.isfile(out / "tokenizer.json")


def test_lora_on_a_hub_base_and_its_merged_export(hub, tmp_path):
    """LoRA adapters on a Hub id base (one process), and the merged export fetching that base at the checkpoint's
    commit into an empty cache, while the Hub's main points elsewhere."""
    run = tmp_path / "run"
    run_train(run, nproc=0, overrides=[*RUN, "train.max_steps=1", "ckpt.interval=1", "model.lora.r=4"],
              env=hub_env(hub, tmp_path / "hf"))
    lora = meta(run, 1)["lora"]
    assert lora["base"] == MODEL and meta(run, 1)["schema"]["hub_commits"] == {MODEL: hub.commits[0]}
    other = hub.add(MODEL, tiny_model_files(seed=3))
    try:
        out = tmp_path / "merged"
        export = python(["-m", "ckpt", "export", str(run / "checkpoints" / "step-000001"), str(out)],
                        hub_env(hub, tmp_path / "fresh-hf"))
        assert export.returncode == 0, export.stderr[-3000:]
        assert os.path.isdir(tmp_path / "fresh-hf" / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / hub.commits[0])
        assert not os.path.isdir(tmp_path / "fresh-hf" / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / other)
        assert os.path.isfile(out / "model.safetensors")
    finally:
        hub.move_branch(MODEL, "main", hub.commits[0])


def test_plan_reads_only_config_json(hub, tmp_path):
    hub.requests.clear()
    plan = python(["train_fsdp.py", "--config", "configs/tiny.yaml", f"model.name_or_path={MODEL}", "--plan"],
                  hub_env(hub, tmp_path / "hf"))
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert f"Hub id {MODEL} at commit {hub.commits[0]}: its config.json only" in plan.stdout
    assert hub.requests and all(path.endswith("/config.json") for _, path in hub.requests), hub.requests
    assert not os.path.exists(tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama" / "blobs" / "model.safetensors")


@pytest.mark.parametrize("case", ["misspelt", "gated", "no_network", "offline_no_cache", "revision"])
def test_one_error_line_names_the_id_and_what_to_do_and_nothing_is_written(hub, tmp_path, case):
    """Plain `python train_fsdp.py`, and torchrun on 2 ranks for the misspelt id (the check runs before any process
    group; local rank 0 asks the Hub, the other rank ends with its message)."""
    hub.requests.clear()
    model, env, more = MODEL, hub_env(hub, tmp_path / "hf"), []
    if case == "misspelt":
        model, expect = "tiny-org/tiny-lama", "the Hub has no model tiny-org/tiny-lama (misspelt?"
    elif case == "gated":
        model, expect = GATED, f"{GATED} is a gated model: accept its terms on its Hub page"
    elif case == "no_network":
        env["HF_ENDPOINT"], expect = f"http://127.0.0.1:{free_port()}", "is not in the Hugging Face cache"
    elif case == "offline_no_cache":
        env["HF_HUB_OFFLINE"], expect = "1", "and HF_HUB_OFFLINE=1: run once with network access"
    else:
        more, expect = ["model.revision=v9"], f"{MODEL} has no revision 'v9': set model.revision"
    run = tmp_path / "run"
    if case == "misspelt":  # under torchrun: local rank 0 asks, rank 1 waits and ends with its line, printed once
        proc = run_train(run, nproc=2, overrides=[f"model.name_or_path={model}"], env=env, check=False)
        assert proc.returncode != 0 and not os.path.exists(run), proc.stderr[-3000:]
        assert [p for _, p in hub.requests if "tiny-lama" in p] == ["/api/models/tiny-org/tiny-lama/revision/main"]
    else:
        proc = python(["train_fsdp.py", "--config", "configs/tiny.yaml", *FAST, f"run.dir={run}",
                       f"data.cache_dir={token_cache()}", f"model.name_or_path={model}", *more], env)
        assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = error_lines(proc.stderr)
    assert line.startswith(f"error: model.name_or_path={model}: ") and expect in line, line
    assert 'train_fsdp.py", line' not in proc.stderr and not os.path.exists(run)  # torchrun's own traceback aside
    assert "Traceback" not in proc.stderr or case == "misspelt"
    if case == "gated":  # the same model with the token it needs
        ok = python(["train_fsdp.py", "--config", "configs/tiny.yaml", f"model.name_or_path={GATED}", "--plan"],
                    {**env, "HF_TOKEN": TOKEN})
        assert ok.returncode == 0, ok.stderr[-2000:]


def test_a_local_folder_wins_over_a_hub_id_of_the_same_name(tmp_path, monkeypatch):
    from common.hub import is_hub_id
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("tiny-org/tiny-llama") and not is_hub_id("/models/x") and not is_hub_id("a/b/c")
    os.makedirs("tiny-org/tiny-llama")
    assert not is_hub_id("tiny-org/tiny-llama")


def test_the_wait_for_another_ranks_file_is_bounded_and_notices_a_dead_peer(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(PeerWaitError, match=r"waited 1 s for the thing \(.*never appeared\)"):
        wait_for_file(str(tmp_path / "f"), "the thing", timeout_s=1.0)
    with pytest.raises(PeerWaitError, match="stopped waiting for the thing: local rank 0 .* has ended"):
        wait_for_file(str(tmp_path / "f"), "the thing", 60.0, lambda: "local rank 0 (pid 1) has ended")
    assert time.monotonic() - t0 < 10
    (tmp_path / "f").write_text("")
    wait_for_file(str(tmp_path / "f"), "the thing", 0.1)


def _local_rank(local_rank: int, behaviour: str, results) -> None:
    """One rank of a 2-rank node (a forked process; its siblings share its parent, as torchrun's workers do)."""
    os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(local_rank), MASTER_PORT=str(os.getppid()))

    def work():
        time.sleep(1.0)
        if behaviour == "dies":
            os._exit(3)
        if behaviour == "fails":
            raise ValueError("local rank 0's one line")
    try:
        once_per_node(work, f"the {behaviour} work", ValueError, timeout_s=60)
        results.put((local_rank, "ok"))
    except ValueError as e:
        results.put((local_rank, str(e)))


@pytest.mark.parametrize("behaviour", ["succeeds", "fails", "dies"])
def test_once_per_node_the_others_wait_for_local_rank_0_and_share_its_end(behaviour):
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_local_rank, args=(r, behaviour, results)) for r in (1, 0)]  # the waiter first
    t0 = time.monotonic()
    for p in ranks:
        p.start()
    for p in reversed(ranks):
        p.join(30)
    got = {}
    while not results.empty():
        rank, outcome = results.get()
        got[rank] = outcome
    assert time.monotonic() - t0 < 20
    if behaviour == "succeeds":
        assert got == {0: "ok", 1: "ok"}
    elif behaviour == "fails":
        assert got == {0: "local rank 0's one line", 1: "local rank 0's one line"}
    else:
        assert got[1].startswith("stopped waiting for the dies work: local rank 0 (pid ") and 0 not in got, got


# ---------------------------------------------------------------- several nodes: one commit, every download awaited

# A node's local rank 0 before any process group: fetch_hub_models as train_fsdp.py calls it, then the commit it holds.
# NO_LOCK: huggingface_hub's blob lock made a no-op, as flock is on NFS with local_lock=flock or Lustre localflock.
LEADER = """
import contextlib, json, sys
if sys.argv[1] == "no-lock":
    import huggingface_hub.file_download as fd
    fd.WeakFileLock = lambda *a, **k: contextlib.nullcontext()
from finetune.config import load_config
from finetune.model_files import ModelError, fetch_hub_models, hub_commits
cfg = load_config("configs/tiny.yaml", ["model.name_or_path=%s"])
try:
    fetch_hub_models(cfg.model)
except ModelError as e:
    print("error:", e)
    sys.exit(2)
print(json.dumps(hub_commits(cfg.model)))
""" % MODEL


def node_leaders(envs: list[dict], lock: str = "lock", timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """One process per "node" (its local rank 0, LOCAL_WORLD_SIZE=1), as torchrun starts it: RANK, GROUP_RANK and
    the launcher's store, here a TCPStore of this test process; `envs[i]`: node i's Hub endpoint and cache."""
    from datetime import timedelta

    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    launch = {"WORLD_SIZE": str(len(envs)), "GROUP_WORLD_SIZE": str(len(envs)), "LOCAL_RANK": "0",
              "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(store.port)}
    procs = [subprocess.Popen([sys.executable, "-c", LEADER, lock], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**os.environ, **launch, **env, "RANK": str(i),
                                                           "GROUP_RANK": str(i)})
             for i, env in enumerate(envs)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outs)]
    finally:
        for p in procs:
            p.kill()


def file_gets(hub) -> list[str]:
    return [path for method, path in hub.requests if method == "GET" and "/resolve/" in path]


@pytest.fixture
def two_commits(hub):
    """hub's MODEL with a second commit, main back at the first after the test."""
    second = hub.add(MODEL, tiny_model_files(seed=2))
    hub.move_branch(MODEL, "main", hub.commits[0])
    yield hub.commits[0], second
    hub.move_branch(MODEL, "main", hub.commits[0])
    hub.after_request = None


def test_nodes_sharing_one_cache_download_once_though_its_lock_does_not_hold(hub, tmp_path):
    """Issue 58 point 3: two nodes, one HF_HOME (a cluster filesystem) whose flock is node-local (here: a no-op).
    One process in the job downloads, the other waits for it and reads the same snapshot: each file fetched once.
    Without that, both write the same blobs at once (twice the requests, and a corrupt blob where the lock is
    really missing)."""
    slow = HubServer(same_hub_as=hub, delay_s=0.3)  # the two would overlap: 6 files x 0.3 s
    try:
        env = hub_env(slow, tmp_path / "hf")
        out = node_leaders([env, env], lock="no-lock")
    finally:
        slow.close()
    for p in out:
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.loads(p.stdout.splitlines()[-1]) == {MODEL: hub.commits[0]}
    assert len(file_gets(slow)) == 6, file_gets(slow)
    assert not [n for n in os.listdir(tmp_path / "hf" / "hub") if n.startswith(".fsdp-finetune")]  # token removed


def test_node_local_offline_caches_at_different_commits_stop_in_one_line_naming_both(hub, tmp_path, two_commits):
    """Issue 58 point 1: HF_HUB_OFFLINE=1 and each node's own cache, filled when main pointed at different commits:
    rank 0's cache says main is A, node 1's says B. The job trains A or nothing: node 1 lacks A, and both nodes end
    with one line naming both commits."""
    a, b = two_commits
    for node, commit in ((0, a), (1, b)):
        hub.move_branch(MODEL, "main", commit)
        filled = python(["-c", f"from common.hub import fetch; fetch({MODEL!r}, '', True)"],
                        hub_env(hub, tmp_path / f"hf{node}"))
        assert filled.returncode == 0, filled.stderr[-2000:]
    hub.requests.clear()
    out = node_leaders([hub_env(hub, tmp_path / f"hf{node}", HF_HUB_OFFLINE="1") for node in (0, 1)])
    assert hub.requests == []
    for p in out:
        assert p.returncode == 2, p.stderr[-3000:]
        [line] = error_lines(p.stdout)
        assert line.startswith(f"error: model.name_or_path={MODEL}: ") and a in line and b in line, line
        assert "the nodes' caches differ" in line, line


def two_node_agents(envs: list[dict], overrides: list[str], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents on this machine as two nodes of one job (static rendezvous on 127.0.0.1, --node_rank i,
    one rank each), node i with `envs[i]` (its Hub endpoint and cache); again on another port if the store's was
    taken."""
    from conftest import FAST, kill_workers, port_was_taken, start_python
    args = [*FAST, *overrides]
    for attempt in range(3):
        port = free_port()
        agents = [start_python(["-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(i),
                                "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                                "train_fsdp.py", "--config", "configs/tiny.yaml", *args], env, ROOT, forked=False)
                  for i, env in enumerate(envs)]
        try:
            outs = [a.communicate(timeout=timeout) for a in agents]
        finally:
            for a in agents:
                if a.returncode is None:
                    kill_workers(a.pid)
                    a.kill()
                    a.communicate()
        if not port_was_taken(["".join(o) for o in outs]) or attempt == 2:
            break
    return [subprocess.CompletedProcess(a.args, a.returncode, *out) for a, out in zip(agents, outs)]


def test_two_nodes_train_one_commit_though_main_moves_and_one_node_downloads_past_the_collective_timeout(
        hub, tmp_path, two_commits):
    """Issue 58 points 1 and 2, on two nodes with their own caches: node 1 reaches the Hub over a slow link (its
    download outlasts train.collective_timeout_minutes, 6 s, more than twice over), and main moves to another commit
    right after rank 0 asked where it points. Both nodes train, and train commit A: rank 0 resolved it once and
    node 1 downloaded that commit; no node entered init_process_group before every download ended. (Before: node 0
    failed in init_process_group after 6 s, and node 1 would have fetched B.)"""
    a, b = two_commits
    slow = HubServer(same_hub_as=hub, delay_s=15.0)  # each file 15 s late (fetched in parallel): 15 s and more
    moved = []

    def push(method, path):
        if "/revision/" in path and not moved:
            moved.append(path)
            hub.move_branch(MODEL, "main", b)
    hub.after_request = slow.after_request = push
    hub.requests.clear()
    run = tmp_path / "run"
    try:
        nodes = two_node_agents([hub_env(hub, tmp_path / "hf0"),  # node 1: a slow link, not a dead one
                                 hub_env(slow, tmp_path / "hf1", HF_HUB_DOWNLOAD_TIMEOUT="60")],
                                [*RUN, f"run.dir={run}", f"data.cache_dir={token_cache()}", "train.hang_timeout=0",
                                 "train.collective_timeout_minutes=0.1"])
    finally:
        slow.close()
    for i, node in enumerate(nodes):
        assert node.returncode == 0, f"node {i}\n{node.stdout[-3000:]}\n{node.stderr[-5000:]}"
    assert moved == [f"/api/models/{MODEL}/revision/main"]  # asked once, by rank 0
    assert not [p for _, p in slow.requests if "/revision/" in p], slow.requests
    for server in (hub, slow):
        gets = file_gets(server)
        assert len(gets) == 6 and all(f"/resolve/{a}/" in p for p in gets), gets
    assert meta(run, 2)["schema"]["hub_commits"] == {MODEL: a}


def _commits_rank(rank: int, port: int, q) -> None:
    """Worker of the mismatch test: rank r holds commit "r" * 40 of MODEL (as if resolved by itself)."""
    import torch.distributed as dist

    import finetune.model_files as model_files
    from finetune.config import load_config
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [f"model.name_or_path={MODEL}"])
    model_files.hub_commits = lambda cfg_model: {MODEL: ("a" if rank == 0 else "b") * 40}
    q.put((rank, model_files.hub_commit_mismatch(cfg.model)))
    model_files.hub_commits = lambda cfg_model: {MODEL: "a" * 40}
    q.put((rank, model_files.hub_commit_mismatch(cfg.model)))
    dist.destroy_process_group()


def test_after_the_process_group_a_rank_with_another_commit_is_named_on_every_rank():
    """Issue 58 point 1's net (a launcher without a store: each node resolved by itself): every rank gets one line
    naming both commits; the same commits pass."""
    import torch.multiprocessing as mp

    from forked_run import start_ranks
    q = mp.get_context("spawn").Queue()
    port = free_port()
    ranks = start_ranks(_commits_rank, (port, q), 2, join=False)  # from the fork server, imports done
    got = [q.get(timeout=120) for _ in range(4)]
    ranks.join(30)
    lines = [line for _, line in got if line]
    assert len(lines) == 2 and lines[0] == lines[1], got
    assert lines[0].startswith(f"model.name_or_path={MODEL}: the ranks would train different weights: rank 0 (") \
        and "a" * 40 in lines[0] and f"rank 1 (" in lines[0] and "b" * 40 in lines[0], lines[0]
    assert sum(line is None for _, line in got) == 2


STALE = """
import filelock, sys
import huggingface_hub.constants as constants
import huggingface_hub.utils._fixes as fixes
import common.hub
fixes.FileLock = filelock.SoftFileLock  # a filesystem without flock: huggingface_hub's lock-file fallback
constants.FILELOCK_LOG_EVERY_SECONDS = 0.5
common.hub.STALE_LOCK_S = float(sys.argv[1])
from finetune.config import load_config
from finetune.model_files import ModelError, fetch_hub_models
try:
    fetch_hub_models(load_config("configs/tiny.yaml", ["model.name_or_path=%s"]).model)
except ModelError as e:
    print("error:", e)
    sys.exit(2)
""" % MODEL


def test_a_lock_left_by_a_killed_download_is_named_in_one_line(hub, tmp_path):
    """Issue 58 point 3: where flock is missing, huggingface_hub falls back to lock files; a download killed
    mid-way (here: a lock file of a holder on another host, whose blob never grew) made every later run wait for
    ever. Now: one line naming the lock and how to remove it, once the blob it guards has not changed for
    STALE_LOCK_S (2 s here); and after its removal the same command downloads."""
    import hashlib
    home = tmp_path / "hf"
    config = hub.repos[MODEL][hub.commits[0]]["config.json"]
    lock = home / "hub" / ".locks" / "models--tiny-org--tiny-llama" / f"{hashlib.sha1(config).hexdigest()}.lock"
    os.makedirs(lock.parent)
    lock.write_text("4242\nanother-node\n1\n")  # filelock's SoftFileLock marker: pid, host, token
    old = time.time() - 60
    os.utime(lock, (old, old))
    t0 = time.monotonic()
    stuck = python(["-c", STALE, "2"], hub_env(hub, home), timeout=120)
    assert stuck.returncode == 2 and time.monotonic() - t0 < 60, stuck.stderr[-3000:]
    [line] = error_lines(stuck.stdout)
    assert line.startswith(f"error: model.name_or_path={MODEL}: the Hugging Face cache lock {lock} is held by no "
                           "live download") and f"rm '{lock}'" in line, line
    os.remove(lock)
    again = python(["-c", STALE, "2"], hub_env(hub, home), timeout=120)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
