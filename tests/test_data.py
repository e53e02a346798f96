"""Data: world-size independent order, prompt masking, packing, batch-size errors.

    python -m pytest tests/test_data.py -q
"""

import json
import os
import re

import numpy as np
import pytest
from transformers import AutoTokenizer

from finetune.data import IGNORE, ArraySamples, BatchSplit, BatchStream, DataError, GlobalOrder, build_cache, \
    open_samples, tokenize_chat
from finetune.config import DataConfig

TOK_DIR = "assets/tiny-llama"


@pytest.fixture(scope="module")
def tok(repo_root):
    import os
    return AutoTokenizer.from_pretrained(os.path.join(repo_root, TOK_DIR))


def _rows_by_rank(num_rows, global_batch, world, n_batches, seed=7):
    """For each global batch, the rows each rank consumed (ranks in order)."""
    ids = np.arange(num_rows, dtype=np.int32)[:, None].repeat(4, 1)
    plan = BatchSplit.make(global_batch, micro_batch=2, world_size=world)
    streams = [BatchStream(ArraySamples(ids, ids), seed, epochs=3, split=plan, rank=r) for r in range(world)]
    out = []
    for _ in range(n_batches):
        per_rank = []
        for s in streams:
            per_rank.append([int(row) for ids_mb, _, _ in s.next_global_batch() for row in ids_mb[:, 0]])
        out.append(per_rank)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_global_batches_identical_for_any_world_size(world):
    one = _rows_by_rank(50, 12, 1, 10)   # 10 batches of 12 over 50 rows: crosses epoch boundaries
    many = _rows_by_rank(50, 12, world, 10)
    for b in range(10):
        concat = [row for rank_rows in many[b] for row in rank_rows]
        assert concat == one[b][0], f"global batch {b} differs at world size {world}"


def test_order_is_a_pure_function_of_seed_epoch_index():
    a, b = GlobalOrder(100, seed=3), GlobalOrder(100, seed=3)
    assert [a.row(g) for g in range(250)] == [b.row(g) for g in reversed(range(250))][::-1]
    assert sorted(a.rows(0, 100)) == list(range(100))          # each epoch is a permutation
    assert a.rows(0, 100) != a.rows(100, 100)                    # and epochs differ
    assert GlobalOrder(100, seed=4).rows(0, 100) != a.rows(0, 100)


def test_resume_position_continues_the_same_stream():
    ids = np.arange(40, dtype=np.int32)[:, None].repeat(2, 1)
    plan = BatchSplit.make(8, 4, 2)
    straight = BatchStream(ArraySamples(ids, ids), 1, 2, plan, rank=1)
    batches = [straight.next_global_batch() for _ in range(6)]
    resumed = BatchStream(ArraySamples(ids, ids), 1, 2, BatchSplit.make(8, 4, 1), rank=0)
    resumed.load_state_dict({"position": 3 * 8, "num_rows": 40, "seed": 1})
    assert resumed.global_rows() == straight.order.rows(3 * 8, 8)
    assert batches[3][0][0][:, 0].tolist() == straight.order.rows(3 * 8 + 4, 4)  # rank 1 takes the 2nd half


def test_batch_split_errors_name_sizes():
    with pytest.raises(DataError, match=r"not divisible by world size 5.*\[1, 2, 3, 4, 6, 12\]"):
        BatchSplit.make(12, 2, 5)
    assert BatchSplit.make(12, 4, 2) == BatchSplit(12, 2, 3, 2)  # 6 per rank: micro 4 lowered to 3, no error
    assert BatchSplit.make(12, 2, 2) == BatchSplit(12, 2, 2, 3)


def test_chat_prompt_tokens_are_masked(tok):
    msgs = [{"role": "user", "content": "reverse: abc"}, {"role": "assistant", "content": "cba"}]
    ids, labels = tokenize_chat(tok, msgs)
    learned = tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE])
    assert learned == "cba<|end|>"
    prompt = tok.decode([i for i, lab in zip(ids, labels) if lab == IGNORE])
    assert "reverse: abc" in prompt and "<|assistant|>" in prompt


