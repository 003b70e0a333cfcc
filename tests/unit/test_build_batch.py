"""``build_batch``: the engine's completions (uneven prompt and response lengths, multi-turn masks,
truncated log-probs) become right-padded tensors holding exactly each completion's lists."""

import random

import numpy as np
import pytest
import torch

from megatron_rl.rollout.batch import build_batch, right_padded
from megatron_rl.rollout.engine import Completion


def _completions(multi: bool) -> list[Completion]:
    rng = random.Random(0)
    out = []
    for i in range(7):
        p, r = rng.randint(1, 9), rng.choice([0, 1, 5, 8])
        c = Completion(i // 2, i % 2, [rng.randint(1, 99) for _ in range(p)], [rng.randint(1, 99) for _ in range(r)],
                       [rng.random() for _ in range(r)], "stop", truncated_logprobs=[rng.random() for _ in range(r)])  # fmt: skip
        if multi and r:
            c.response_mask = [rng.randint(0, 1) for _ in range(r)]
        out.append(c)
    return out


def test_right_padded_rows_and_fill():
    got = right_padded([[3, 4], [], [5]], 4, torch.long, -1)
    assert torch.equal(got, torch.tensor([[3, 4, -1, -1], [-1, -1, -1, -1], [5, -1, -1, -1]]))
    assert torch.equal(right_padded([[], []], 2, torch.float32), torch.zeros(2, 2))
    # rows that are not lists (tuples, ranges) take the same place; floats keep their fp32 values
    got = right_padded([(0.5, 1), range(3)], 3, torch.float32, -1.0)
    assert torch.equal(got, torch.tensor([[0.5, 1.0, -1.0], [0.0, 1.0, 2.0]]))


def test_build_batch_holds_each_completions_lists():
    for multi in (False, True):
        comps = _completions(multi)
        b = build_batch(comps, [None] * 4, 10, 8, 0, torch.device("cpu"))
        for i, c in enumerate(comps):
            seq, n = c.prompt_ids + c.response_ids, len(c.response_ids)
            assert b.input_ids[i, : len(seq)].tolist() == seq and not b.input_ids[i, len(seq) :].any()
            assert b.responses[i, :n].tolist() == c.response_ids and not b.responses[i, n:].any()
            assert torch.equal(b.rollout_log_probs[i, :n], torch.tensor(c.logprobs, dtype=torch.float32))
            assert torch.equal(b.rollout_truncated_log_probs[i, :n], torch.tensor(c.truncated_logprobs))
            mask = c.response_mask if multi and n else [1] * n
            assert b.response_mask[i].tolist() == mask + [0] * (8 - n)
        assert b.group_index.tolist() == [10 + c.prompt_index for c in comps]


