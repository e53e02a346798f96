"""Hugging Face Hub model ids (`org/name`) where a model folder is expected: which values are ids, and the files a
run needs, fetched through huggingface_hub into the user's Hugging Face cache (HF_HOME) at a revision.

    python -m pytest tests/test_hub.py -q

A path that exists here wins over an id spelt the same. huggingface_hub does every request and honours HF_TOKEN,
HF_HUB_OFFLINE, HF_ENDPOINT and HF_HOME; its errors become one HubError line saying what to do. What is fetched:
config.json, generation_config.json, the tokenizer's files and, where the weights are wanted, the top-level
safetensors files and their index; never .bin/.pth/.gguf copies of the same weights. Below ckpt/ and finetune/:
training fetches (finetune/model_files.py), and an export finds a Hub-id checkpoint's model in the cache, or
fetches it, at the commit the checkpoint recorded (ckpt/reading.py). docs/hub.md has the rules.
"""

from __future__ import annotations

import functools
import glob
import os
import re

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "*.tiktoken",
                   "chat_template.jinja", "chat_template.json")
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")
_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class HubError(Exception):
    """A Hub id that cannot be fetched: the message says why and what to do (its caller names the config key)."""


def is_hub_id(value: str) -> bool:
    """`org/name` that is not a path existing here (a local folder of that name wins)."""
    return bool(value) and _ID.fullmatch(value) is not None and ".." not in value and not os.path.exists(value)


def patterns(weights: bool) -> list[str]:
    return [*CONFIG_FILES, *TOKENIZER_FILES, *(WEIGHT_FILES if weights else ())]


def _snapshot(repo_id: str, revision: str, weights: bool, cache_only: bool) -> str:
    from huggingface_hub import snapshot_download

    try:  # top level only ("*/*" ignored): a repo's original/ or onnx/ folders hold other copies of the weights
        return snapshot_download(repo_id, revision=revision or None, allow_patterns=patterns(weights),
                                 ignore_patterns=["*/*"], local_files_only=cache_only)
    except Exception as e:  # noqa: BLE001 - every failure becomes one line naming what to do
        raise HubError(explain(repo_id, revision, e)) from None


def fetch(repo_id: str, revision: str, weights: bool) -> tuple[str, str]:
    """(snapshot folder in the cache, commit) of `repo_id` at `revision` ("" = its default branch): what is not
    cached yet is downloaded; offline (HF_HUB_OFFLINE=1, or no network) the cache answers alone."""
    folder = _snapshot(repo_id, revision, weights, cache_only=False)
    if weights and not glob.glob(os.path.join(folder, "*.safetensors")):
        raise HubError(f"the Hub model has no safetensors weights at commit {os.path.basename(folder)} (.bin/.pth "
                       "are not read here): pick a revision or a model with *.safetensors")
    return folder, os.path.basename(folder)


@functools.lru_cache(maxsize=16)
def cached(repo_id: str, revision: str, weights: bool) -> tuple[str, str]:
    """fetch() from the cache alone (no request): for the ranks that waited for their node's download, and for
    every later use of the same id in this process. Raises HubError if it is not (completely) cached."""
    folder = _snapshot(repo_id, revision, weights, cache_only=True)
    return folder, os.path.basename(folder)


def config_file(repo_id: str, revision: str) -> str:
    """The local path of `repo_id`'s config.json at `revision`, fetching that one file (the planner's only need)."""
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id, "config.json", revision=revision or None)
    except Exception as e:  # noqa: BLE001
        raise HubError(explain(repo_id, revision, e)) from None


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def explain(repo_id: str, revision: str, e: Exception) -> str:
    """One line for a huggingface_hub failure: what happened to `repo_id` and what the user can do."""
    from huggingface_hub import constants, errors

    at = f" at revision {revision!r} (model.revision)" if revision else ""
    if isinstance(e, errors.GatedRepoError):
        return (f"{repo_id} is a gated model: accept its terms on its Hub page with your account, then set HF_TOKEN to "
                "a token of that account (huggingface-cli login also works)")
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{repo_id} has no revision {revision!r}: set model.revision to one of its branches, tags or commits"
    if isinstance(e, errors.RepositoryNotFoundError):
        return (f"no local folder of that name, and the Hub has no model {repo_id} (misspelt? a private model needs "
                "HF_TOKEN set to a token that can read it)")
    if isinstance(e, errors.RemoteEntryNotFoundError):
        return f"{repo_id}{at} has no config.json: not a transformers model"
    if isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        why = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        return (f"{repo_id}{at} is not in the Hugging Face cache ({cache_dir()}) and {why}: run once with network "
                "access (the same command fills the cache), or point the key at a local model folder")
    if isinstance(e, errors.HfHubHTTPError) and e.response is not None:
        return f"the Hub answered {e.response.status_code} for {repo_id}{at}: {str(e).splitlines()[0]}"
    return f"cannot fetch {repo_id}{at} into {cache_dir()}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
