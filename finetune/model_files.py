"""Where the model keys' files are on this machine: a local folder as given, or a Hub id's snapshot in the Hugging
Face cache, fetched once per node before any process group, at one commit for the whole job.

    python -m pytest tests/test_hub.py -q

model.name_or_path, model.config_path and model.tokenizer_path each take a folder or a Hub id (`org/name`; a folder
of that name wins). model.revision pins the model's id (name_or_path, else config_path) to a branch, tag or commit,
and a tokenizer_path naming the same id; another tokenizer id is read at its default branch. name_or_path fetches the
weights too (safetensors); config_path and tokenizer_path only config and tokenizer files (common/hub.py).

One set of weights for every node (fetch_hub_models, local rank 0 of each node, through the launcher's store, no
process group needed; docs/multinode.md):
1. global rank 0 resolves each id's revision to a commit, once for the job; the other nodes wait for its answer
   (common/handoff.py one_rank_builds: as long as rank 0 lives);
2. each node downloads exactly that commit (`revision=<sha>`) into its Hugging Face cache; a node whose cache is
   rank 0's (a cache on a filesystem both mount: rank 0's fresh token file is seen there) downloads nothing, so one
   process in the job writes a shared cache, whatever its filesystem's locks do;
3. every node waits for every node's download (handoff.each_builds: as long as the downloaders live), so no node
   enters init_process_group, which gives up after train.collective_timeout_minutes, while another downloads;
4. once the process group exists, `hub_commit_mismatch` compares every rank's commits with rank 0's (the net under
   a launcher without a store, where each node resolved by itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket

import torch.distributed as dist

from common.dist import first_problem, torchrun_restart
from common.handoff import each_builds, one_rank_builds
from common.hub import HubError, cache_dir, cached, cached_ref, fetch, is_hub_id, resolve
from common.peer_wait import once_per_node
from finetune.launch import launch_node, launch_rank, launcher_store
from finetune.shards import ModelError

# How long a node's other ranks wait for local rank 0's download: as long as it lives (it waits in turn for every
# node's download, as long as the downloaders live; 140 GB at 100 Mbit/s takes about 3 hours). A dead local rank 0
# ends the wait at once.
HUB_DOWNLOAD_WAIT_S = float("inf")
_PINNED: dict[str, str] = {}  # "id@revision" -> the commit this job trains (every rank, after fetch_hub_models)


def used_keys(cfg_model) -> dict[str, bool]:
    """{config key: whether its weights are read} of the model keys this run reads files from."""
    keys = {"model.name_or_path": True} if cfg_model.name_or_path else {"model.config_path": False}
    if cfg_model.tokenizer_path:
        keys["model.tokenizer_path"] = False
    return keys


def _value(cfg_model, key: str) -> str:
    return getattr(cfg_model, key.split(".")[1])


def _revision(cfg_model, key: str) -> str:
    """model.revision for the model's own id (and a tokenizer_path naming the same id); "" for another id."""
    source = cfg_model.name_or_path or cfg_model.config_path
    return cfg_model.revision if _value(cfg_model, key) == source else ""


def hub_keys(cfg_model) -> dict[str, bool]:
    """used_keys whose value is a Hub id."""
    return {k: w for k, w in used_keys(cfg_model).items() if is_hub_id(_value(cfg_model, k))}


def fetch_hub_models(cfg_model) -> None:
    """Download the Hub ids among the model keys into the Hugging Face cache, each at the one commit the job's rank
    0 resolved (module docstring); the node's other ranks wait for their local rank 0 (as long as it lives). A
    failure is one ModelError on every rank, naming the key and the id."""
    keys = hub_keys(cfg_model)
    if not keys:
        return
    ids = ", ".join(sorted({_value(cfg_model, k) for k in keys}))
    _PINNED.update(json.loads(once_per_node(lambda: json.dumps(_fetch_on_node(cfg_model, keys, ids)),
                                            f"local rank 0's download of {ids} from the Hugging Face Hub", ModelError,
                                            HUB_DOWNLOAD_WAIT_S)))


def _pin(cfg_model, key: str) -> str:
    return f"{_value(cfg_model, key)}@{_revision(cfg_model, key)}"


def _fetch_on_node(cfg_model, keys: dict[str, bool], ids: str) -> dict[str, str]:
    """Local rank 0 of a node: steps 1-3 of the module docstring; {id@revision: commit}."""
    store, (node, nodes), say = launcher_store(), launch_node(), lambda m: print(m, flush=True)
    restart = torchrun_restart()
    resolved = json.loads(one_rank_builds(lambda: _resolve(cfg_model, keys, store is not None), 0,
                                          f"hub/{restart}/resolve", f"the commits of {ids}", ModelError,
                                          store=store, rank=launch_rank(), log=say))
    pins, token = resolved["pins"], resolved["token"]
    # rank 0's cache is this node's own when rank 0's token is in it: a token seen at another path is not
    rank0s_cache = bool(token) and launch_rank() != 0 and os.path.exists(os.path.join(cache_dir(),
                                                                                     os.path.basename(token)))

    def download() -> None:
        for key, weights in keys.items():
            if rank0s_cache:
                continue
            try:
                fetch(_value(cfg_model, key), pins[_pin(cfg_model, key)], weights)
            except HubError as e:
                raise ModelError(f"{key}={_value(cfg_model, key)}: {e}{_other_ref(cfg_model, key, pins)}") from None
    try:
        if store is None:
            download()
        else:
            each_builds(download, node, nodes, f"hub/{restart}/download", f"{ids} (every node's download)",
                        ModelError, store=store, rank=launch_rank(), log=say)
    finally:
        if token and launch_rank() == 0:
            with contextlib.suppress(OSError):
                os.remove(token)
    return pins


