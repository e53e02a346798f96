"""Sources and formats: local files (jsonl, json, parquet, arrow, txt), saved folders, hub names, mixtures.

    python -m finetune.data prepare --config configs/tiny.yaml data.path=<file or hub name>
    python -m pytest tests/test_data.py -q -k "missing or saved_folder or mixture or hub"

This is the file to change for a new data format or source. It yields a `datasets.Dataset` of one column
(text or chat messages) and says which format it is; tokenizing it is cache.py's job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from finetune.data.errors import DataError

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text",
                  ".text": "text"}
SOURCE_COLUMNS = ("_source", "_row")  # a mixture's row: index of its source, row within that source


@dataclass(frozen=True)
class Source:
    """One data set: local files (comma separated), a local folder, or a hub name (`datasets.load_dataset`)."""
    path: str
    split: str = "train"
    name: str = ""  # hub subset / config name
    revision: str = ""


def sources(cfg_data, eval_set: bool = False) -> list[tuple[Source, float]]:
    """(source, weight) pairs of the training mixture, or the one eval source."""
    if eval_set:
        spec = cfg_data.eval_path
        if spec.startswith("split:"):  # another split of the training source (hub or saved DatasetDict)
            return [(Source(cfg_data.path, spec[len("split:"):], cfg_data.name, cfg_data.revision), 1.0)]
        return [(Source(spec), 1.0)]
    if not cfg_data.mixture:
        return [(Source(cfg_data.path, cfg_data.split, cfg_data.name, cfg_data.revision), 1.0)]
    pairs = []
    for item in cfg_data.mixture.split(";"):
        path, sep, weight = item.strip().rpartition(":")
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not sep or not path or w <= 0:
            raise DataError(f"data.mixture entry '{item.strip()}' must look like <path>:<weight> with weight > 0 "
                            "(entries separated by ';')")
        pairs.append((Source(path.strip(), cfg_data.split, cfg_data.name, cfg_data.revision), w))
    return pairs


def is_local_path(path: str) -> bool:
    """An existing path, or file names with a data extension (missing ones then get a clear error). A hub
    name ("org/name") has a slash too, so a slash alone does not make a path local."""
    files = [p.strip() for p in path.split(",") if p.strip()]
    return os.path.exists(path) or all(os.path.splitext(p)[1] in _FILE_BUILDERS for p in files)


def _load_local_files(path: str, cache_dir: str | None):
    import datasets

    files = [p.strip() for p in path.split(",") if p.strip()]
    exts = {os.path.splitext(p)[1] for p in files}
    missing = [p for p in files if not os.path.isfile(p)]
    if missing:
        raise DataError(f"data file not found: {missing[0]}")
    empty = [p for p in files if os.path.getsize(p) == 0]
    if empty:  # datasets would fail with a bare StopIteration
        raise DataError(f"data file is empty: {empty[0]}")
    if len(exts) != 1 or next(iter(exts)) not in _FILE_BUILDERS:
        raise DataError(f"data files must share one of the extensions {sorted(_FILE_BUILDERS)}, got {sorted(exts)}")
    builder = _FILE_BUILDERS[exts.pop()]
    # json: datasets parses 10 MB chunks into Python objects first (~15x in memory); 1 MB bounds that to ~15 MB
    options = {"chunksize": 1 << 20} if builder == "json" else {}
    try:
        with _quiet_json_loader():
            return datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache_dir, **options)
    except Exception as e:  # noqa: BLE001 - a parse error should name the file and line, not datasets' internals
        for file in files:
            bad = first_bad_line(file)
            if bad:
                raise DataError(bad) from None
        raise DataError(f"cannot read data file(s) {path}: {type(e).__name__}: {e}") from None


@contextlib.contextmanager
def _quiet_json_loader():
    """datasets' JSON loader logs a parse error itself, on a line of its own, by its 0-based row and without
    the file ("... in row 50"); the DataError raised instead gives the file and the 1-based line."""
    logger = logging.getLogger("datasets.packaged_modules.json.json")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def first_bad_line(path: str) -> str | None:
    """'data file <path> line <n> is not valid UTF-8|JSON: <why>' for the first such line of a text or JSON
    file (1-based, as an editor numbers it), or None. Read only after datasets failed on the file."""
    ext = os.path.splitext(path)[1]
    if ext not in (".jsonl", ".json", ".txt", ".text") or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"data file {path} line {number} is not valid UTF-8: byte {raw[e.start:e.start + 1]!r} "
                        f"at column {e.start + 1} ({e.reason})")
            why = _json_problem(line) if ext in (".jsonl", ".json") else None
            if why and ext == ".json" and number == 1:  # not JSON lines: maybe one document over many lines
                return _json_document_problem(path)
            if why:
                return f"data file {path} line {number} is not valid JSON: {why}"
    return None


def _json_problem(line: str) -> str | None:
    """Why a non-blank line is not one JSON value, or None."""
    try:
        line.strip() and json.loads(line)
    except json.JSONDecodeError as e:
        return f"{e.msg} at column {e.colno}"
    return None


def _json_document_problem(path: str) -> str | None:
    """The first error of the whole file read as one JSON document, or None when it is one."""
    with open(path, encoding="utf-8", errors="replace") as f:
        try:
            json.load(f)
        except json.JSONDecodeError as e:
            return f"data file {path} line {e.lineno} is not valid JSON: {e.msg} at column {e.colno}"
    return None


def load_source(src: Source, cache_dir: str | None = None):
    """A `datasets.Dataset`. A local folder is either `save_to_disk` output or a folder of data files; anything
    else is a hub name, loaded by the same `load_dataset` call as a folder of files (network needed)."""
    import datasets

    if os.path.isdir(src.path) and any(os.path.exists(os.path.join(src.path, f))
                                       for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
        ds = datasets.load_from_disk(src.path)
        if isinstance(ds, datasets.DatasetDict):
            if src.split not in ds:
                raise DataError(f"data set {src.path} has no split '{src.split}' (splits: {sorted(ds)})")
            ds = ds[src.split]
    elif os.path.isdir(src.path) or not is_local_path(src.path):
        try:
            ds = datasets.load_dataset(src.path, src.name or None, split=src.split, revision=src.revision or None,
                                       cache_dir=cache_dir if os.path.isdir(src.path) else None)  # hub: HF's cache
        except Exception as e:  # noqa: BLE001 - one line naming the source
            raise DataError(f"cannot load data set {src.path} (name={src.name or None}, split={src.split}): "
                            f"{type(e).__name__}: {e}") from None
    else:
        ds = _load_local_files(src.path, cache_dir)
    if len(ds) == 0:
        raise DataError(f"data set {src.path} is empty")
    return ds


FORMATS = ("auto", "text", "chat")  # data.format: auto is chat when data.messages_field is a column, else text


def _resolve_format(cfg_data, ds, path: str) -> tuple[str, str]:
    """(format, column) of a data set, with the clear errors for a missing or non-text column."""
    fmt = cfg_data.format
    if fmt == "auto":
        fmt = "chat" if cfg_data.messages_field in ds.column_names else "text"
    column = cfg_data.messages_field if fmt == "chat" else cfg_data.text_field
    if column not in ds.column_names:
        raise DataError(f"data set {path} has no column '{column}' (columns: {ds.column_names})")
    if fmt == "text" and not isinstance(ds[0][column], str):
        raise DataError(f"column '{column}' of {path} holds {type(ds[0][column]).__name__}, not text; "
                        "set data.format=chat for a messages column, or data.text_field to a text column")
    return fmt, column


def load_documents(cfg_data, eval_set: bool = False, cache_dir: str | None = None):
    """(dataset, format, column, label for messages). A mixture is interleaved with fixed weights and seed
    (HF `interleave_datasets`, stopping when the first source runs out): deterministic. Its rows carry
    SOURCE_COLUMNS, the source's index and the row within it (0-based), so errors can name the file and
    its row: 12 bytes a row, in memory (sources' own columns stay memory-mapped)."""
    import datasets

    pairs = sources(cfg_data, eval_set)
    loaded, fmts = [], set()
    for k, (src, _) in enumerate(pairs):
        ds = load_source(src, cache_dir)
        fmt, column = _resolve_format(cfg_data, ds, src.path)
        fmts.add(fmt)
        ds = ds.select_columns([column])
        if len(pairs) > 1:
            ds = ds.add_column(SOURCE_COLUMNS[0], np.full(len(ds), k, dtype=np.int32))
            ds = ds.add_column(SOURCE_COLUMNS[1], np.arange(len(ds), dtype=np.int64))
        loaded.append(ds)
    if len(fmts) > 1:
        raise DataError(f"data.mixture mixes chat and text sources ({[s.path for s, _ in pairs]}); use one format")
    label = pairs[0][0].path if len(pairs) == 1 else "the data.mixture"
    if len(loaded) == 1:
        return loaded[0], fmts.pop(), column, label
    total = sum(w for _, w in pairs)
    try:
        mixed = datasets.interleave_datasets(loaded, probabilities=[w / total for _, w in pairs], seed=0,
                                             stopping_strategy="first_exhausted")
    except ValueError as e:  # e.g. the sources' columns have different types
        raise DataError(f"cannot mix data sets {[s.path for s, _ in pairs]}: {e}") from None
    return mixed, fmts.pop(), column, label