def test_multi_turn_masks_every_non_assistant_turn(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "a2"}]
    ids, labels = tokenize_chat(tok, msgs)
    assert tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE]) == "a1<|end|>a2<|end|>"


def _cache_of(docs, masks=None):
    """A TokenCache stand-in holding these documents (what build_cache writes, in memory)."""
    from types import SimpleNamespace
    tokens = np.array([t for d in docs for t in d], dtype=np.int32)
    mask = np.array([m for i, d in enumerate(docs) for m in (masks[i] if masks else [1] * len(d))], dtype=np.uint8)
    offsets = np.cumsum([0] + [len(d) for d in docs]).astype(np.int64)
    return SimpleNamespace(tokens=tokens, mask=mask, offsets=offsets,
                           meta={"n_docs": len(docs), "n_tokens": len(tokens), "pad_id": 0, "source": "docs.jsonl"})


def test_packing_concatenates_restarts_positions_and_drops_tail():
    from finetune.data import Samples
    s = Samples(_cache_of([[1, 2, 3], [4, 5], [6, 7, 8, 9]], [[1, 1, 1], [0, 1], [1, 1, 1, 1]]), seq_len=4, pack=True)
    ids, labels, pos = s.batch([0, 1])
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert pos.tolist() == [[0, 1, 2, 0], [0, 0, 1, 2]]  # a new document (or a chunk's first token) restarts at 0
    # a document's first token is never predicted from the one before it (another document)
    assert labels.tolist() == [[IGNORE, 2, 3, IGNORE], [IGNORE, IGNORE, 7, 8]]


def test_padding_truncates_and_masks_pads():
    from finetune.data import Samples
    s = Samples(_cache_of([[1, 2], [3, 4, 5, 6, 7]]), seq_len=4, pack=False)
    ids, labels, pos = s.batch([0, 1])
    assert ids.tolist() == [[1, 2, 0, 0], [3, 4, 5, 6]] and pos is None
    assert labels.tolist() == [[1, 2, IGNORE, IGNORE], [3, 4, 5, 6]]
    with pytest.raises(DataError, match=r"docs.jsonl row 2: 5 tokens, longer than data.seq_len=4 \(1 such rows\)"):
        Samples(_cache_of([[1, 2], [3, 4, 5, 6, 7]]), seq_len=4, pack=False, truncation=False)


def test_text_file_end_to_end_with_cache(tmp_path, tok):
    f = tmp_path / "d.txt"
    f.write_text("hello world\nsecond line here\n")
    cfg = DataConfig(path=str(f), seq_len=8, pack=True, cache_dir=str(tmp_path / "cache"))
    cache = build_cache(cfg, tok)
    assert build_cache(cfg, tok) == cache  # second call hits the cache
    samples = open_samples(cache, cfg)
    ids, _, _ = samples.batch(range(len(samples)))
    assert ids.shape[1] == 8 and len(ids) == (len("hello world") + len("second line here") + 2) // 8
    assert tok.decode(ids[0].tolist()) == "hello wo"


def test_missing_and_empty_data_are_clear_errors(tmp_path, tok):
    with pytest.raises(DataError, match="data file not found"):
        build_cache(DataConfig(path=str(tmp_path / "nope.jsonl"), cache_dir=str(tmp_path)), tok)
    empty = tmp_path / "e.txt"
    empty.write_text("hi\n")
    with pytest.raises(DataError, match="no samples"):
        cfg = DataConfig(path=str(empty), seq_len=64, pack=True, cache_dir=str(tmp_path))
        open_samples(build_cache(cfg, tok), cfg)


def _chat_rows(path, n: int) -> None:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"reverse: w{i}"},
                                                     {"role": "assistant", "content": f"{i}w"}]}) + "\n"
                            for i in range(n)))


