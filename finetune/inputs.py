"""The checks of a run's inputs that every rank makes, identically and in milliseconds, before any process group:
the torch and transformers releases (common/versions.py), the launch, the model and tokenizer folders, the attention
kernel, model.compile's compiler, the local data files; the download of Hub model ids, once per node, which is
not milliseconds (finetune/model_files.py: one commit for the job, every node's download awaited); and, once the
process group exists, that the folders every node writes into and reads from are one folder on every node
(`check_shared_folders`, common/shared_paths.py) and that every rank holds the same commit of each Hub id
(`check_same_hub_commits`).

    python -m pytest tests/test_launch.py -q

A mistake found here costs no model build and no tokenization, and under torchrun it is reported once
(finetune/launch.py). What needs the data's contents (empty rows, columns, sizes) is found later, on rank 0.
"""

from __future__ import annotations

import os

from ckpt.storage import is_url
from common.shared_paths import unshared_path_problem
from common.versions import unsupported_versions
from finetune.config import Config, ConfigError
from finetune.data.errors import DataError
from finetune.data.sources import is_local_path, sources
from finetune.launch import accelerate_world_problem
from finetune.model import ModelError, check_attn_implementation, check_compile, check_model_folder
from finetune.model_files import fetch_hub_models, hub_commit_mismatch


def check_inputs(cfg: Config) -> None:
    """Raise ConfigError / ModelError / DataError for the first input that cannot work."""
    problem = unsupported_versions() or accelerate_world_problem()
    if problem:
        raise ConfigError(problem)
    check_attn_implementation(cfg.model)
    check_compile(cfg.model)
    check_data_files(cfg)
    fetch_hub_models(cfg.model)  # Hub ids: one commit; each node downloads it (minutes) and waits for every node
    check_model_folder(cfg.model)


def check_data_files(cfg: Config) -> None:
    """Every local data file named by data.path / data.mixture / data.eval_path exists (hub names are not checked:
    only `datasets` can resolve them)."""
    pairs = sources(cfg.data)
    if cfg.data.eval_path and not cfg.data.eval_path.startswith("split:"):
        pairs += sources(cfg.data, eval_set=True)
    for src, _ in pairs:
        if not is_local_path(src.path):
            continue
        for path in (p.strip() for p in src.path.split(",") if p.strip()):
            if not os.path.exists(path):
                raise DataError(f"data file not found: {path}")


def check_shared_folders(cfg: Config) -> None:
    """run.dir, data.cache_dir and a local ckpt.dir must be one folder on every node (rank 0 writes the data cache
    and the commit markers there, every rank reads and writes beside it); ConfigError naming the first that is not.
    ckpt.memory_dir is node-local by design and not checked (docs/multinode.md has the table). A collective."""
    folders = {"run.dir": cfg.run.dir, "data.cache_dir": cfg.data.cache_dir}
    if not is_url(cfg.ckpt.dir):
        folders["ckpt.dir"] = cfg.ckpt.dir
    problem = unshared_path_problem(folders, {"ckpt.dir": ", or use an object store (ckpt.dir=s3://bucket/prefix or "
                                                          "az://container/prefix)"})
    if problem:
        raise ConfigError(problem)


def check_same_hub_commits(cfg: Config) -> None:
    """Every rank holds the commit rank 0 holds of each Hub id among the model keys; ModelError naming both
    commits otherwise. A collective."""
    problem = hub_commit_mismatch(cfg.model)
    if problem:
        raise ModelError(problem)
