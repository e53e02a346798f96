"""Where the model keys' files are on this machine: a local folder as given, or a Hub id's snapshot in the Hugging
Face cache, fetched once per node before any process group.

    python -m pytest tests/test_hub.py -q

model.name_or_path, model.config_path and model.tokenizer_path each take a folder or a Hub id (`org/name`; a folder
of that name wins). model.revision pins the model's id (name_or_path, else config_path) to a branch, tag or commit,
and a tokenizer_path naming the same id; another tokenizer id is read at its default branch. name_or_path fetches the
weights too (safetensors); config_path and tokenizer_path only config and tokenizer files (common/hub.py).
"""

from __future__ import annotations

from common.hub import HubError, cached, fetch, is_hub_id
from common.peer_wait import once_per_node
from finetune.shards import ModelError

# How long a node's other ranks wait for local rank 0's download while that process lives: 140 GB (70B in bf16)
# at 100 Mbit/s takes about 3 hours. A dead local rank 0 ends the wait at once.
HUB_DOWNLOAD_WAIT_S = 6 * 3600.0


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
    """Download the Hub ids among the model keys into the Hugging Face cache: local rank 0 of each node fetches,
    the node's other ranks wait for it (bounded, a dead local rank 0 noticed); a failure is one ModelError on every
    rank, naming the key and the id."""
    keys = hub_keys(cfg_model)
    if not keys:
        return

    def fetch_all():
        for key, weights in keys.items():
            try:
                fetch(_value(cfg_model, key), _revision(cfg_model, key), weights)
            except HubError as e:
                raise ModelError(f"{key}={_value(cfg_model, key)}: {e}") from None

    ids = ", ".join(sorted({_value(cfg_model, k) for k in keys}))
    once_per_node(fetch_all, f"local rank 0's download of {ids} from the Hugging Face Hub", ModelError,
                  HUB_DOWNLOAD_WAIT_S)


def _snapshot(cfg_model, key: str) -> tuple[str, str]:
    weights = key == "model.name_or_path"
    try:
        return cached(_value(cfg_model, key), _revision(cfg_model, key), weights)
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