@pytest.mark.parametrize("make,needle", [
    (lambda p: p.write_text(""), "data file is empty: {p}"),
    (lambda p: p.write_text("\n\n"), "cannot read data file(s) {p}"),
    (lambda p: (_chat_rows(p, 30), p.write_bytes(p.read_bytes().replace(b'reverse: w2"', b'reverse: w\xff2"', 1))),
     "data file {p} line 3 is not valid UTF-8: byte b'\\xff' at column"),
], ids=["empty", "blank-lines", "not-utf8"])
def test_a_bad_data_file_is_one_error_naming_it(tmp_path, tok, make, needle):
    """Each message, raised where the file is read; how a DataError reaches the user (one `error:` line, exit 2,
    no traceback) is tests/test_bad_input.py's test_bad_data_file, run for a missing file."""
    data = tmp_path / "train.jsonl"
    make(data)
    with pytest.raises(DataError) as e:
        build_cache(DataConfig(path=str(data), epochs=1, cache_dir=str(tmp_path / "cache")), tok)
    assert needle.format(p=data) in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- the tokenizing pipeline (issue 13)

def _conversations(n: int, seed: int = 0) -> list[dict]:
    """Chat rows of 1-4 turns, with a system message now and then."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        msgs = [{"role": "system", "content": "be brief"}] if i % 5 == 0 else []
        for t in range(int(rng.integers(1, 5))):
            word = "".join(rng.choice(list("abcdefghij"), int(rng.integers(1, 9))))
            msgs += [{"role": "user", "content": f"reverse: {word}"}, {"role": "assistant", "content": word[::-1]}]
        rows.append({"messages": msgs})
    return rows


def _write_jsonl(path, rows) -> str:
    import json
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _old_tokenize_chat(tok, messages):
    """Today's rule before the pipeline: tokenize every prefix and compare token lists (the reference)."""
    def ids_of(msgs, gen=False):
        return tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen),
                   add_special_tokens=False)["input_ids"]
    ids = ids_of(messages)
    labels = [IGNORE] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, end = len(ids_of(messages[:i], True)), len(ids_of(messages[: i + 1]))
            labels[start:end] = ids[start:end]
    return ids, labels


def test_parallel_cache_equals_serial_and_the_old_per_prefix_masking(tmp_path, tok):
    rows = _conversations(300)
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    caches = {}
    for procs in (1, 2):
        cfg = DataConfig(path=path, seq_len=128, cache_dir=str(tmp_path / f"cache{procs}"))
        caches[procs] = build_cache(cfg, tok, num_proc=procs)
    for name in ("tokens.bin", "loss_mask.bin", "doc_offsets.bin"):
        a, b = (open(os.path.join(caches[p], name), "rb").read() for p in (1, 2))
        assert a == b, f"{name} differs between 1 and 2 tokenizer processes"
    samples = open_samples(caches[2], DataConfig(path=path, seq_len=128))
    ids, labels, _ = samples.batch(range(len(rows)))
    for i, row in enumerate(rows):
        ref_ids, ref_labels = _old_tokenize_chat(tok, row["messages"])
        n = len(ref_ids)
        assert ids[i, :n].tolist() == ref_ids and labels[i, :n].tolist() == ref_labels, f"row {i} differs"


# the tiny template (finetune/tiny_assets.py CHAT_TEMPLATE) with each assistant turn's output marked for
# transformers' return_assistant_tokens_mask: it renders the same strings, so both masking rules apply to it
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}<|end|>"
    "{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def generation_tok(repo_root):
    t = AutoTokenizer.from_pretrained(os.path.join(repo_root, TOK_DIR))
    t.chat_template = GENERATION_TEMPLATE
    return t


