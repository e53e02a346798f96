"""Data: sources -> tokenized token cache (memory-mapped) -> fixed-length samples -> a world-size independent order.

    python -m finetune.data prepare --config configs/tiny.yaml [key=value ...]   # tokenize ahead of the job
    python -m pytest tests/test_data.py

Tokenizing is a batched, multi-process `datasets.map` (fast tokenizer, one tokenizer call per row) whose
output is streamed into flat files: tokens.bin, loss_mask.bin and doc_offsets.bin, then a COMMIT file
(docs/data.md gives the format). Memory stays bounded by one batch of rows, whatever the data set size.
The cache does not depend on seq_len or packing: samples are cut from it when it is opened.

The order of samples is a pure function of (seed, epoch, global sample index), so the only data
state a checkpoint needs is one integer: how many samples the whole job has consumed. Rank r of W
takes a contiguous slice of each global batch, so the union over ranks of global batch b is the same
set of samples for any W, and resuming at another world size continues the exact same stream.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass

import numpy as np
import torch

from common.dist import all_ranks_reduce, divisibility_problem

IGNORE = -100  # label value that carries no loss (prompt and padding tokens)
CACHE_VERSION = 3  # bump when the cache layout or the tokenization rule changes
COMMIT_FILE = "COMMIT"
BATCH_KEY = "data.global_batch_size"  # the config key BatchPlan splits over the ranks (named in its errors)
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text",
                  ".text": "text"}
# rows per tokenizer call inside a worker, and per arrow batch written to the cache. A batch's token lists are
# Python objects, so this bounds a worker's memory: 200k chat rows, 2 workers, private memory 60 -> 37 MiB
# each at 1000 -> 250, no slower (docs/data.md).
_MAP_BATCH = 250
_ROWS_PER_PROC = 5000  # below this many rows per process, forking workers costs more than it saves
SOURCE_COLUMNS = ("_source", "_row")  # a mixture's row: index of its source, row within that source
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")  # transformers' test for a {% generation %} template


class DataError(ValueError):
    """A problem with the data set or its sizes; the message says what to change."""


# ---------------------------------------------------------------- sources: files, saved folders, hub

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


def _is_local(path: str) -> bool:
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
        return datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache_dir, **options)
    except Exception as e:  # noqa: BLE001 - a parse error should name the file, not datasets' internals
        raise DataError(f"cannot read data file(s) {path}: {type(e).__name__}: {e}") from None


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
    elif os.path.isdir(src.path) or not _is_local(src.path):
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


# ---------------------------------------------------------------- tokenizing (runs in map workers)

def _check_conversation(messages, where: str) -> None:
    """Roles alternate user/assistant after an optional system message; every content is text."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}}")
    expected = "user"
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{j}] must have a text 'content'")
        role = m.get("role")
        if j == 0 and role == "system":
            continue
        if role != expected:
            raise DataError(f"{where}: messages[{j}].role is {role!r}, expected {expected!r} "
                            "(roles must alternate user/assistant after an optional system message)")
        expected = "assistant" if role == "user" else "user"


def _plain(messages) -> bool:
    """Only str role/content: what transformers' template sandboxing would copy unchanged."""
    return all(type(m) is dict and len(m) == 2 and type(m.get("role")) is str and type(m.get("content")) is str
               for m in messages)


def _render(tokenizer, conversations, add_generation_prompt: bool, plain: bool, generation: bool = False):
    """The chat template applied as `apply_chat_template(..., tokenize=False)` does: a list of strings, or with
    generation=True (return_assistant_tokens_mask) a list of (string, [(start, end) of each {% generation %}
    block]). Plain conversations go straight to the compiled template (the per-call input copying is the
    identity for them, and costs more than the rendering); anything else takes transformers' full path."""
    from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

    special = tokenizer.special_tokens_map
    if plain:
        render = _fast_render(_compile_jinja_template(tokenizer.chat_template),
                              {"tools": None, "documents": None, "add_generation_prompt": add_generation_prompt,
                               **special}, generation)
        return [render(c) for c in conversations]
    rendered, spans = render_jinja_template(conversations=conversations, chat_template=tokenizer.chat_template,
                                            add_generation_prompt=add_generation_prompt,
                                            return_assistant_tokens_mask=generation, **special)
    return list(zip(rendered, spans)) if generation else rendered


