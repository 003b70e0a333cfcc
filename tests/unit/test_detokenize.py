"""``advantage.batch_decode``: the Rust tokenizer's ``decode_batch`` in threads gives transformers'
``batch_decode`` strings; a tokenizer whose decode post-processes (clean-up of spaces) or disagrees on the
first call keeps transformers' decode."""

import random

import pytest

from megatron_rl.data.tiny_tokenizer import build_char_tokenizer
from megatron_rl.trainer import advantage


def _seqs(tok, n=300, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(len(tok)) for _ in range(rng.randint(0, 40))] for _ in range(n)]


def test_threaded_rust_decode_equals_batch_decode(monkeypatch):
    tok = build_char_tokenizer()
    tok.clean_up_tokenization_spaces = False
    monkeypatch.setattr(advantage, "_FAST_DECODE", {})
    calls = []
    rust = tok._tokenizer
    monkeypatch.setattr(tok, "_tokenizer", type("Spy", (), {
        "decode_batch": lambda self, c, **k: calls.append(len(c)) or rust.decode_batch(c, **k),
        "__getattr__": lambda self, name: getattr(rust, name)})())  # fmt: skip
    seqs = _seqs(tok)  # special ids included: skipped on both paths
    assert advantage.batch_decode(tok, seqs) == tok.batch_decode(seqs, skip_special_tokens=True)
    assert calls[0] == 32 and len(calls) > 2  # the agreement check, then chunks of 64 in threads


def test_clean_up_or_disagreement_keeps_transformers_decode(monkeypatch):
    tok = build_char_tokenizer()
    seqs = _seqs(tok, 100, seed=1)
    tok.clean_up_tokenization_spaces = True
    assert advantage._rust_tokenizer(tok) is None
    assert advantage.batch_decode(tok, seqs) == tok.batch_decode(seqs, skip_special_tokens=True)
    tok.clean_up_tokenization_spaces = False
    monkeypatch.setattr(advantage, "_FAST_DECODE", {})
    rust = tok._tokenizer
    liar = type("Liar", (), {"decode_batch": lambda self, c, **k: ["?"] * len(c),
                             "__getattr__": lambda self, name: getattr(rust, name)})()  # fmt: skip
    monkeypatch.setattr(tok, "_tokenizer", liar)
    want = tok.batch_decode(seqs, skip_special_tokens=True)
    assert advantage.batch_decode(tok, seqs) == want and advantage._FAST_DECODE == {id(liar): (liar, False)}
    assert advantage.batch_decode(tok, seqs) == want  # and from then on


def test_the_agreement_check_spreads_over_the_batch_and_waits_for_tokens(monkeypatch):
    """A decode that differs only past the batch's first sequences is caught (the check samples the whole
    batch), and a first batch of empty responses settles nothing."""
    tok = build_char_tokenizer()
    tok.clean_up_tokenization_spaces = False
    monkeypatch.setattr(advantage, "_FAST_DECODE", {})
    rust = tok._tokenizer
    late = type("Late", (), {"decode_batch": lambda self, c, **k: [t + ("?" if len(ids) > 30 else "") for t, ids in zip(rust.decode_batch(c, **k), c)],
                             "__getattr__": lambda self, name: getattr(rust, name)})()  # fmt: skip
    monkeypatch.setattr(tok, "_tokenizer", late)
    assert advantage.batch_decode(tok, [[]] * 100) == [""] * 100 and len(advantage._FAST_DECODE) == 0
    seqs = [[5] * 3] * 40 + _seqs(tok, 200, seed=2)  # the first 40 agree, longer ones later do not
    assert advantage.batch_decode(tok, seqs) == tok.batch_decode(seqs, skip_special_tokens=True)
    assert advantage._FAST_DECODE == {id(late): (late, False)}


def test_a_tokenizer_that_cannot_be_weakly_referenced_is_cached_by_id(monkeypatch):
    """tokenizers < 0.23: a ``tokenizers.Tokenizer`` takes no weak reference; the verdict is kept by id,
    with the object held so that the id stays its own."""
    tok = build_char_tokenizer()
    tok.clean_up_tokenization_spaces = False
    monkeypatch.setattr(advantage, "_FAST_DECODE", {})
    rust = tok._tokenizer

    class Slotted:  # no __weakref__ slot, as the Rust class before 0.23
        __slots__ = ()

        def decode_batch(self, c, **k):
            return rust.decode_batch(c, **k)

        def __getattr__(self, name):
            return getattr(rust, name)

    stand_in = Slotted()
    monkeypatch.setattr(tok, "_tokenizer", stand_in)
    seqs = _seqs(tok, 100, seed=3)
    assert advantage.batch_decode(tok, seqs) == tok.batch_decode(seqs, skip_special_tokens=True)
    assert advantage._FAST_DECODE == {id(stand_in): (stand_in, True)}


