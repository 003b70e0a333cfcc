"""``advantage.batch_decode``: the Rust tokenizer's ``decode_batch`` in threads gives transformers'
``batch_decode`` strings; a tokenizer whose decode post-processes (clean-up of spaces) or disagrees on the
first call keeps transformers' decode."""

import random

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