def test_the_engines_arrays_give_the_same_tensors_as_the_lists(monkeypatch):
    """Single-turn completions with ``arrays`` (the engine's numpy copies of the response ids and log-probs)
    build the same tensors as from the lists (the array path ran: its helper is counted; pad id 7), also where
    samples of one prompt index hold different prompt ids (the dedup of prompt conversions checks equality)
    and for empty responses. Arrays that disagree with the lists in length stop it, naming the completion."""
    from megatron_rl.rollout import batch as batch_mod

    comps = _completions(False)
    want = build_batch(comps, [None] * 4, 10, 8, 7, torch.device("cpu"))
    for c in comps:
        c.arrays = (np.asarray(c.response_ids, dtype=np.int64), np.asarray(c.logprobs, dtype=np.float32))
    listed_arrays = [Completion(c.prompt_index, c.sample_index, c.prompt_ids, c.response_ids, c.logprobs, "stop",
                                truncated_logprobs=c.truncated_logprobs, arrays=(list(c.response_ids),
                                torch.tensor(c.logprobs))) for c in comps]  # fmt: skip
    got = build_batch(
        listed_arrays, [None] * 4, 10, 8, 7, torch.device("cpu")
    )  # arrays as a list and a tensor
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(
        got.rollout_log_probs, want.rollout_log_probs
    )
    calls = []
    real = batch_mod._from_arrays
    monkeypatch.setattr(batch_mod, "_from_arrays", lambda *a: calls.append(1) or real(*a))
    got = build_batch(comps, [None] * 4, 10, 8, 7, torch.device("cpu"))
    assert calls == [1] and (got.input_ids == 7).any()
    assert comps[0].prompt_ids != comps[1].prompt_ids and comps[0].prompt_index == comps[1].prompt_index
    for f in ("input_ids", "responses", "rollout_log_probs", "response_mask", "score_pos", "prompt_lens"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    long = next(c for c in comps if c.response_ids)
    long.response_ids = long.response_ids[:-1]
    with pytest.raises(ValueError, match=f"Completion {long.prompt_index}/{long.sample_index}"):
        build_batch(comps, [None] * 4, 10, 8, 7, torch.device("cpu"))


def test_completions_cross_ranks_without_their_arrays(monkeypatch):
    """rollout.reshard.gather_results pickles each completion's lists only (its arrays are a second copy of
    them); the gathered completions build the same batch through the lists."""
    import pickle
    from types import SimpleNamespace

    from megatron_rl.rollout import reshard

    ids, lps = np.array([5, 6, 7]), np.array([-0.5, -1.0, -2.0], dtype=np.float32)
    mine = [
        Completion(0, s, [1, 2], ids.tolist(), lps.tolist(), "length", arrays=(ids, lps)) for s in range(2)
    ]
    sent = []

    def all_gather_object(every, obj, group=None):
        sent.append(len(pickle.dumps(obj)))
        every[0], every[1] = obj, (1, 0, [])  # replica 1 (another rank) had no prompts
        assert all(c.arrays is None for c in obj[2])

    monkeypatch.setattr(reshard.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(reshard.dist, "all_gather_object", all_gather_object)
    lay = SimpleNamespace(mp_group=object(), replica=0, gen_tp_rank=0, num_replicas=2)
    got = reshard.gather_results(mine, lay)
    assert [c.response_ids for c in got] == [[5, 6, 7]] * 2 and all(c.arrays is None for c in got)
    assert mine[0].arrays is not None  # the engine's own objects keep theirs
    assert sent[0] < len(pickle.dumps((0, 0, mine)))
    want = build_batch(mine, [None], 0, 4, 0, torch.device("cpu"))
    have = build_batch(got, [None], 0, 4, 0, torch.device("cpu"))
    assert torch.equal(want.input_ids, have.input_ids) and torch.equal(want.responses, have.responses)


class _Counted(np.ndarray):
    """An array (and its views) counting ``tolist`` calls."""

    listed = 0

    def tolist(self):
        _Counted.listed += 1
        return super().tolist()


def test_the_engines_arrays_are_listed_only_when_read():
    """``Completion.set_arrays`` (the engine's single-turn results): ``build_batch`` and ``response_len`` read the
    arrays and list nothing; ``response_ids`` / ``logprobs`` are the arrays' lists on the first read (once), equal
    to a completion made from lists, and stay readable when a caller drops ``arrays`` or sets one list."""
    import pickle

    comps = _completions(False)
    want = build_batch(comps, [None] * 4, 10, 8, 7, torch.device("cpu"))
    lazy = []
    for c in comps:
        z = Completion(c.prompt_index, c.sample_index, c.prompt_ids, finish_reason="stop",
                       truncated_logprobs=c.truncated_logprobs)  # fmt: skip
        z.set_arrays(np.asarray(c.response_ids, dtype=np.int64).view(_Counted),
                     np.asarray(c.logprobs, dtype=np.float32).view(_Counted))  # fmt: skip
        lazy.append(z)
    _Counted.listed = 0
    got = build_batch(lazy, [None] * 4, 10, 8, 7, torch.device("cpu"))
    assert [z.response_len() for z in lazy] == [len(c.response_ids) for c in comps]
    assert _Counted.listed == 0
    for f in ("input_ids", "responses", "rollout_log_probs", "response_mask", "score_pos", "response_lens"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    z, c = lazy[1], comps[1]
    assert z.response_ids == c.response_ids and _Counted.listed == 1
    assert z.response_ids is z.response_ids and _Counted.listed == 1  # listed once, then kept
    assert z.logprobs == np.asarray(c.logprobs, dtype=np.float32).tolist()
    # a caller drops the arrays, or replaces one list: the other still reads the engine's values
    a, b = lazy[2], lazy[3]
    a.arrays = None
    assert a.response_ids == comps[2].response_ids and a.response_len() == len(comps[2].response_ids)
    b.response_ids = [1, 2]
    b.arrays = None
    assert b.response_len() == 2 and b.logprobs == np.asarray(comps[3].logprobs, dtype=np.float32).tolist()
    # a Completion whose state predates the properties (plain ``response_ids`` / ``logprobs`` keys)
    old = Completion(0, 0, [1], [5, 6], [-0.5, -1.0], "stop")
    for name in ("response_ids", "logprobs"):
        old.__dict__[name] = old.__dict__.pop(f"_{name}")
    assert old.response_ids == [5, 6] and old.logprobs == [-0.5, -1.0] and old.response_len() == 2
    back = pickle.loads(pickle.dumps(lazy[4]))
    assert back.response_ids == comps[4].response_ids
    c = comps[5]
    assert lazy[5] == Completion(c.prompt_index, c.sample_index, c.prompt_ids, c.response_ids,
                                 np.asarray(c.logprobs, dtype=np.float32).tolist(), "stop",
                                 truncated_logprobs=c.truncated_logprobs)  # fmt: skip
