"""Data: local files -> tokenized fixed-length samples -> a world-size independent global order.

    python -m pytest tests/test_data.py

The order of samples is a pure function of (seed, epoch, global sample index), so the only data
state a checkpoint needs is one integer: how many samples the whole job has consumed. Rank r of W
takes a contiguous slice of each global batch, so the union over ranks of global batch b is the same
set of samples for any W, and resuming at another world size continues the exact same stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass

import numpy as np
import torch

IGNORE = -100  # label value that carries no loss (prompt and padding tokens)
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}


class DataError(ValueError):
    """A problem with the data set or its sizes; the message says what to change."""


# ---------------------------------------------------------------- loading and tokenizing

def load_documents(path: str):
    """A HF `datasets.Dataset` from local files (comma-separated) or, when online, a hub name."""
    import datasets

    files = [p.strip() for p in path.split(",") if p.strip()]
    exts = {os.path.splitext(p)[1] for p in files}
    looks_local = all(e in _FILE_BUILDERS for e in exts) or any(os.path.sep in p for p in files)
    if looks_local:
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise DataError(f"data file not found: {missing[0]}")
        empty = [p for p in files if os.path.getsize(p) == 0]
        if empty:  # datasets would fail with a bare StopIteration
            raise DataError(f"data file is empty: {empty[0]}")
        if len(exts) != 1 or next(iter(exts)) not in _FILE_BUILDERS:
            raise DataError(f"data files must share one of the extensions {sorted(_FILE_BUILDERS)}, got {sorted(exts)}")
        try:
            ds = datasets.load_dataset(_FILE_BUILDERS[exts.pop()], data_files=files, split="train")
        except Exception as e:  # noqa: BLE001 - a parse error should name the file, not datasets' internals
            raise DataError(f"cannot read data file(s) {path}: {type(e).__name__}: {e}") from None
        if len(ds) == 0:
            raise DataError(f"data set {path} is empty")
        return ds
    return datasets.load_dataset(path, split="train")  # hub name: needs network


def _chat_template_ids(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Ids of the rendered conversation, and labels that are IGNORE everywhere except assistant turns."""
    ids = _chat_template_ids(tokenizer, messages)
    labels = [IGNORE] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _chat_template_ids(tokenizer, messages[:i], add_generation_prompt=True)
        start, end = len(prompt), len(_chat_template_ids(tokenizer, messages[: i + 1]))
        if ids[:start] != prompt:
            raise DataError("the chat template does not render conversations prefix-consistently; cannot mask prompts")
        labels[start:end] = ids[start:end]
    return ids, labels


def tokenize_text(tokenizer, text: str) -> tuple[list[int], list[int]]:
    ids = tokenizer(text)["input_ids"]
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids = ids + [tokenizer.eos_token_id]
    return ids, list(ids)


def to_samples(docs: list[tuple[list[int], list[int]]], seq_len: int, pack: bool, pad_id: int):
    """Fixed-length (input_ids, labels) int32 arrays of shape [N, seq_len].

    pack=False: one document per sample, truncated or right-padded (labels IGNORE on padding).
    pack=True: documents concatenated in order and cut into seq_len chunks; the tail is dropped.
    """
    if pack:
        ids = np.fromiter((t for d, _ in docs for t in d), dtype=np.int32)
        labels = np.fromiter((t for _, lab in docs for t in lab), dtype=np.int32)
        n = len(ids) // seq_len
        return ids[: n * seq_len].reshape(n, seq_len), labels[: n * seq_len].reshape(n, seq_len)
    ids = np.full((len(docs), seq_len), pad_id, dtype=np.int32)
    labels = np.full((len(docs), seq_len), IGNORE, dtype=np.int32)
    for i, (d, lab) in enumerate(docs):
        d, lab = d[:seq_len], lab[:seq_len]
        ids[i, : len(d)] = d
        labels[i, : len(lab)] = lab
    return ids, labels


