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

import contextlib
import functools
import glob
import logging
import os
import re
import time

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "*.tiktoken",
                   "chat_template.jinja", "chat_template.json")
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")
_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# A lock whose download has not written a byte for this long has no live holder: a download writes its
# `.incomplete` file every few seconds, however slow the link (huggingface_hub logs a wait every 10 s).
STALE_LOCK_S = 300.0
_WAITING = re.compile(r"Still waiting to acquire lock on (.+) \(elapsed: ([\d.]+) seconds\)")


class HubError(Exception):
    """A Hub id that cannot be fetched: the message says why and what to do (its caller names the config key)."""


class StaleLockError(Exception):
    """A blob's lock in the cache that no live download holds (raised inside huggingface_hub's wait for it)."""


def is_hub_id(value: str) -> bool:
    """`org/name` that is not a path existing here (a local folder of that name wins)."""
    return bool(value) and _ID.fullmatch(value) is not None and ".." not in value and not os.path.exists(value)


def patterns(weights: bool) -> list[str]:
    return [*CONFIG_FILES, *TOKENIZER_FILES, *(WEIGHT_FILES if weights else ())]


def _snapshot(repo_id: str, revision: str, weights: bool, cache_only: bool) -> str:
    from huggingface_hub import snapshot_download

    try:  # top level only ("*/*" ignored): a repo's original/ or onnx/ folders hold other copies of the weights
        with _stale_locks_end_the_wait():
            return snapshot_download(repo_id, revision=revision or None, allow_patterns=patterns(weights),
                                     ignore_patterns=["*/*"], local_files_only=cache_only)
    except Exception as e:  # noqa: BLE001 - every failure becomes one line naming what to do
        raise HubError(explain(repo_id, revision, e)) from None


def resolve(repo_id: str, revision: str) -> str:
    """The commit `revision` ("" = the default branch) of `repo_id` is at now: asked of the Hub (one request; a
    commit is returned as is), or, offline or with the Hub unreachable, read from this cache's refs/."""
    from huggingface_hub import HfApi, constants

    try:  # "" -> main, as snapshot_download asks it
        return HfApi().resolve_revision(repo_id, revision=revision or constants.DEFAULT_REVISION).resolved
    except Exception as e:  # noqa: BLE001 - every failure becomes one line naming what to do
        raise HubError(explain(repo_id, revision, e)) from None


def cached_ref(repo_id: str, revision: str) -> str | None:
    """The commit this machine's cache records for `revision` ("" = main) of `repo_id`, or None."""
    from huggingface_hub.file_download import repo_folder_name

    ref = os.path.join(cache_dir(), repo_folder_name(repo_id=repo_id, repo_type="model"), "refs", revision or "main")
    try:
        with open(ref) as f:
            return f.read().strip() or None
    except OSError:
        return None


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


@contextlib.contextmanager
def _stale_locks_end_the_wait():
    """huggingface_hub waits for a blob's lock for ever, logging every 10 s. Where flock is missing it falls back to
    lock files, and a download killed mid-way leaves one behind: every later run would wait on it. Here its
    wait line (in the waiting thread) raises StaleLockError once the file the lock guards has not changed for
    STALE_LOCK_S; the wait lines themselves stay unprinted, as at huggingface_hub's default verbosity."""
    logger = logging.getLogger("huggingface_hub.utils._fixes")
    level, check = logger.level, _StaleLockCheck(logger.getEffectiveLevel())
    logger.setLevel(logging.INFO)
    logger.addFilter(check)
    try:
        yield
    finally:
        logger.removeFilter(check)
        logger.setLevel(level)


class _StaleLockCheck(logging.Filter):
    def __init__(self, shown_from: int):
        super().__init__()
        self.shown_from = shown_from

    def filter(self, record: logging.LogRecord) -> bool:
        waiting = _WAITING.match(record.getMessage())
        if waiting is None:
            return record.levelno >= self.shown_from
        lock = waiting.group(1)
        still = time.time() - _last_write(lock)
        if float(waiting.group(2)) >= STALE_LOCK_S and still >= STALE_LOCK_S:
            raise StaleLockError(
                f"the Hugging Face cache lock {lock} is held by no live download: the file it guards has not changed "
                f"for {still:.0f} s (a download killed mid-way, on a filesystem without flock). If no other job is "
                f"downloading into {cache_dir()} now, remove it (rm '{lock}') and start again")
        return False


def _last_write(lock: str) -> float:
    """When the download `lock` guards last wrote: its blob's `.incomplete` file, else the lock file itself."""
    locks, name = os.path.split(lock)
    blob = os.path.join(cache_dir(), os.path.basename(locks), "blobs", name.removesuffix(".lock") + ".incomplete")
    for path in (blob, lock):
        with contextlib.suppress(OSError):
            return os.path.getmtime(path)
    return time.time()  # gone meanwhile: released


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def explain(repo_id: str, revision: str, e: Exception) -> str:
    """One line for a huggingface_hub failure: what happened to `repo_id` and what the user can do."""
    from huggingface_hub import constants, errors

    at = f" at revision {revision!r} (model.revision)" if revision else ""
    if re.fullmatch(r"[0-9a-f]{40}", revision or ""):  # a commit: the job's own (model_files), or model.revision's
        at = f" at commit {revision}"
    if isinstance(e, StaleLockError):
        return str(e)
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
    if isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, errors.RevisionResolutionError)):
        why = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        return (f"{repo_id}{at} is not in the Hugging Face cache ({cache_dir()}) and {why}: run once with network "
                "access (the same command fills the cache), or point the key at a local model folder")
    if isinstance(e, errors.HfHubHTTPError) and e.response is not None:
        return f"the Hub answered {e.response.status_code} for {repo_id}{at}: {str(e).splitlines()[0]}"
    return f"cannot fetch {repo_id}{at} into {cache_dir()}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
