"""Hugging Face Hub model ids in model.name_or_path (and config_path, tokenizer_path), against a local stand-in for
the Hub (tests/hub_server.py, huggingface_hub pointed at it through HF_ENDPOINT): a run, its offline resume, the
refusal of another commit, --plan's one file, the exports, and the error lines.

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
