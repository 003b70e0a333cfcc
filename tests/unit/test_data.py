"""Prompt parquet reading, tokenization, truncation, errors, and the seeded resumable sampler."""

from __future__ import annotations

import itertools

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from megatron_rl.data import (
    PromptDataLoader,
    PromptDataset,
    PromptSampler,
    build_char_tokenizer,
    dp_share,
    eval_batches,
    read_prompt_files,
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def write_rows(path, prompts, sources=None, truths=None, extra=True):
    n = len(prompts)
    columns = {
        "prompt": prompts,
        "data_source": sources or ["openai/gsm8k"] * n,
        "reward_model": [
            {"style": "rule", "ground_truth": g} for g in (truths or [str(i) for i in range(n)])
        ],
    }
    if extra:
        columns["extra_info"] = [{"index": i, "split": "train"} for i in range(n)]
    pq.write_table(pa.table(columns), path)
    return path


def chat(text):
    return [{"role": "user", "content": text}]


def test_chat_prompts_round_trip(tmp_path, tok):
    path = write_rows(tmp_path / "a.parquet", [chat("1+1?"), chat("2+2?")], truths=["2", "4"])
    ds = PromptDataset(str(path), tok)
    assert len(ds) == 2
    row = ds[1]
    expected = tok.apply_chat_template(chat("2+2?"), add_generation_prompt=True, tokenize=False)
    assert row.prompt_text == expected
    assert row.prompt_ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert row.raw_prompt == chat("2+2?")
    assert (row.data_source, row.ground_truth, row.index) == ("openai/gsm8k", "4", 1)
    assert row.extra_info == {"index": 1, "split": "train"}
    assert tok.decode(row.prompt_ids).endswith("<|im_start|>assistant\n")


def test_string_prompts_with_and_without_chat_template(tmp_path, tok):
    path = write_rows(tmp_path / "s.parquet", ["abc"], extra=False)
    templated = PromptDataset(path, tok)[0]
    assert templated.prompt_text == tok.apply_chat_template(
        chat("abc"), add_generation_prompt=True, tokenize=False
    )
    assert templated.extra_info == {}
    raw = PromptDataset(path, tok, apply_chat_template=False)[0]
    assert raw.prompt_text == "abc" and tok.decode(raw.prompt_ids) == "abc"
    no_template = build_char_tokenizer(chat_template=None)
    assert PromptDataset(path, no_template)[0].prompt_ids == no_template("abc")["input_ids"]
    chat_path = write_rows(tmp_path / "c.parquet", [chat("abc")])
    with pytest.raises(ValueError, match="no chat_template"):
        PromptDataset(chat_path, no_template)


def test_multiple_files_concatenate_in_order(tmp_path, tok):
    a = write_rows(tmp_path / "a.parquet", ["a", "b"], truths=["1", "2"])
    b = write_rows(tmp_path / "b.parquet", ["c"], truths=["3"])
    ds = PromptDataset([a, b], tok, apply_chat_template=False)
    assert [r.ground_truth for r in ds.rows] == ["1", "2", "3"]
    assert [r.index for r in ds.rows] == [0, 1, 2]
    assert [r.file_row for r in read_prompt_files(tmp_path)] == [0, 1, 0]  # a directory means its *.parquet


def test_truncation_modes(tmp_path, tok, caplog):
    path = write_rows(tmp_path / "t.parquet", ["abcdefgh", "ab", "abcdef"])
    kw = dict(max_prompt_length=4, apply_chat_template=False)
    left = PromptDataset(path, tok, truncation="left", **kw)
    assert [tok.decode(r.prompt_ids) for r in left.rows] == ["efgh", "ab", "cdef"]
    right = PromptDataset(path, tok, truncation="right", **kw)
    assert [tok.decode(r.prompt_ids) for r in right.rows] == ["abcd", "ab", "abcd"]
    kept = PromptDataset(path, tok, truncation="filter", **kw)
    assert kept.num_filtered == 2 and [r.index for r in kept.rows] == [1]
    assert "dropped 2 of 3 prompts" in caplog.text
    with pytest.raises(ValueError) as err:
        PromptDataset(path, tok, truncation="error", **kw)
    msg = str(err.value)
    assert "row 0" in msg and "t.parquet" in msg and "8 tokens" in msg
    assert "data.max_prompt_length=4" in msg and "data.truncation" in msg
    with pytest.raises(ValueError, match="dropped them"):
        PromptDataset(path, tok, truncation="filter", max_prompt_length=1, apply_chat_template=False)
    with pytest.raises(ValueError, match="data.truncation='middle'"):
        PromptDataset(path, tok, truncation="middle")


def test_file_errors_name_the_file_and_key(tmp_path, tok):
    missing = tmp_path / "nope.parquet"
    with pytest.raises(FileNotFoundError, match="data.train_files.*nope.parquet"):
        PromptDataset(missing, tok)
    with pytest.raises(FileNotFoundError, match="data.val_files"):
        PromptDataset([missing], tok, files_key="data.val_files")
    garbage = tmp_path / "garbage.parquet"
    garbage.write_text("not parquet")
    with pytest.raises(ValueError, match="could not read .*garbage.parquet"):
        PromptDataset(garbage, tok)
    empty = tmp_path / "empty.parquet"
    schema = pa.schema(
        [("prompt", pa.string()), ("data_source", pa.string()),
         ("reward_model", pa.struct([("ground_truth", pa.string())]))]
    )  # fmt: skip
    pq.write_table(schema.empty_table(), empty)
    with pytest.raises(ValueError, match="empty.parquet' has no rows"):
        PromptDataset(empty, tok)


def test_missing_column_names_file_columns_and_key(tmp_path, tok):
    path = tmp_path / "q.parquet"
    pq.write_table(
        pa.table({"question": ["a"], "data_source": ["x"], "reward_model": [{"ground_truth": "1"}]}), path
    )
    with pytest.raises(KeyError) as err:
        PromptDataset(path, tok)
    msg = str(err.value)
    assert "q.parquet" in msg and "'question'" in msg and "data.prompt_key" in msg
    assert PromptDataset(path, tok, prompt_key="question")[0].ground_truth == "1"
    no_rm = tmp_path / "norm.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "data_source": ["x"]}), no_rm)
    with pytest.raises(KeyError, match="no column 'reward_model'"):
        PromptDataset(no_rm, tok)
    bad_prompt = write_rows(tmp_path / "bad.parquet", [[{"role": "user"}]])
    with pytest.raises(ValueError, match="bad.parquet' row 0"):
        PromptDataset(bad_prompt, tok)


def test_tokenizer_save_load_round_trip(tmp_path, tok):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = tok.apply_chat_template(chat("12 apples?"), add_generation_prompt=True, tokenize=False)
    assert loaded.apply_chat_template(chat("12 apples?"), add_generation_prompt=True, tokenize=False) == text
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id) == (0, 2, 1)
    assert tok("~é")["input_ids"][1] == tok.unk_token_id