def _resolve(cfg_model, keys: dict[str, bool], mark_cache: bool) -> str:
    """Rank 0: {"pins": {id@revision: commit}, "token": a fresh file in this cache that the nodes sharing it see}."""
    pins = {}
    for key in keys:
        try:
            pins[_pin(cfg_model, key)] = resolve(_value(cfg_model, key), _revision(cfg_model, key))
        except HubError as e:
            raise ModelError(f"{key}={_value(cfg_model, key)}: {e}") from None
    token = ""
    if mark_cache:
        with contextlib.suppress(OSError):  # a cache rank 0 cannot write to: every node reads its own
            os.makedirs(cache_dir(), exist_ok=True)
            token = os.path.join(cache_dir(), f".fsdp-finetune-rank0-{os.urandom(8).hex()}")
            with open(token, "w") as f:
                f.write(socket.gethostname())
    return json.dumps({"pins": pins, "token": token})


def _other_ref(cfg_model, key: str, pins: dict[str, str]) -> str:
    """Why this node lacks the job's commit, when its cache records another for the same revision (offline)."""
    mine = cached_ref(_value(cfg_model, key), _revision(cfg_model, key))
    want = pins[_pin(cfg_model, key)]
    if mine is None or mine == want:
        return ""
    return (f" (rank 0 resolved {_revision(cfg_model, key) or 'main'} to commit {want}; this node's cache, on "
            f"{socket.gethostname()}, has it at commit {mine}: the nodes' caches differ, so the nodes would train "
            "different weights; fill them from one commit, or set model.revision to one commit both hold)")


def _snapshot(cfg_model, key: str) -> tuple[str, str]:
    """(folder, commit) of `key`'s Hub id in the cache, at the job's commit (fetch_hub_models), else at the revision."""
    weights = key == "model.name_or_path"
    try:
        return cached(_value(cfg_model, key), _PINNED.get(_pin(cfg_model, key), _revision(cfg_model, key)), weights)
    except HubError as e:
        raise ModelError(f"{key}={_value(cfg_model, key)}: {e}") from None


def model_folder(cfg_model, key: str) -> str:
    """The local folder of config `key`'s value: the value itself, or for a Hub id its snapshot in the cache
    (fetched by fetch_hub_models, or by an earlier run: no request is made here)."""
    return _snapshot(cfg_model, key)[0] if key in hub_keys(cfg_model) else _value(cfg_model, key)


def hub_commits(cfg_model) -> dict[str, str]:
    """{Hub id: the commit its snapshot holds} of the Hub ids this run reads (meta.json's schema records it)."""
    return {_value(cfg_model, key): _snapshot(cfg_model, key)[1] for key in hub_keys(cfg_model)}


def hub_commit_changes(saved: dict[str, str], cfg_model) -> list[tuple[str, str, str]]:
    """(config key, the checkpoint's id@commit, this run's) for each Hub id this run reads that the checkpoint
    (`saved`: its hub_commits) trained on at another commit."""
    out = []
    for key in hub_keys(cfg_model):
        repo = _value(cfg_model, key)
        mine = _snapshot(cfg_model, key)[1]
        if saved.get(repo) and saved[repo] != mine:
            out.append((key, f"{repo}@{saved[repo]}", f"{repo}@{mine}"))
    return out


def hub_commit_mismatch(cfg_model) -> str | None:
    """One line if some rank holds another commit of a Hub id than rank 0, else None. A collective on the default
    group: one broadcast of rank 0's commits and one 1-float all-reduce (common/dist.py first_problem)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or not hub_keys(cfg_model):
        return None
    mine = hub_commits(cfg_model)
    first = [(mine, socket.gethostname())]
    dist.broadcast_object_list(first, src=0)
    theirs, host0 = first[0]
    problem = None
    for key in hub_keys(cfg_model):
        repo = _value(cfg_model, key)
        if theirs.get(repo) != mine[repo]:
            problem = (f"{key}={repo}: the ranks would train different weights: rank 0 ({host0}) holds commit "
                       f"{theirs.get(repo)}, rank {dist.get_rank()} ({socket.gethostname()}) commit {mine[repo]} "
                       "(node-local Hugging Face caches whose refs differ, or a push between their downloads); set "
                       "model.revision to one commit, or give every node the same cache")
            break
    return first_problem(problem, None)