def test_generation_template_renders_once_and_masks_like_the_prefix_rule(tmp_path, tok, generation_tok, monkeypatch):
    """A template with {% generation %} renders each conversation once; its cache is byte-identical to the
    prefix rule's on the same conversations (the template renders the same strings)."""
    import finetune.data.chat as chat
    rendered = []
    real_render = chat._render
    monkeypatch.setattr(chat, "_render", lambda t, convs, *a, **k: (rendered.append(len(convs)), real_render(
        t, convs, *a, **k))[1])
    rows = _conversations(300)
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    caches = {}
    for name, t in (("prefix", tok), ("generation", generation_tok)):
        rendered.clear()
        caches[name] = build_cache(DataConfig(path=path, cache_dir=str(tmp_path / name)), t, num_proc=1)
        assert sum(rendered) == (300 if name == "generation" else 300 + 2 * sum(
            sum(m["role"] == "assistant" for m in r["messages"]) for r in rows) - 300), (name, sum(rendered))
    for name in ("tokens.bin", "loss_mask.bin", "doc_offsets.bin"):
        a, b = (open(os.path.join(caches[k], name), "rb").read() for k in ("prefix", "generation"))
        assert a == b, f"{name} differs between the prefix rule and the {{% generation %}} spans"
    assert sum(open(os.path.join(caches["generation"], "loss_mask.bin"), "rb").read()) > 0


def test_generation_template_errors_and_the_slow_rendering_path(generation_tok):
    from finetune.data import tokenize_chat_batch
    msgs = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    extra = [{**m, "name": "x"} for m in msgs]  # not plain: rendered by transformers' render_jinja_template
    ids, (mask,) = tokenize_chat_batch(generation_tok, [msgs], ["r"])
    slow_ids, (slow_mask,) = tokenize_chat_batch(generation_tok, [extra], ["r"])
    assert slow_ids == ids and slow_mask.tolist() == mask.tolist()
    assert generation_tok.decode([i for i, m in zip(ids[0], mask) if m]) == "a1<|end|>a2<|end|>"
    last_only = GENERATION_TEMPLATE.replace("{% generation %}", "{% if loop.last %}{% generation %}")
    last_only = last_only.replace("{% endgeneration %}", "{% endgeneration %}{% else %}<|end|>{% endif %}")
    generation_tok.chat_template = last_only
    with pytest.raises(DataError, match=r"^r: the chat template marks 1 \{% generation %\} block\(s\) for 2 assistant"):
        tokenize_chat_batch(generation_tok, [msgs], ["r"])