def _fast_render(template, constants: dict, generation: bool = False):
    """messages -> template.render(messages=messages, **constants), with the variables that do not change
    merged once. jinja's render() builds each call's context by copying the template's globals (a ChainMap,
    read key by key) and the keywords: profiled, that was ~60% of the rendering time (docs/data.md).
    generation=True: (text, spans of the {% generation %} blocks), recorded by transformers' jinja extension
    (AssistantTracker), which reads the blocks rendered so far, as its `_render_with_assistant_indices` does."""
    env, base = template.environment, {**template.globals, **constants}

    def render(messages):
        ctx = env.context_class(env, {**base, "messages": messages}, template.name, template.blocks)
        try:
            if not generation:
                return env.concat(template.root_render_func(ctx))
            blocks, spans = [], []
            with env.activate_tracker(blocks, spans):
                for block in template.root_render_func(ctx):
                    blocks.append(block)
            return "".join(blocks), spans
        except Exception:  # noqa: BLE001 - what Template.render does: jinja's rewritten traceback
            return env.handle_exception()
    return render


def _first_token_at(encoding, char: int, text_len: int, where: str) -> int:
    """Index of the first token that starts at or after `char`; an error if a token straddles `char`."""
    while char < text_len:
        t = encoding.char_to_token(char)
        if t is not None:
            if encoding.offsets[t][0] < char:
                raise DataError(f"{where}: a token crosses the edge of an assistant turn; cannot mask prompts exactly")
            return t
        char += 1  # a character no token covers (e.g. dropped by the normalizer): look at the next one
    return len(encoding.ids)


def _label_mask(encoding, spans: list[tuple[int, int]], text_len: int, where: str) -> np.ndarray:
    """1 for the tokens of each assistant span [a, b) of the rendered text."""
    mask = np.zeros(len(encoding.ids), dtype=np.uint8)
    for a, b in spans:
        mask[_first_token_at(encoding, a, text_len, where): _first_token_at(encoding, b, text_len, where)] = 1
    return mask


def tokenize_chat_batch(tokenizer, conversations: list, where: list[str]) -> tuple[list, list]:
    """Token ids and loss masks (1 on assistant turns) of many conversations.

    Each conversation is tokenized once, and the assistant turns' character spans are found in its rendering:
    - a template that marks them with {% generation %} (what transformers' return_assistant_tokens_mask
      needs) renders each conversation once; each assistant turn must have exactly one such block;
    - any other template: the prefix rule, 2 x (assistant turns) more renders (`_prefix_spans`).
    Either way each span's edges must fall between tokens of the full tokenization.
    """
    check_fast_tokenizer(tokenizer)
    for k, msgs in enumerate(conversations):
        _check_conversation(msgs, where[k])
    plain = all(_plain(c) for c in conversations)  # then so are the prompts and prefixes cut from them
    if GENERATION_TAG.search(tokenizer.chat_template or ""):
        full, spans = _generation_spans(tokenizer, conversations, where, plain)
    else:
        full, spans = _prefix_spans(tokenizer, conversations, where, plain)
    enc = tokenizer(full, add_special_tokens=False)
    ids = enc["input_ids"]
    masks = [_label_mask(enc.encodings[k], spans[k], len(full[k]), where[k]) for k in range(len(conversations))]
    return ids, masks


def check_fast_tokenizer(tokenizer) -> None:
    """Chat masking maps characters to tokens (`encodings[k].char_to_token`): only a fast tokenizer (the Rust
    `tokenizers` library) returns those; a slow (Python) one returns no `encodings` at all."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"chat data needs a fast tokenizer (the `tokenizers` library) to mask prompts by character "
                        f"offsets; {type(tokenizer).__name__} ({tokenizer.name_or_path or 'in memory'}) is a slow, "
                        "Python one: save a fast one into the tokenizer folder (a tokenizer.json, e.g. from the "
                        "model's tokenizers-backed class: BertTokenizer.from_pretrained(dir).save_pretrained(dir) "
                        "for BertTokenizerLegacy), or use data.format=text")


def _generation_spans(tokenizer, conversations, where, plain) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """(renderings, assistant spans): one render per conversation, the spans its {% generation %} blocks mark."""
    full, spans = zip(*_render(tokenizer, conversations, False, plain, generation=True)) if conversations else ((), ())
    for k, msgs in enumerate(conversations):
        turns = sum(m["role"] == "assistant" for m in msgs)
        if len(spans[k]) != turns:
            raise DataError(f"{where[k]}: the chat template marks {len(spans[k])} {{% generation %}} block(s) for "
                            f"{turns} assistant turn(s); cannot mask prompts")
    return list(full), [list(s) for s in spans]


def _prefix_spans(tokenizer, conversations, where, plain) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """(renderings, assistant spans) by the prefix rule: the full conversation, and per assistant turn the
    prompt before it (with the generation prompt) and the prefix ending with it (unless that is the whole
    conversation), all as strings. Prefix consistency is checked: both must be prefixes of the full rendering."""
    owners, prompts, prefixes = [], [], []
    for k, msgs in enumerate(conversations):
        for j, m in enumerate(msgs):
            if m["role"] == "assistant":
                owners.append(k)
                prompts.append(msgs[:j])
                prefixes.append(msgs[: j + 1] if j + 1 < len(msgs) else None)  # None: the full conversation
    full = _render(tokenizer, conversations, False, plain)
    starts = _render(tokenizer, prompts, True, plain)
    rendered = iter(_render(tokenizer, [p for p in prefixes if p is not None], False, plain))
    ends = [full[k] if p is None else next(rendered) for k, p in zip(owners, prefixes)]
    spans = [[] for _ in conversations]
    for k, s, e in zip(owners, starts, ends):
        if not (full[k].startswith(s) and full[k].startswith(e) and len(s) <= len(e)):
            raise DataError(f"{where[k]}: the chat template does not render conversations prefix-consistently; "
                            "cannot mask prompts")
        spans[k].append((len(s), len(e)))
    return full, spans


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


def row_name(source: str, row: int) -> str:
    """How every error names a row: '<source> row <1-based row>' (the line of a jsonl file)."""
    return f"{source} row {int(row) + 1}"


# the old single-row helpers, kept for callers that tokenize one conversation (tests, notebooks)
def tokenize_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Ids of the rendered conversation, and labels that are IGNORE everywhere except assistant turns."""
    (ids,), (mask,) = tokenize_chat_batch(tokenizer, [messages], ["conversation"])
    return ids, [t if m else IGNORE for t, m in zip(ids, mask)]


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