def test_scores_land_on_each_last_response_token_and_host_copies_read_the_same(monkeypatch):
    """``score_responses``: each row's score on its last response token, nothing on an empty response (the
    placement has no boolean indexing, which would sync the device); reading the responses from a
    ``HostResponses`` copy (``reward.overlap``) gives the same texts and scores as reading the batch."""
    import torch

    from megatron_rl.rollout.batch import RolloutBatch

    tok = build_char_tokenizer()
    seqs = [s[:6] for s in _seqs(tok, 5, seed=2)] + [[]]  # the last response is empty
    lens = torch.tensor([len(s) for s in seqs])
    r = 6
    responses = torch.tensor([s + [0] * (r - len(s)) for s in seqs])
    mask = (torch.arange(r)[None] < lens[:, None]).float()

    row = type("Row", (), {"data_source": "t", "ground_truth": "", "extra_info": None})()

    def batch():
        b = len(seqs)
        return RolloutBatch(input_ids=responses.clone(), responses=responses.clone(), response_mask=mask.clone(),
                            score_pos=torch.zeros(b, r, dtype=torch.long), prompt_lens=torch.zeros(b, dtype=torch.long),
                            response_lens=lens.clone(), group_index=torch.arange(b), rollout_log_probs=torch.zeros(b, r),
                            finish_reasons=["stop"] * b, rows=[row] * b)  # fmt: skip

    def reward(solution_str, **_):
        return float(len(solution_str)) + 0.5

    monkeypatch.setattr(
        advantage,
        "score_batch",
        lambda fn, srcs, texts, gts, infos: ([fn(solution_str=t) for t in texts], {}),
    )
    plain, copied = batch(), batch()
    host = advantage.HostResponses(copied)
    copied.responses.zero_()  # the copy was taken before: later changes to the device tensors do not reach it
    out_plain = advantage.score_responses(plain, reward, tok)
    out_copied = advantage.score_responses(copied, reward, tok, host=host)
    assert copied.response_texts == plain.response_texts
    assert torch.equal(out_copied["score"], out_plain["score"])
    want = torch.zeros(len(seqs), r)
    for i, n in enumerate(lens.tolist()):
        if n:
            want[i, n - 1] = out_plain["score"][i]
    assert torch.equal(plain.token_level_scores, want) and torch.equal(copied.token_level_scores, want)
    assert plain.token_level_scores[-1].abs().sum() == 0 and out_plain["score"][-1] == 0.5


def _fast_tok(monkeypatch):
    from megatron_rl.data.tiny_tokenizer import DEFAULT_ALPHABET

    tok = build_char_tokenizer(DEFAULT_ALPHABET + "ïé✓😀")  # multi-byte characters in the vocabulary
    tok.clean_up_tokenization_spaces = False
    monkeypatch.setattr(advantage, "_FAST_DECODE", {})
    monkeypatch.setattr(advantage, "_PROCESSES", {})
    return tok


def _padded(seqs):
    import numpy as np

    r = max(1, max(len(s) for s in seqs))
    return np.array([len(s) for s in seqs]), np.array([s + [0] * (r - len(s)) for s in seqs], dtype=np.int64)


def test_the_decoding_process_gives_batch_decodes_texts_and_drains_an_unread_job(monkeypatch):
    """``detokenize_process.DecodeProcess``: a child process on the Rust tokenizer's JSON; its texts == the
    tokenizer's ``batch_decode`` (special ids skipped, empty rows, multi-byte characters); a job whose texts
    were never read is drained before the next one and then answers None, not another job's texts; a child that
    died is reported and answers None."""
    from megatron_rl.trainer.detokenize_process import DecodeProcess

    tok = _fast_tok(monkeypatch)
    seqs = _seqs(tok, 40, seed=4) + [[]] + [tok.encode("naïve café ✓😀", add_special_tokens=False)]
    want = tok.batch_decode(seqs, skip_special_tokens=True)
    assert "naïve café ✓😀" in want
    proc = DecodeProcess(tok._tokenizer)
    try:
        lens, ids = _padded(seqs)
        assert proc.texts(proc.submit(lens, ids)) == want
        first = proc.submit(lens[:3], ids[:3])  # never read...
        second = proc.submit(lens, ids)  # ...drained here, then this job
        assert proc.texts(first) is None and proc.texts(second) == want
        proc._proc.kill()
        proc._proc.wait()
        with pytest.warns(UserWarning, match="detokenising process stopped"):
            job = proc.submit(lens, ids)
        assert job is None and proc.texts(job) is None and proc.dead
    finally:
        proc.close()
    assert proc._proc.returncode is not None  # reaped, no zombie