def test_slow_tokenizer_is_a_one_line_error_for_chat_data(tmp_path):
    """A slow (Python) tokenizer returns no `encodings` (character offsets): chat data refuses it in one line,
    before tokenizing, and nothing is left in the cache; text data needs no offsets and works."""
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy
    vocab = tmp_path / "vocab.txt"
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *map(chr, range(33, 127))]
    vocab.write_text("".join(f"{t}\n" for t in tokens))
    slow = BertTokenizerLegacy(str(vocab))
    slow.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert not slow.is_fast and slow(["a b"], add_special_tokens=False).encodings is None
    path = _write_jsonl(tmp_path / "chat.jsonl", _conversations(10))
    with pytest.raises(DataError, match=r"^chat data needs a fast tokenizer .* BertTokenizerLegacy .* is a slow"):
        build_cache(DataConfig(path=path, cache_dir=str(tmp_path / "cache")), slow, num_proc=1)
    assert os.listdir(tmp_path / "cache") == []
    with pytest.raises(DataError, match=r"^chat data needs a fast tokenizer"):
        tokenize_chat(slow, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    text = tmp_path / "d.txt"
    text.write_text("a b c\nd e\n")
    build_cache(DataConfig(path=str(text), cache_dir=str(tmp_path / "cache")), slow, num_proc=1)


def test_map_workers_fork_from_a_frozen_heap_and_the_gc_is_restored(tmp_path, tok, monkeypatch):
    """gc.freeze() around the forking map keeps the workers from copying the parent's pages (docs/data.md);
    the parent's collector must be back to normal afterwards, also when a row is bad."""
    import gc

    import datasets
    frozen_at_map = []
    real_map = datasets.Dataset.map
    monkeypatch.setattr(datasets.Dataset, "map", lambda self, *a, **k: (
        frozen_at_map.append((k.get("num_proc"), gc.get_freeze_count() > 0)), real_map(self, *a, **k))[1])
    rows = _conversations(40)
    good = _write_jsonl(tmp_path / "good.jsonl", rows)
    rows[5]["messages"][1]["role"] = "user"
    bad = _write_jsonl(tmp_path / "bad.jsonl", rows)
    for path, procs in ((good, 1), (good, 2), (bad, 2)):
        try:
            build_cache(DataConfig(path=path, cache_dir=str(tmp_path / f"cache-{procs}")), tok, num_proc=procs)
        except DataError:
            assert path == bad
        assert gc.get_freeze_count() == 0, "build_cache left objects frozen out of the garbage collector"
    assert frozen_at_map == [(None, False), (2, True), (2, True)], frozen_at_map


@pytest.mark.parametrize("procs", [1, 2])
def test_bad_conversation_names_file_row_and_field_and_leaves_no_cache(tmp_path, tok, procs):
    rows = _conversations(40)
    rows[31]["messages"][1]["role"] = "user"  # two user turns in a row (row 32, 1-based)
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    cache_dir = tmp_path / "cache"
    with pytest.raises(DataError) as e:
        build_cache(DataConfig(path=path, cache_dir=str(cache_dir)), tok, num_proc=procs)
    assert str(e.value).startswith(f"{path} row 32: messages[1].role is 'user', expected 'assistant'"), str(e.value)
    assert not cache_dir.exists() or os.listdir(cache_dir) == [], "a failed build left files in the cache"


def test_saved_folder_parquet_folder_split_and_mixture(tmp_path, tok):
    """The local equivalents of hub data sets: a `save_to_disk` DatasetDict (splits) and a parquet folder,
    loaded through the same `load_dataset` call a hub name takes; a weighted mixture is deterministic."""
    import datasets
    from finetune.data import load_documents

    chat = datasets.Dataset.from_list(_conversations(60))
    datasets.DatasetDict({"train": chat, "validation": chat.select(range(10))}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "pq").mkdir()
    datasets.Dataset.from_list(_conversations(40, seed=1)).to_parquet(str(tmp_path / "pq" / "part-0.parquet"))

    ds, fmt, _, _ = load_documents(DataConfig(path=str(tmp_path / "saved"), split="validation"))
    assert len(ds) == 10 and fmt == "chat"
    ds, _, _, _ = load_documents(DataConfig(path=str(tmp_path / "saved"), eval_path="split:validation"), eval_set=True)
    assert len(ds) == 10
    ds, _, _, _ = load_documents(DataConfig(path=str(tmp_path / "pq")))
    assert len(ds) == 40
    mix = DataConfig(mixture=f"{tmp_path / 'saved'}:3; {tmp_path / 'pq'}:1")
    a, b = load_documents(mix)[0], load_documents(mix)[0]
    assert a["messages"] == b["messages"]  # same mixture, same rows in the same order
    sources = {json_row(m) for m in chat["messages"]}
    from_saved = sum(json_row(m) in sources for m in a["messages"])
    assert 0.6 < from_saved / len(a) < 0.9  # weights 3:1 -> about 75% from the first source
    with pytest.raises(DataError, match="must look like <path>:<weight>"):
        load_documents(DataConfig(mixture=f"{tmp_path / 'pq'}"))
    with pytest.raises(DataError, match="has no split 'test'"):
        load_documents(DataConfig(path=str(tmp_path / "saved"), split="test"))


def test_bad_rows_of_a_mixture_name_their_file_and_own_row(tmp_path, tok):
    """A mixture's rows are interleaved; its errors still name the source file and the row within it (not the
    position in the interleaved stream): a bad role while tokenizing (2 worker processes), a too-long row
    when the samples are opened with data.truncation=false."""
    a = _write_jsonl(tmp_path / "a.jsonl", _conversations(30))
    rows = _conversations(30, seed=1)
    rows[11]["messages"][1]["role"] = "user"  # b.jsonl row 12
    bad = _write_jsonl(tmp_path / "b.jsonl", rows)
    with pytest.raises(DataError) as e:
        build_cache(DataConfig(mixture=f"{a}:1; {bad}:1", cache_dir=str(tmp_path / "c1")), tok, num_proc=2)
    assert str(e.value).startswith(f"{bad} row 12: messages[1].role is 'user', expected 'assistant'"), str(e.value)
    rows = _conversations(30, seed=1)
    rows[4]["messages"][-1]["content"] = "x" * 300  # b.jsonl row 5
    long = _write_jsonl(tmp_path / "long.jsonl", rows)
    cfg = DataConfig(mixture=f"{a}:1; {long}:1", seq_len=256, truncation=False, cache_dir=str(tmp_path / "c2"))
    cache = build_cache(cfg, tok, num_proc=1)
    with pytest.raises(DataError) as e:
        open_samples(cache, cfg)
    assert re.match(rf"{long} row 5: 3\d\d tokens, longer than data.seq_len=256 \(1 such rows\)", str(e.value)), e.value
    from finetune.data import TokenCache
    sources = TokenCache(cache).doc_sources
    assert sorted(sources[sources[:, 0] == 1, 1].tolist()) == list(range(len(sources[sources[:, 0] == 1])))
    assert (sources[:, 0] == 1).nonzero()[0][4] != 4  # row 5 of long.jsonl is elsewhere in the stream


def json_row(messages) -> str:
    import json
    return json.dumps(messages, sort_keys=True)


def test_prepare_ahead_then_training_reuses_the_cache(tmp_path):
    """`python -m finetune.data prepare` with the training overrides; the run then finds both caches committed."""
    from conftest import run_python, run_train
    run = tmp_path / "run"
    args = [f"run.dir={run}", "data.seq_len=32"]
    out = run_python(["-m", "finetune.data", "prepare", "--config", "configs/tiny.yaml", *args])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "train: " in out.stdout and "eval: " in out.stdout and "4,096 documents" in out.stdout
    caches = sorted((run / "data-cache").iterdir())
    assert len(caches) == 2 and all((c / "COMMIT").exists() for c in caches)
    stamp = {c: (c / "tokens.bin").stat().st_mtime_ns for c in caches}
    run_train(run, nproc=0, overrides=["train.max_steps=1", "data.cache_dir=", "ckpt.interval=0"], timeout=300)
    assert {c: (c / "tokens.bin").stat().st_mtime_ns for c in caches} == stamp  # not rebuilt
    bad = run_python(["-m", "finetune.data", "prepare", "--config", "configs/tiny.yaml",
                      f"data.path={tmp_path}/nope.jsonl"])
    assert bad.returncode == 2 and bad.stderr.strip() == f"error: data file not found: {tmp_path}/nope.jsonl"


def test_too_long_row_with_truncation_off_exits_2_naming_file_and_row(tmp_path):
    """`prepare` opens the samples as training will: data.truncation=false and a row longer than seq_len is one
    `error:` line naming the file and the row, exit 2."""
    from conftest import run_python
    rows = [{"messages": [{"role": "user", "content": f"reverse: {w}"}, {"role": "assistant", "content": w[::-1]}]}
            for w in ("abc", "hello", "x" * 90, "qwerty", "y" * 80)]  # rows 3 and 5 are too long for 64 tokens
    path = _write_jsonl(tmp_path / "long.jsonl", rows)
    proc = run_python(["-m", "finetune.data", "prepare", "--config", "configs/tiny.yaml",
                       f"run.dir={tmp_path / 'run'}", f"data.path={path}", "data.seq_len=64", "data.truncation=false"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]  # the rest: progress bars
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.fullmatch(rf"error: {path} row 3: \d+ tokens, longer than data.seq_len=64 \(2 such rows\); raise "
                        r"seq_len or set data.truncation=true", errors[0]), errors[0]


def test_bad_row_stops_both_ranks_with_one_line(tmp_path):
    """Under torchrun the rank-0 tokenizing error reaches rank 1 through the store (common/handoff.py): both stop, one line."""
    from conftest import run_train
    rows = _conversations(30)
    rows[6]["messages"][1]["role"] = "assistent"  # a typo in row 7
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    proc = run_train(tmp_path / "run", nproc=2, check=False, timeout=180, overrides=[f"data.path={path}"])
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    want = f"error: {path} row 7: messages[1].role is 'assistent', expected 'assistant'"
    assert ours and all(line.startswith(want) for line in ours), proc.stderr[-3000:]
    assert 'train_fsdp.py", line' not in proc.stderr


def test_hub_name_goes_to_load_dataset_with_subset_split_revision(monkeypatch):
    """Offline here: record the call a hub name makes (the same call a local folder of files takes)."""
    import datasets

    from finetune.data import load_documents
    seen = {}

    def fake_load_dataset(path, name=None, split=None, revision=None, cache_dir=None):
        seen.update(path=path, name=name, split=split, revision=revision, cache_dir=cache_dir)
        return datasets.Dataset.from_list([{"text": "hello"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds, fmt, column, _ = load_documents(DataConfig(path="org/chat-set", name="en", split="train_sft", revision="v1.0"))
    assert seen == {"path": "org/chat-set", "name": "en", "split": "train_sft", "revision": "v1.0", "cache_dir": None}
    assert fmt == "text" and ds[column] == ["hello"]


def test_full_disk_while_building_is_one_line_and_leaves_nothing(tmp_path, tok, monkeypatch):
    import errno

    import finetune.data.cache as cache
    path = _write_jsonl(tmp_path / "chat.jsonl", _conversations(20))

    def full_disk(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache, "_write_cache", full_disk)
    with pytest.raises(DataError, match=r"cannot build the data cache in .*No space left on device"):
        build_cache(DataConfig(path=path, cache_dir=str(tmp_path / "cache")), tok)
    assert os.listdir(tmp_path / "cache") == []


# ---------------------------------------------------------------- what a run tells a person about its data

@pytest.fixture(scope="module")
def readme_like_runs(tmp_path_factory):
    """Two W=1 training runs on text rows of which most are longer than seq_len=32 (like the README's example):
    the first tokenizes, the second finds the cache (and its counts) committed."""
    import json

    from conftest import run_train
    tmp = tmp_path_factory.mktemp("readme-like")
    path = tmp / "lines.jsonl"
    words = "fully sharded data parallel keeps one shard of every parameter on each rank".split()
    path.write_text("".join(json.dumps({"text": " ".join(words[: 1 + i % len(words)] * (1 + i % 5))}) + "\n"
                            for i in range(150)))
    args = [f"data.path={path}", "data.eval_path=", "train.eval_interval=0", "train.sample_prompts=",
            "train.max_steps=1", "ckpt.interval=0", "ckpt.save_at_end=false", f"data.cache_dir={tmp}/cache"]
    runs = [run_train(tmp / f"run{k}", nproc=0, overrides=args, timeout=300) for k in range(2)]
    (cache,) = [c for c in (tmp / "cache").iterdir() if (c / "COMMIT").exists()]
    return path, cache, runs


def test_truncated_rows_are_reported_once_at_the_start_also_from_the_cache(readme_like_runs):
    """The count of rows cut to seq_len and the share of tokens dropped, checked against the cache's own
    document lengths; the second run (cache and counts already there) says the same."""
    path, cache, runs = readme_like_runs
    lengths = np.diff(np.fromfile(cache / "doc_offsets.bin", dtype=np.int64))
    over = lengths[lengths > 32] - 32
    assert len(over) > len(lengths) // 2, "the data must have rows longer than seq_len"
    rows, cut, total = len(over), int(over.sum()), int(lengths.sum())
    expected = (f"warning: {rows:,} of {len(lengths):,} rows ({100 * rows / len(lengths):.1f}%) of {path} are "
                f"longer than data.seq_len=32 and cut to it (data.truncation): {cut:,} of {total:,} tokens "
                f"({100 * cut / total:.1f}%) are dropped; raise data.seq_len, or set data.pack=true to train on "
                "every token")
    for proc in runs:
        lines = proc.stdout.splitlines()
        assert lines.count(expected) == 1, proc.stdout[-3000:]
        first_step = min(i for i, line in enumerate(lines) if line.startswith("step "))
        assert lines.index(expected) < first_step, "not said at the start"


def test_packing_tail_is_reported(tmp_path, tok):
    """Packing drops the tokens after the last full sample: how many, and their share."""
    from finetune.data import check_samples
    f = tmp_path / "d.txt"
    f.write_text("hello world\nsecond line here\nand a third one\n")
    cfg = DataConfig(path=str(f), seq_len=8, pack=True, cache_dir=str(tmp_path / "cache"))
    samples = open_samples(build_cache(cfg, tok), cfg)
    total = samples.cache.meta["n_tokens"]
    tail = total - 8 * len(samples)
    assert 0 < tail < 8
    assert check_samples(samples, cfg) == (f"data: packing {f} into samples of data.seq_len=8 drops the last {tail} of "
                                           f"{total} tokens ({100 * tail / total:.1f}%), too few to fill a sample")


def test_tokenizing_in_a_run_says_what_and_how_long_without_a_bar_in_a_log(readme_like_runs):
    """stdout is not a terminal here: a start line naming the file, an end line with rows, tokens and time,
    and no progress bar in either stream; the run that finds the cache says neither."""
    path, cache, (first, cached) = readme_like_runs
    meta = json.loads((cache / "meta.json").read_text())
    lines = first.stdout.splitlines()
    start = [i for i, line in enumerate(lines) if line == f"data: tokenizing the training data {path} into {cache}"]
    end = [i for i, line in enumerate(lines)
           if re.fullmatch(rf"data: tokenized 150 rows into {meta['n_tokens']:,} tokens in \d+\.\ds", line)]
    assert len(start) == len(end) == 1 and start[0] < end[0], first.stdout[-3000:]
    for out in (first.stdout, first.stderr):
        assert "\r" not in out and "tokenize:" not in out and "examples/s" not in out, out[-3000:]
    assert "data: tokeniz" not in cached.stdout, cached.stdout[-3000:]


def test_a_line_that_is_not_json_is_one_error_line_with_file_and_line(tmp_path):
    """datasets reports it as 'row 50' (0-based) on a line of its own; the one `error:` line gives the file and
    the 1-based line an editor shows. A .json file that is one document over many lines is parsed as such."""
    from conftest import run_python
    from finetune.data.sources import first_bad_line
    path = tmp_path / "bad.jsonl"
    path.write_text("".join('{"text": "row %d"}\n' % i if i != 50 else '{"text": oops}\n' for i in range(60)))
    proc = run_python(["-m", "finetune.data", "prepare", "--config", "configs/tiny.yaml",
                       f"run.dir={tmp_path / 'run'}", f"data.path={path}"])
    assert proc.returncode == 2
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        f"error: data file {path} line 51 is not valid JSON: Expecting value at column 10"], proc.stderr
    doc = tmp_path / "doc.json"
    doc.write_text('[\n {"text": "a"},\n {"text": b}\n]\n')
    assert first_bad_line(str(doc)) == f"data file {doc} line 3 is not valid JSON: Expecting value at column 11"
    doc.write_text('[\n {"text": "a"}\n]\n')
    assert first_bad_line(str(doc)) is None