def test_batch_larger_than_dataset_names_key_and_count():
    with pytest.raises(ValueError, match=r"data.train_batch_size=8 is larger than the dataset \(5 rows\)"):
        PromptSampler(5, 8)
    with pytest.raises(ValueError, match="data.seed=-1"):
        PromptSampler(5, 2, seed=-1)


def test_shuffle_is_seeded_and_covers_each_epoch():
    a, b = PromptSampler(10, 3, seed=7), PromptSampler(10, 3, seed=7)
    first = [a.batch_indices(s) for s in range(6)]
    assert first == [b.batch_indices(s) for s in range(6)]
    assert first != [PromptSampler(10, 3, seed=8).batch_indices(s) for s in range(6)]
    epoch0 = sum(first[:3], [])
    assert len(set(epoch0)) == 9 and a.steps_per_epoch == 3  # the incomplete last batch is dropped
    assert first[:3] != first[3:]  # a new permutation each epoch
    assert PromptSampler(10, 3, shuffle=False).batch_indices(1) == [3, 4, 5]


@pytest.mark.parametrize("stop_after", [1, 3, 4, 6])  # 3 and 6 are epoch boundaries
def test_resume_reproduces_uninterrupted_run(stop_after):
    full = list(PromptSampler(10, 3, seed=1, total_epochs=3))
    assert len(full) == 9
    run = PromptSampler(10, 3, seed=1, total_epochs=3)
    head = list(itertools.islice(iter(run), stop_after))
    state = run.state_dict()
    resumed = PromptSampler(10, 3, seed=1, total_epochs=3)
    resumed.load_state_dict(state)
    assert resumed.step == stop_after
    assert head + list(resumed) == full


def test_epoch_boundary_state_continues_into_next_epoch():
    sampler = PromptSampler(10, 3, seed=1)
    sampler.load_state_dict({"epoch": 0, "offset": 3})  # "epoch 0 finished"
    assert (sampler.epoch, sampler.offset) == (1, 0)
    assert next(iter(sampler)) == PromptSampler(10, 3, seed=1).batch_indices(3)
    done = PromptSampler(10, 3, seed=1, total_epochs=1)
    done.load_state_dict({"epoch": 1, "offset": 0})
    with pytest.raises(RuntimeError, match="total_epochs=1"):
        next(iter(done))
    with pytest.raises(ValueError, match="data.train_batch_size"):
        PromptSampler(10, 2, seed=1).load_state_dict(sampler.state_dict())


def test_loader_global_batches_and_dp_share(tmp_path, tok):
    path = write_rows(tmp_path / "l.parquet", [f"q{i}" for i in range(8)])
    loader = PromptDataLoader(PromptDataset(path, tok), batch_size=4, seed=3)
    batches = list(itertools.islice(iter(loader), 3))
    assert [[r.index for r in b] for b in batches] == [
        [r.index for r in loader.global_batch(s)] for s in range(3)
    ]
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["offset"] == 1
    shares = [dp_share(batches[0], r, 2) for r in range(2)]
    assert shares[0] + shares[1] == batches[0] and len(shares[0]) == 2
    with pytest.raises(ValueError, match="multiple of 3"):
        dp_share(batches[0], 0, 3)


def test_eval_batches_cover_every_row_once(tmp_path, tok):
    ds = PromptDataset(write_rows(tmp_path / "v.parquet", [f"q{i}" for i in range(5)]), tok)
    batches = eval_batches(ds, 2)
    assert [[r.index for r in b] for b in batches] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="data.val_batch_size=0"):
        eval_batches(ds, 0)
