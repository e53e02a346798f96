"""Data: world-size independent order, prompt masking, packing, batch-size errors.

    python -m pytest tests/test_data.py -q
"""

import numpy as np
import pytest
from transformers import AutoTokenizer

from finetune.data import IGNORE, BatchPlan, BatchStream, DataError, GlobalOrder, cache_samples, open_samples, \
    to_samples, tokenize_chat
from finetune.config import DataConfig

TOK_DIR = "assets/tiny-llama"


@pytest.fixture(scope="module")
def tok(repo_root):
    import os
    return AutoTokenizer.from_pretrained(os.path.join(repo_root, TOK_DIR))


def _rows_by_rank(num_rows, global_batch, world, n_batches, seed=7):
    """For each global batch, the rows each rank consumed (ranks in order)."""
    ids = np.arange(num_rows, dtype=np.int32)[:, None].repeat(4, 1)
    plan = BatchPlan.make(global_batch, micro_batch=2, world_size=world)
    streams = [BatchStream(ids, ids, seed, epochs=3, plan=plan, rank=r) for r in range(world)]
    out = []
    for _ in range(n_batches):
        per_rank = []
        for s in streams:
            per_rank.append([int(row) for ids_mb, _ in s.next_global_batch() for row in ids_mb[:, 0]])
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
    plan = BatchPlan.make(8, 4, 2)
    straight = BatchStream(ids, ids, 1, 2, plan, rank=1)
    batches = [straight.next_global_batch() for _ in range(6)]
    resumed = BatchStream(ids, ids, 1, 2, BatchPlan.make(8, 4, 1), rank=0)
    resumed.load_state_dict({"position": 3 * 8, "num_rows": 40, "seed": 1})
    assert resumed.global_rows() == straight.order.rows(3 * 8, 8)
    assert batches[3][0][0][:, 0].tolist() == straight.order.rows(3 * 8 + 4, 4)  # rank 1 takes the 2nd half


def test_batch_plan_errors_name_sizes():
    with pytest.raises(DataError, match=r"not divisible by world size 5.*\[1, 2, 3, 4, 6, 12\]"):
        BatchPlan.make(12, 2, 5)
    assert BatchPlan.make(12, 4, 2) == BatchPlan(12, 2, 3, 2)  # 6 per rank: micro 4 lowered to 3, no error
    assert BatchPlan.make(12, 2, 2) == BatchPlan(12, 2, 2, 3)


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


def test_packing_concatenates_and_drops_tail():
    docs = [([1, 2, 3], [1, 2, 3]), ([4, 5], [IGNORE, 5]), ([6, 7, 8, 9], [6, 7, 8, 9])]
    ids, labels = to_samples(docs, seq_len=4, pack=True, pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert labels.tolist() == [[1, 2, 3, IGNORE], [5, 6, 7, 8]]


def test_padding_truncates_and_masks_pads():
    docs = [([1, 2], [1, 2]), ([3, 4, 5, 6, 7], [3, 4, 5, 6, 7])]
    ids, labels = to_samples(docs, seq_len=4, pack=False, pad_id=0)
    assert ids.tolist() == [[1, 2, 0, 0], [3, 4, 5, 6]]
    assert labels.tolist() == [[1, 2, IGNORE, IGNORE], [3, 4, 5, 6]]


def test_text_file_end_to_end_with_cache(tmp_path, tok):
    f = tmp_path / "d.txt"
    f.write_text("hello world\nsecond line here\n")
    cfg = DataConfig(path=str(f), seq_len=8, pack=True, cache_dir=str(tmp_path / "cache"))
    cache = cache_samples(cfg, tok)
    assert cache_samples(cfg, tok) == cache  # second call hits the cache
    ids, labels = open_samples(cache)
    assert ids.shape[1] == 8 and len(ids) == (len("hello world") + len("second line here") + 2) // 8
    assert tok.decode(ids[0].tolist()) == "hello wo"


def test_missing_and_empty_data_are_clear_errors(tmp_path, tok):
    with pytest.raises(DataError, match="data file not found"):
        cache_samples(DataConfig(path=str(tmp_path / "nope.jsonl"), cache_dir=str(tmp_path)), tok)
    empty = tmp_path / "e.txt"
    empty.write_text("hi\n")
    with pytest.raises(DataError, match="no samples"):
        cache_samples(DataConfig(path=str(empty), seq_len=64, pack=True, cache_dir=str(tmp_path)), tok)
