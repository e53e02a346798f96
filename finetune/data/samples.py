"""Fixed-length samples cut from the memory-mapped token cache: padded or packed, with their labels.

    python -m pytest tests/test_data.py -q -k "packing or padding or too_long"

The cache (cache.py) is independent of seq_len and packing; this module decides what one training
row is. IGNORE marks the labels that carry no loss.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from finetune.data.errors import DataError, row_name
from common.dist import all_ranks_reduce

IGNORE = -100  # label value that carries no loss (prompt and padding tokens)


class TokenCache:
    """The committed cache folder, memory-mapped: ranks share the pages instead of each holding a copy."""

    def __init__(self, path: str):
        with open(os.path.join(path, "meta.json")) as f:
            self.meta = json.load(f)
        self.path = path
        self.tokens = self._map("tokens.bin", np.int32, self.meta["n_tokens"])
        self.mask = self._map("loss_mask.bin", np.uint8, self.meta["n_tokens"])
        self.offsets = self._map("doc_offsets.bin", np.int64, self.meta["n_docs"] + 1)
        self.doc_sources = None  # a mixture's [n_docs, 2]: (index into meta["sources"], row in that source)
        if "sources" in self.meta:
            self.doc_sources = self._map("doc_sources.bin", np.int64, 2 * self.meta["n_docs"]).reshape(-1, 2)

    def _map(self, name: str, dtype, count: int) -> np.ndarray:
        if count == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(os.path.join(self.path, name), dtype=dtype, mode="r", shape=(count,))


def document_name(cache, doc: int) -> str:
    """The file and row document `doc` of a cache came from, for errors."""
    if getattr(cache, "doc_sources", None) is None:
        return row_name(cache.meta["source"], doc)
    source, row = cache.doc_sources[doc]
    return row_name(cache.meta["sources"][int(source)], row)


class Samples:
    """Fixed-length samples over a TokenCache, cut when opened (the cache is independent of seq_len).

    pack=False: sample i is document i, truncated (or an error with truncation off) and right-padded.
    pack=True: the documents' token stream cut into seq_len chunks (the tail is dropped). Position ids
    restart at every document start, and the first token of each document carries no loss, so no token
    is predicted from another document: with those position ids the model's attention is block-diagonal
    (transformers detects packed sequences from position ids; see docs/data.md). padding_free=True returns
    a packed batch as one row of len(rows) x seq_len tokens: flash attention's varlen path needs that.
    """

    def __init__(self, cache: TokenCache, seq_len: int, pack: bool, truncation: bool = True,
                 padding_free: bool = False):
        self.cache, self.seq_len, self.pack, self.padding_free = cache, seq_len, pack, padding_free
        n_docs = cache.meta["n_docs"]
        self.num_rows = cache.meta["n_tokens"] // seq_len if pack else n_docs
        if not pack and not truncation and n_docs:
            lengths = np.diff(cache.offsets)
            too_long = np.flatnonzero(lengths > seq_len)
            if len(too_long):
                i = int(too_long[0])
                raise DataError(f"{document_name(cache, i)}: {int(lengths[i])} tokens, longer than "
                                f"data.seq_len={seq_len} ({len(too_long)} such rows); raise seq_len or set "
                                "data.truncation=true")

    def __len__(self) -> int:
        return self.num_rows

    def batch(self, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(input_ids, labels, position_ids) int64 [len(rows), seq_len]; position_ids None when not packed."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.pack:
            return self._packed(rows)
        return self._padded(rows)

    def _padded(self, rows):
        s, c = self.seq_len, self.cache
        ids = np.full((len(rows), s), c.meta["pad_id"], dtype=np.int64)
        labels = np.full((len(rows), s), IGNORE, dtype=np.int64)
        for i, r in enumerate(rows):
            a, b = int(c.offsets[r]), int(c.offsets[r + 1])
            b = min(b, a + s)
            ids[i, : b - a] = c.tokens[a:b]
            labels[i, : b - a] = np.where(c.mask[a:b] == 1, c.tokens[a:b], IGNORE)
        return torch.from_numpy(ids), torch.from_numpy(labels), None

    def _packed(self, rows):
        s, c = self.seq_len, self.cache
        t = rows[:, None] * s + np.arange(s)[None, :]  # token index of every position
        ids = np.asarray(c.tokens[t.ravel()], dtype=np.int64).reshape(t.shape)
        mask = np.asarray(c.mask[t.ravel()]).reshape(t.shape)
        doc = np.searchsorted(c.offsets, t, side="right") - 1
        segment_start = np.maximum(np.asarray(c.offsets[doc.ravel()]).reshape(t.shape), rows[:, None] * s)
        pos = t - segment_start
        labels = np.where((mask == 1) & (pos > 0), ids, IGNORE)
        if self.padding_free:  # position 0 carries no label, so no row predicts across the seam
            ids, labels, pos = ids.reshape(1, -1), labels.reshape(1, -1), pos.reshape(1, -1)
        return torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(pos)


def open_samples(cache: str, cfg_data, padding_free: bool = False) -> Samples:
    samples = Samples(TokenCache(cache), cfg_data.seq_len, cfg_data.pack, cfg_data.truncation, padding_free)
    if len(samples) == 0:
        raise DataError(f"data set {samples.cache.meta['source']} yields no samples of seq_len={cfg_data.seq_len}")
    return samples


def check_samples(samples: Samples, cfg_data, rank: int = 0, world_size: int = 1) -> str | None:
    """What the samples leave out, said once at the start (lines for rank 0 to print, or None):
    - the rows data.truncation cuts to data.seq_len (unpacked), and the share of the tokens that drops;
    - packing's tail, the last tokens that do not fill a sample;
    - samples without a token that carries loss (they end inside the prompt). None at all is refused:
      every step would have loss 0 and no gradient (e.g. data.seq_len shorter than every prompt).
    Call it on every rank: the counts are collective when W > 1 (`sample_stats`)."""
    stats, n, seq_len = sample_stats(samples, cfg_data, rank, world_size), len(samples), cfg_data.seq_len
    source, tokens, without = samples.cache.meta["source"], stats["tokens"], stats["without_loss_tokens"]
    if without == n:
        raise DataError(f"no sample of {source} at data.seq_len={seq_len} has a token that carries loss ({without} of "
                        f"{n} samples end before the first trained token, e.g. inside the prompt); raise data.seq_len")
    lines = []
    rows, cut = stats["truncated_rows"], stats["truncated_tokens"]
    if rows:
        lines.append(f"warning: {rows:,} of {n:,} rows ({_share(rows, n)}) of {source} are longer than data.seq_len="
                     f"{seq_len} and cut to it (data.truncation): {cut:,} of {tokens:,} tokens ({_share(cut, tokens)}) "
                     "are dropped; raise data.seq_len, or set data.pack=true to train on every token")
    tail = tokens - n * seq_len if cfg_data.pack else 0
    if tail:
        lines.append(f"data: packing {source} into samples of data.seq_len={seq_len} drops the last {tail:,} of "
                     f"{tokens:,} tokens ({_share(tail, tokens)}), too few to fill a sample")
    if without:
        lines.append(f"warning: {without} of {n} samples ({100 * without / n:.1f}%) of {source} at data.seq_len="
                     f"{seq_len} have no token that carries loss (they end inside the prompt) and add nothing to "
                     "training")
    return "\n".join(lines) or None


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if part * 1000 >= whole else "<0.1%"


def sample_stats(samples: Samples, cfg_data, rank: int = 0, world_size: int = 1) -> dict:
    """{samples, tokens, without_loss_tokens, truncated_rows, truncated_tokens}. Every rank counts its 1/W of
    the samples and all-reduces add them up (O(data / W) a rank, nobody waits on a rank 0 that reads
    everything); the counts are kept per cache, seq_len, packing and truncation (a small json in the cache
    folder), so a restart reads nothing again and still reports them. Collective when W > 1."""
    name = f"sample-stats-s{cfg_data.seq_len}-{'pack' if cfg_data.pack else 'pad'}-t{int(cfg_data.truncation)}.json"
    stats_path = os.path.join(samples.cache.path, name)
    if all_ranks_reduce(int(os.path.exists(stats_path)), "min"):  # all read, or all count
        with open(stats_path) as f:
            return json.load(f)
    plain = Samples(samples.cache, cfg_data.seq_len, cfg_data.pack, cfg_data.truncation)  # one row per sample
    lo, hi = len(plain) * rank // world_size, len(plain) * (rank + 1) // world_size
    counts = {"without_loss_tokens": sum(int((plain.batch(range(i, min(i + 4096, hi)))[1][:, 1:] == IGNORE)
                                             .all(dim=1).sum()) for i in range(lo, hi, 4096)),
              "truncated_rows": 0, "truncated_tokens": 0}
    if not cfg_data.pack:  # unpacked, sample i is document i
        over = np.diff(np.asarray(plain.cache.offsets[lo: hi + 1])) - cfg_data.seq_len
        over = over[over > 0]
        counts.update(truncated_rows=len(over), truncated_tokens=int(over.sum()))
    stats = {"samples": len(plain), "tokens": int(plain.cache.meta["n_tokens"]),
             **{k: all_ranks_reduce(int(v), "sum") for k, v in counts.items()}}
    if rank == 0:
        tmp = f"{stats_path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(stats, f)
        os.replace(tmp, stats_path)
    return stats


class ArraySamples:
    """Samples from in-memory [N, seq_len] arrays (tests and small experiments)."""

    def __init__(self, input_ids: np.ndarray, labels: np.ndarray, position_ids: np.ndarray | None = None):
        self.input_ids, self.labels, self.position_ids = input_ids, labels, position_ids

    def __len__(self) -> int:
        return len(self.input_ids)

    def batch(self, rows):
        idx = list(rows)
        pos = None if self.position_ids is None else torch.from_numpy(np.asarray(self.position_ids[idx], np.int64))
        return (torch.from_numpy(np.asarray(self.input_ids[idx], dtype=np.int64)),
                torch.from_numpy(np.asarray(self.labels[idx], dtype=np.int64)), pos)