def cache_key(cfg_data, tokenizer, eval_set: bool = False) -> str:
    vocab = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    blob = json.dumps([CACHE_VERSION, _sources_fingerprint(sources(cfg_data, eval_set)), vocab,
                       str(tokenizer.chat_template), cfg_data.format, cfg_data.text_field, cfg_data.messages_field])
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
                bad = _first_non_utf8_line(file) if os.path.isfile(file) else None
                if bad is not None:
                    raise DataError(f"data file {file} line {bad[0]} is not valid UTF-8: {bad[1]}") from None
        raise DataError(f"cannot read data: {type(e).__name__}: {e}") from None


def _first_non_utf8_line(path: str) -> tuple[int, str] | None:
    """(1-based line, reason) of the first line of `path` that is not UTF-8."""
    if os.path.splitext(path)[1] != ".parquet":
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as e:
                    return number, f"byte {line[e.start:e.start + 1]!r} at column {e.start + 1} ({e.reason})"
    return None


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
                progress: bool = False) -> str:
    """Tokenize the data set (or the eval set) into its cache folder unless it is already committed.

    Atomic: everything is written into a temporary folder that gets its COMMIT file last and is then
    renamed into place, so a crash or a bad row never leaves a half cache that a later run would read.
    """
    cache = cache_path(cfg_data, tokenizer, eval_set)
    if os.path.exists(os.path.join(cache, COMMIT_FILE)):
        return cache
    import datasets

    datasets.enable_progress_bars() if progress else datasets.disable_progress_bars()
    tmp = f"{cache}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        ds, fmt, column, label = load_documents(cfg_data, eval_set, cache_dir=os.path.join(tmp, "hf"))
        names = [src.path for src, _ in sources(cfg_data, eval_set)]
        if fmt == "chat":  # before forking workers that would all fail on their first batch
            check_fast_tokenizer(tokenizer)
        procs = num_proc or cfg_data.num_proc
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
        meta = _write_cache(arrow_files, rows, len(names) > 1, tmp, {
            "version": CACHE_VERSION, "format": fmt, "source": label, "pad_id": pad,
            **({"sources": names} if len(names) > 1 else {})})
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
    return cache


def _data_error_in(e: BaseException) -> str | None:
    while e is not None:
        if isinstance(e, DataError):
            return str(e)
        e = e.__cause__ or e.__context__
    return None


# ---------------------------------------------------------------- samples cut from the cache

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