def _cache_key(cfg_data, tokenizer, fmt: str) -> str:
    files = [p.strip() for p in cfg_data.path.split(",")]
    stats = [(p, os.path.getsize(p), os.path.getmtime(p)) if os.path.isfile(p) else (p,) for p in files]
    vocab = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    blob = json.dumps([stats, vocab, str(tokenizer.chat_template), fmt, cfg_data.seq_len, cfg_data.pack,
                       cfg_data.text_field, cfg_data.messages_field])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cache_samples(cfg_data, tokenizer) -> str:
    """Tokenize the data set into <cache_dir>/<hash>/{input_ids,labels}.npy unless already there.

    Run on one rank; the others open the same folder (a shared filesystem, as for checkpoints).
    """
    key = _cache_key(cfg_data, tokenizer, cfg_data.format)
    cache = os.path.join(cfg_data.cache_dir, key)
    if os.path.exists(os.path.join(cache, "labels.npy")):
        return cache
    ds = load_documents(cfg_data.path)
    fmt = cfg_data.format
    if fmt == "auto":
        fmt = "chat" if cfg_data.messages_field in ds.column_names else "text"
    field_name = cfg_data.messages_field if fmt == "chat" else cfg_data.text_field
    if field_name not in ds.column_names:
        raise DataError(f"data set {cfg_data.path} has no column '{field_name}' (columns: {ds.column_names})")
    if fmt == "text" and not isinstance(ds[0][field_name], str):
        raise DataError(f"column '{field_name}' of {cfg_data.path} holds {type(ds[0][field_name]).__name__}, not text; "
                        "set data.format=chat for a messages column, or data.text_field to a text column")
    fn = tokenize_chat if fmt == "chat" else tokenize_text
    docs = [fn(tokenizer, row) for row in ds[field_name]]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    ids, labels = to_samples(docs, cfg_data.seq_len, cfg_data.pack, pad)
    if len(ids) == 0:
        raise DataError(f"data set {cfg_data.path} yields no samples of seq_len={cfg_data.seq_len}")
    tmp = cache + f".tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    np.save(os.path.join(tmp, "input_ids.npy"), ids)
    np.save(os.path.join(tmp, "labels.npy"), labels)
    if os.path.exists(cache):  # an earlier crash left a partial folder
        shutil.rmtree(cache)
    os.replace(tmp, cache)  # atomic: a crash mid-write never leaves a half cache behind
    return cache


def open_samples(cache: str) -> tuple[np.ndarray, np.ndarray]:
    """Memory-map a tokenized cache: ranks share the pages instead of each holding a copy."""
    return (np.load(os.path.join(cache, "input_ids.npy"), mmap_mode="r"),
            np.load(os.path.join(cache, "labels.npy"), mmap_mode="r"))


# ---------------------------------------------------------------- order and batching

@dataclass(frozen=True)
class BatchPlan:
    """How one global batch is split: ranks x accumulation steps x micro batch."""
    global_batch: int
    world_size: int
    micro_batch: int
    accum_steps: int

    @staticmethod
    def make(global_batch: int, micro_batch: int, world_size: int) -> "BatchPlan":
        """The global batch is fixed; micro_batch is an upper bound (memory), lowered to the largest divisor
        of the per-rank batch, so any world size that divides the global batch works, e.g. on a resume."""
        if global_batch % world_size:
            ok = [w for w in range(1, global_batch + 1) if global_batch % w == 0]
            raise DataError(f"data.global_batch_size={global_batch} is not divisible by world size {world_size}; "
                            f"world sizes that work: {ok}")
        per_rank = global_batch // world_size
        micro = max(m for m in range(1, min(micro_batch, per_rank) + 1) if per_rank % m == 0)
        return BatchPlan(global_batch, world_size, micro, per_rank // micro)


class GlobalOrder:
    """Global sample index g -> row of the data set: a fresh permutation per epoch from (seed, epoch)."""

    def __init__(self, num_rows: int, seed: int):
        self.num_rows, self.seed, self._perms = num_rows, seed, {}

    def row(self, g: int) -> int:
        epoch, pos = divmod(g, self.num_rows)
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.num_rows, generator=gen).numpy()}  # keep one epoch
        return int(self._perms[epoch][pos])

    def rows(self, start: int, count: int) -> list[int]:
        return [self.row(g) for g in range(start, start + count)]


class BatchStream:
    """Yields this rank's micro batches of each global batch; its only state is the global position.

    `position` counts samples consumed by the whole job (all ranks), so it means the same at any
    world size. Stateful: state_dict()/load_state_dict() go into every checkpoint.
    """

    def __init__(self, input_ids, labels, seed: int, epochs: int, plan: BatchPlan, rank: int):
        self.input_ids, self.labels, self.plan, self.rank = input_ids, labels, plan, rank
        self.order = GlobalOrder(len(input_ids), seed)
        self.total = epochs * len(input_ids)
        self.position = 0

    def has_next(self) -> bool:
        return self.position + self.plan.global_batch <= self.total

    def global_rows(self) -> list[int]:
        """Rows of the next global batch in order (what every rank together will consume)."""
        return self.order.rows(self.position, self.plan.global_batch)

    def next_global_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro batches (input_ids, labels) of the next global batch; advances position."""
        p = self.plan
        per_rank = p.global_batch // p.world_size
        rows = self.order.rows(self.position + self.rank * per_rank, per_rank)
        self.position += p.global_batch
        micro = []
        for i in range(0, per_rank, p.micro_batch):
            idx = rows[i: i + p.micro_batch]
            micro.append((torch.from_numpy(np.asarray(self.input_ids[idx], dtype=np.int64)),
                          torch.from_numpy(np.asarray(self.labels[idx], dtype=np.int64))))
        return micro

    def state_dict(self) -> dict:
        return {"position": self.position, "num_rows": len(self.input_ids), "seed": self.order.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["num_rows"] != len(self.input_ids):
            raise DataError(f"checkpoint was made on a data set of {state['num_rows']} samples, this one has "
                            f"{len(self.input_ids)}; the data position cannot be continued")
        self.position = int(state["position"])