def test_host_responses_decode_in_the_child_from_the_second_batch(monkeypatch):
    """``reward.overlap``'s ``HostResponses(batch, tokenizer)`` with ``MEGATRON_RL_DETOKENIZE_PROCESS=1``: the
    first batch decodes in-process (the Rust decode's check) and starts the child, which must give the same
    texts for it; later batches go to the child at once (no in-process decode), with the same texts; the switch
    off (the default), or a CPU batch without ``PROCESS_ON_CPU``, never starts one."""
    import torch

    tok = _fast_tok(monkeypatch)
    seqs = _seqs(tok, 70, seed=6)
    lens, ids = _padded(seqs)
    batch = type("B", (), {"response_lens": torch.from_numpy(lens), "responses": torch.from_numpy(ids)})()
    want = tok.batch_decode(seqs, skip_special_tokens=True)
    advantage.HostResponses(batch, tok).texts(tok)
    assert not advantage._PROCESSES  # off by default (until measured on a GPU)
    monkeypatch.setattr(advantage, "PROCESS", True)  # MEGATRON_RL_DETOKENIZE_PROCESS=1
    advantage.HostResponses(batch, tok).texts(tok)
    assert not advantage._PROCESSES  # a CPU batch: in-process
    monkeypatch.setattr(advantage, "PROCESS_ON_CPU", True)
    calls = []
    real = advantage.batch_decode
    monkeypatch.setattr(advantage, "batch_decode", lambda t, s: calls.append(len(s)) or real(t, s))
    try:
        assert advantage.HostResponses(batch, tok).texts(tok) == want
        assert advantage._process_for(tok) is not None  # started (and checked) after an in-process decode
        calls.clear()
        for _ in range(2):
            host = advantage.HostResponses(batch, tok)
            assert host._proc is not None
            assert advantage.decode_responses(batch, tok, host) == want
        assert not calls  # the child decoded both
        monkeypatch.setattr(advantage, "PROCESS", False)
        assert advantage.HostResponses(batch, tok)._proc is None
    finally:
        for _, proc in advantage._PROCESSES.values():
            if proc is not None:
                proc.close()


@pytest.mark.parametrize("fault", ["no_json", "disagrees"])
def test_a_child_that_cannot_start_or_disagrees_is_not_used(monkeypatch, fault):
    """A tokenizer without a JSON form (Python parts) or a child whose texts differ from the in-process decode:
    one warning naming the cause, the texts from the in-process decode, no child kept or retried."""
    import torch

    from megatron_rl.trainer import detokenize_process

    tok = _fast_tok(monkeypatch)
    monkeypatch.setattr(advantage, "PROCESS", True)
    monkeypatch.setattr(advantage, "PROCESS_ON_CPU", True)
    seqs = _seqs(tok, 20, seed=8)
    lens, ids = _padded(seqs)
    batch = type("B", (), {"response_lens": torch.from_numpy(lens), "responses": torch.from_numpy(ids)})()
    want = tok.batch_decode(seqs, skip_special_tokens=True)
    if fault == "no_json":

        def no_json(rust):
            raise Exception("Custom PyDecoder cannot be serialized")

        monkeypatch.setattr(advantage, "DecodeProcess", no_json)
        match = "Custom PyDecoder"
    else:
        real_texts = detokenize_process.DecodeProcess.texts
        monkeypatch.setattr(
            detokenize_process.DecodeProcess,
            "texts",
            lambda self, job: [t + "!" for t in real_texts(self, job)],
        )
        match = "differ"
    with pytest.warns(UserWarning, match=match):
        assert advantage.HostResponses(batch, tok).texts(tok) == want
    assert advantage._process_for(tok) is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second attempt, no second warning
        assert advantage.HostResponses(batch, tok).texts(tok) == want
