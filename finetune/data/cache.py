"""The token cache: a data set tokenized once, in parallel, into flat files that every rank memory-maps.

    python -m finetune.data prepare --config configs/tiny.yaml [key=value ...]   # build it ahead of the job
    python -m pytest tests/test_data.py -q -k "cache or frozen_heap or full_disk"

Tokenizing is a batched, multi-process `datasets.map` (fast tokenizer, one tokenizer call per row) whose
output is streamed into flat files: tokens.bin, loss_mask.bin and doc_offsets.bin, then a COMMIT file
(docs/data.md gives the format). Memory stays bounded by one batch of rows, whatever the data set size.
The cache does not depend on seq_len or packing: samples are cut from it when it is opened (samples.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import os
import shutil
import sys
import time

import numpy as np

from finetune.data.chat import check_fast_tokenizer, tokenize_chat_batch
from finetune.data.errors import DataError, row_name
from finetune.data.sources import SOURCE_COLUMNS, first_bad_line, load_documents, sources

CACHE_VERSION = 3  # bump when the cache layout or the tokenization rule changes
COMMIT_FILE = "COMMIT"
# rows per tokenizer call inside a worker, and per arrow batch written to the cache. A batch's token lists are
# Python objects, so this bounds a worker's memory: 200k chat rows, 2 workers, private memory 60 -> 37 MiB
# each at 1000 -> 250, no slower (docs/data.md).
_MAP_BATCH = 250
_ROWS_PER_PROC = 5000  # below this many rows per process, forking workers costs more than it saves


# ---------------------------------------------------------------- tokenizing (runs in map workers)

def tokenize_text_batch(tokenizer, texts: list[str]) -> tuple[list, list]:
    """Token ids (with the tokenizer's special tokens, and EOS appended) and all-ones loss masks."""
    eos = tokenizer.eos_token_id
    ids = [row if eos is None or (row and row[-1] == eos) else row + [eos] for row in tokenizer(texts)["input_ids"]]
    return ids, [np.ones(len(row), dtype=np.uint8) for row in ids]


def _tokenize_rows(rows, indices, tokenizer, fmt: str, column: str, label: str, names: list[str]) -> dict:
    """One map batch -> ids and masks; a mixture's rows keep their SOURCE_COLUMNS (source index, row in it)."""
    mixed = SOURCE_COLUMNS[0] in rows
    if fmt == "chat":
        where = ([row_name(names[k], r) for k, r in zip(*(rows[c] for c in SOURCE_COLUMNS))] if mixed else
                 [row_name(label, i) for i in indices])
        ids, masks = tokenize_chat_batch(tokenizer, rows[column], where)
    else:
        ids, masks = tokenize_text_batch(tokenizer, rows[column])
    return {"ids": ids, "mask": masks, **({c: rows[c] for c in SOURCE_COLUMNS} if mixed else {})}


# ---------------------------------------------------------------- the token cache

def _sources_fingerprint(pairs) -> list:
    out = []
    for src, w in pairs:
        files = [p.strip() for p in src.path.split(",")]
        if os.path.isdir(src.path):
            files = sorted(os.path.join(r, f) for r, _, fs in os.walk(src.path) for f in fs)
        stats = [(p, os.path.getsize(p), os.path.getmtime(p)) if os.path.isfile(p) else (p,) for p in files]
        out.append([src.path, src.split, src.name, src.revision, w, stats])
    return out


def tokenizing_inputs(cfg_data) -> list:
    """The values of the data fields declared `cache=True` (finetune/config.py `key`): what tokenizing reads
    besides the files (`cache="files"`: sources() reads those) and the tokenizer. Read from the fields'
    declarations, so a new field that changes the tokens enters the key where it is declared."""
    return [getattr(cfg_data, f.name) for f in dataclasses.fields(cfg_data) if f.metadata.get("cache") is True]


def cache_key(cfg_data, tokenizer, eval_set: bool = False) -> str:
    vocab = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    blob = json.dumps([CACHE_VERSION, _sources_fingerprint(sources(cfg_data, eval_set)), vocab,
                       str(tokenizer.chat_template), *tokenizing_inputs(cfg_data)])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cache_path(cfg_data, tokenizer, eval_set: bool = False) -> str:
    return os.path.join(cfg_data.cache_dir, cache_key(cfg_data, tokenizer, eval_set))


def default_num_proc() -> int:
    """The CPU cores this process may run on (a SLURM/cgroup cpuset, not the whole node)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _append_batch(table, files: dict, n_tokens: int) -> tuple[int, np.ndarray]:
    """Append one arrow batch of rows to the flat files; return the new token count and the docs' end offsets."""
    import pyarrow.compute as pc

    ids = pc.list_flatten(table.column("ids")).to_numpy().astype(np.int32, copy=False)
    mask = pc.list_flatten(table.column("mask")).to_numpy().astype(np.uint8, copy=False)
    lengths = pc.list_value_length(table.column("ids")).to_numpy().astype(np.int64)
    files["tokens"].write(ids.tobytes())
    files["mask"].write(mask.tobytes())
    ends = n_tokens + np.cumsum(lengths)
    files["offsets"].write(ends.tobytes())
    if "sources" in files:  # a mixture: (source index, row in it) of every document
        pairs = [table.column(c).to_numpy().astype(np.int64) for c in SOURCE_COLUMNS]
        files["sources"].write(np.stack(pairs, axis=1).tobytes())
    return int(ends[-1]) if len(ends) else n_tokens, ends


def _tokenized_batches(arrow_files: list[str]):
    """The tokenized rows, one arrow record batch (as `map` wrote it) at a time, read from its cache files with
    plain reads into buffers that are freed after each batch. Iterating the dataset instead reads through
    datasets' memory map: every page of the files it touched stays mapped in this process, counted in its
    RSS, until the dataset is closed (docs/data.md, Benchmark)."""
    import pyarrow as pa

    for name in arrow_files:
        with pa.OSFile(name, "rb") as f:
            yield from pa.ipc.open_stream(f)


def _write_cache(arrow_files: list[str], rows: int, mixture: bool, tmp: str, meta: dict) -> dict:
    """Stream the tokenized rows (`rows` of them, in `map`'s arrow files) into tmp/{tokens,loss_mask,doc_offsets}.bin
    (and a mixture's doc_sources.bin), one arrow batch at a time."""
    names = {"tokens": "tokens.bin", "mask": "loss_mask.bin", "offsets": "doc_offsets.bin"}
    if mixture:
        names["sources"] = "doc_sources.bin"
    files = {k: open(os.path.join(tmp, v), "wb") for k, v in names.items()}
    try:
        files["offsets"].write(np.zeros(1, dtype=np.int64).tobytes())
        n_tokens, n_docs = 0, 0
        for batch in _tokenized_batches(arrow_files):
            n_tokens, ends = _append_batch(batch, files, n_tokens)
            n_docs += len(ends)
        if n_docs != rows:  # the files hold exactly the mapped rows, in order (no indices mapping)
            raise DataError(f"tokenized {rows} rows but read {n_docs} back from {arrow_files}")
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
    return {**meta, "n_docs": n_docs, "n_tokens": n_tokens, "token_dtype": "int32"}


def _tokenized_features(mixture: bool):
    import datasets
    sources = dict(zip(SOURCE_COLUMNS, (datasets.Value("int32"), datasets.Value("int64")))) if mixture else {}
    return datasets.Features({"ids": datasets.List(datasets.Value("int32")),
                              "mask": datasets.List(datasets.Value("uint8")), **sources})


def build_cache(*args, **kwargs) -> str:
    """_build_cache, with a UnicodeDecodeError from datasets (while loading, or later when rows are read)
    turned into a DataError naming the file and line; the files are scanned only after the error."""
    try:
        return _build_cache(*args, **kwargs)
    except UnicodeError as e:
        cfg_data, eval_set = args[0], kwargs.get("eval_set", args[2] if len(args) > 2 else False)
        for src, _ in sources(cfg_data, eval_set):
            for file in (p.strip() for p in src.path.split(",") if p.strip()):
                bad = first_bad_line(file)
                if bad is not None:
                    raise DataError(bad) from None
        raise DataError(f"cannot read data: {type(e).__name__}: {e}") from None


@contextlib.contextmanager
def _gc_frozen():
    """Keep the parent's objects out of the garbage collector while `map` forks its workers: a collection in a
    worker writes to the header of every object it walks, so each worker would privately copy the pages of
    the ~430 MiB parent it inherited. Measured at 200k conversations, 2 workers: 831 -> 621 MiB pipeline
    peak, and 20% faster (docs/data.md)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _build_cache(cfg_data, tokenizer, eval_set: bool = False, num_proc: int | None = None,
                 progress: bool | None = None) -> str:
    """Tokenize the data set (or the eval set) into its cache folder unless it is already committed.

    Atomic: everything is written into a temporary folder that gets its COMMIT file last and is then
    renamed into place, so a crash or a bad row never leaves a half cache that a later run would read.
    Says what it tokenizes when it starts, and rows, tokens and time when it ends (a large file takes
    minutes). datasets' progress bars only with progress=True, or by default when stderr is a terminal:
    in a log file each update would be a line of its own.
    """
    cache = cache_path(cfg_data, tokenizer, eval_set)
    if os.path.exists(os.path.join(cache, COMMIT_FILE)):
        return cache
    import datasets

    show_bars = sys.stderr.isatty() if progress is None else progress
    datasets.enable_progress_bars() if show_bars else datasets.disable_progress_bars()
    names = [src.path for src, _ in sources(cfg_data, eval_set)]
    print(f"data: tokenizing the {'eval' if eval_set else 'training'} data {' + '.join(names)} into {cache}",
          flush=True)
    t0 = time.perf_counter()
    tmp = f"{cache}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        meta = _tokenize_into(tmp, cfg_data, tokenizer, eval_set, num_proc or cfg_data.num_proc, names)
        _commit(tmp, cache, meta)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, DataError) or not isinstance(e, Exception):
            raise
        cause = _data_error_in(e)
        if cause is not None:  # datasets' worker pool re-raises our error wrapped or re-typed
            raise DataError(cause) from None
        if isinstance(e, OSError):  # e.g. a full disk: one line, and nothing half-written was kept
            raise DataError(f"cannot build the data cache in {cfg_data.cache_dir}: {e}") from None
        raise
    print(f"data: tokenized {meta['n_docs']:,} rows into {meta['n_tokens']:,} tokens in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    return cache


def _tokenize_into(tmp: str, cfg_data, tokenizer, eval_set: bool, procs: int, names: list[str]) -> dict:
    """Load the documents, tokenize them with `procs` map workers (0: automatic) and write the flat files into
    tmp; return the cache's meta."""
    ds, fmt, column, label = load_documents(cfg_data, eval_set, cache_dir=os.path.join(tmp, "hf"))
    if fmt == "chat":  # before forking workers that would all fail on their first batch
        check_fast_tokenizer(tokenizer)
    if not procs:  # automatic: every core, but forking workers for a few thousand rows costs more than it saves
        procs = max(1, min(default_num_proc(), len(ds) // _ROWS_PER_PROC))
    procs = min(procs, len(ds))
    with _gc_frozen() if procs > 1 else contextlib.nullcontext():
        mapped = ds.map(_tokenize_rows, batched=True, batch_size=_MAP_BATCH, with_indices=True,
                        num_proc=procs if procs > 1 else None, remove_columns=ds.column_names,
                        fn_kwargs={"tokenizer": tokenizer, "fmt": fmt, "column": column, "label": label,
                                   "names": names},
                        features=_tokenized_features(len(names) > 1),
                        cache_file_name=os.path.join(tmp, "tokenized.arrow"),
                        desc="tokenize")
    arrow_files, rows = [f["filename"] for f in mapped.cache_files], len(mapped)
    del mapped, ds  # datasets memory-mapped (and touched) the files map wrote: unmapped, they leave our RSS
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    return _write_cache(arrow_files, rows, len(names) > 1, tmp, {
        "version": CACHE_VERSION, "format": fmt, "source": label, "pad_id": pad,
        **({"sources": names} if len(names) > 1 else {})})


def _commit(tmp: str, cache: str, meta: dict) -> None:
    """Keep only the flat files, write meta.json, then the COMMIT file, then rename tmp into place."""
    for name in os.listdir(tmp):  # the arrow intermediates: only the flat files stay
        if name not in ("tokens.bin", "loss_mask.bin", "doc_offsets.bin", "doc_sources.bin"):
            p = os.path.join(tmp, name)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(tmp, COMMIT_FILE), "w") as f:
        f.write("ok\n")
    if os.path.exists(cache):  # an older layout, or a folder left by hand
        shutil.rmtree(cache)
    os.replace(tmp, cache)


def _data_error_in(e: BaseException) -> str | None:
    while e is not None:
        if isinstance(e, DataError):
            return str(e)
        e = e.__cause__ or e.__context__
    return None