def check_loss_tokens(samples: Samples, cfg_data, rank: int = 0, world_size: int = 1) -> str | None:
    """Refuse samples of which none has a token that carries loss (every step would have loss 0 and no
    gradient, e.g. data.seq_len shorter than every prompt); a warning line when some have none. Every rank
    counts its 1/W of the samples and one all-reduce adds them up (O(data / W) a rank, nobody waits on a
    rank 0 that reads everything); the count is kept per cache, seq_len and packing (a small json in the
    cache folder), so a restart reads nothing again. Call it on every rank: it is collective when W > 1."""
    name = f"loss-rows-s{cfg_data.seq_len}-{'pack' if cfg_data.pack else 'pad'}-t{int(cfg_data.truncation)}.json"
    stats_path = os.path.join(samples.cache.path, name)
    counted = all_ranks_reduce(int(os.path.exists(stats_path)), "min")  # all read, or all count
    if counted:
        with open(stats_path) as f:
            without = json.load(f)["without_loss_tokens"]
    else:
        plain = Samples(samples.cache, cfg_data.seq_len, cfg_data.pack, cfg_data.truncation)  # one row per sample
        lo, hi = len(plain) * rank // world_size, len(plain) * (rank + 1) // world_size
        mine = sum(int((plain.batch(range(i, min(i + 4096, hi)))[1][:, 1:] == IGNORE).all(dim=1).sum())
                   for i in range(lo, hi, 4096))
        without = all_ranks_reduce(mine, "sum")
        if rank == 0:
            tmp = f"{stats_path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"samples": len(plain), "without_loss_tokens": without}, f)
            os.replace(tmp, stats_path)
    n, where = len(samples), f"{samples.cache.meta['source']} at data.seq_len={cfg_data.seq_len}"
    if without == n:
        raise DataError(f"no sample of {where} has a token that carries loss ({without} of {n} samples end before "
                        "the first trained token, e.g. inside the prompt); raise data.seq_len")
    if without:
        return (f"warning: {without} of {n} samples ({100 * without / n:.1f}%) of {where} have no token that carries "
                "loss (they end inside the prompt) and add nothing to training")
    return None


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
        problem = divisibility_problem(BATCH_KEY, global_batch, world_size)
        if problem:
            raise DataError(problem)
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

    def __init__(self, samples, seed: int, epochs: int, plan: BatchPlan, rank: int):
        self.samples, self.plan, self.rank = samples, plan, rank
        self.order = GlobalOrder(len(samples), seed)
        self.total = epochs * len(samples)
        self.position = 0

    def has_next(self) -> bool:
        return self.position + self.plan.global_batch <= self.total

    def global_rows(self) -> list[int]:
        """Rows of the next global batch in order (what every rank together will consume)."""
        return self.order.rows(self.position, self.plan.global_batch)

    def next_global_batch(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """This rank's micro batches (input_ids, labels, position_ids) of the next global batch; advances position."""
        p = self.plan
        per_rank = p.global_batch // p.world_size
        rows = self.order.rows(self.position + self.rank * per_rank, per_rank)
        self.position += p.global_batch
        return [self.samples.batch(rows[i: i + p.micro_batch]) for i in range(0, per_rank, p.micro_batch)]

    def state_dict(self) -> dict:
        return {"position": self.position, "num_rows": len(self.samples), "seed": self.order.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["num_rows"] != len(self.samples):
            raise DataError(f"checkpoint was made on a data set of {state['num_rows']} samples, this one has "
                            f"{len(self.samples)}; the data position cannot be continued")
        self.position = int(state["position"])
        if int(state.get("seed", self.order.seed)) != self.order.seed:  # only allowed by ckpt.resume_config_check=warn
            self.order = GlobalOrder(len(self.samples), int(state["seed"]))  # the position counts in that order


# ---------------------------------------------------------------- `python -m finetune.data prepare`

def prepare(argv: list[str]) -> int:
    """Tokenize the training (and eval) data of a config ahead of the job, e.g. on a CPU node."""
    import argparse

    from finetune.config import ConfigError, load_config
    from finetune.model import ModelError, load_tokenizer

    p = argparse.ArgumentParser(prog="python -m finetune.data prepare", description=prepare.__doc__)
    p.add_argument("--config", default=None, help="the YAML preset the training job will use")
    p.add_argument("overrides", nargs="*", help="key=value, exactly as given to train_fsdp.py")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        tokenizer = load_tokenizer(cfg.model)
        for eval_set in (False, True) if cfg.data.eval_path else (False,):
            cache = build_cache(cfg.data, tokenizer, eval_set, progress=True)
            samples = open_samples(cache, cfg.data)
            meta = samples.cache.meta
            print(f"{'eval' if eval_set else 'train'}: {cache} | {meta['n_docs']:,} documents | "
                  f"{meta['n_tokens']:,} tokens | {len(samples):,} samples of {cfg.data.seq_len}")
    except (ConfigError, DataError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["prepare"]:
        sys.exit(prepare(sys.argv[2:]))
    asked = sys.argv[1:2] in (["-h"], ["--help"])
    print(f"usage: python -m finetune.data prepare --config <yaml> [key=value ...]\n\n{prepare.__doc__}\n"
          "python -m finetune.data prepare --help lists the options.", file=sys.stdout if asked else sys.stderr)
    sys.exit(0 if asked else 2)
