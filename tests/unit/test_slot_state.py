"""``kernels.slot_state``: the engine's per-step row keys and ``_record`` bookkeeping as one Triton launch each,
under Triton's interpreter, against the torch ops they replace; and the engine with them against without."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "workers"))
from rollout_common import hf_to_mcore, random_prompts, spec_of, tiny_hf  # noqa: E402

from megatron_rl.kernels import slot_state  # noqa: E402
from megatron_rl.rollout.sampling import (  # noqa: E402
    SamplingParams,
    sample_row_keys,
    seeded_key,
    step_row_keys,
)

pytest.importorskip("triton", reason="triton is in the dev extras")

EXTREMES = [0, 1, -1, 2**63 - 1, -(2**63), 123456789, -987654321]


def test_seeded_keys_then_step_keys_give_the_bits_of_sample_row_keys():
    g = torch.Generator().manual_seed(0)
    keys = torch.cat([torch.tensor(EXTREMES), torch.randint(-(2**62), 2**62, (57,), generator=g)])
    steps = torch.randint(0, 5000, keys.shape, generator=g)
    for seed in (0, 7, -3, 2**62 + 5):
        seeded = torch.tensor([seeded_key(k, seed) for k in keys.tolist()])
        assert torch.equal(step_row_keys(seeded, steps), sample_row_keys(keys, steps, seed)), seed
    assert not torch.equal(
        torch.tensor([seeded_key(k, 1) for k in EXTREMES]), torch.tensor([seeded_key(k, 2) for k in EXTREMES])
    )
    with pytest.raises(ValueError, match=r"sampling seed 9223372036854775808 is not an int64"):
        seeded_key(1, 2**63)
    with pytest.raises(ValueError, match=r"sampling sequence key -9223372036854775809 is not an int64"):
        seeded_key(-(2**63) - 1, 0)


def test_row_keys_kernel_equals_the_torch_ops(monkeypatch):
    monkeypatch.setattr(slot_state, "RUN_ON_CPU", True)
    g = torch.Generator().manual_seed(1)
    seeded = torch.cat([torch.tensor(EXTREMES), torch.randint(-(2**63), 2**63 - 1, (600,), generator=g)])
    count = torch.cat(
        [torch.tensor([0, 1, 2**40, 3, 2**63 - 1, 5, 6]), torch.randint(0, 9000, (600,), generator=g)]
    )
    assert slot_state.serves(seeded)
    for n in (len(seeded), 513, 5):  # past one block, one past it, a part of one
        got = slot_state.row_keys(seeded[:n], count[:n])
        assert torch.equal(got, step_row_keys(seeded[:n], count[:n])), n


@pytest.mark.parametrize("stops", [(), (3,), (3, 11, 40)])
def test_record_kernel_equals_the_engine_ops(monkeypatch, stops):
    """``record`` against ``record_reference`` (the engine's ``_record`` ops for the decode step's rows)."""
    monkeypatch.setattr(slot_state, "RUN_ON_CPU", True)
    g = torch.Generator().manual_seed(len(stops))
    slots, b, max_new = 600, 530, 6
    state = {
        "live": torch.rand(slots, generator=g) < 0.7,
        "count": torch.randint(0, max_new + 1, (slots,), generator=g),  # max_new: a finished slot's column
        "out_tok": torch.randint(0, 50, (slots, max_new + 1), generator=g),
        "out_lp": torch.randn(slots, max_new + 1, generator=g),
        "next_tok": torch.randint(0, 50, (slots,), generator=g),
        "pos": torch.randint(0, 100, (slots,), generator=g),
    }
    state["count"][state["live"]] = state["count"][state["live"]].clamp(max=max_new - 1)  # live: room left
    tokens = torch.randint(0, 50, (b,), generator=g)
    tokens[:20] = 3  # some rows draw a stop token
    lps = torch.randn(b, generator=g)
    stop_ids = torch.tensor(stops, dtype=torch.long)
    want = {k: v.clone() for k, v in state.items()}
    slot_state.record_reference(tokens, lps, want["live"][:b], want["count"][:b], want["out_tok"], want["out_lp"],
                                want["next_tok"][:b], want["pos"][:b], stop_ids, max_new)  # fmt: skip
    got = {k: v.clone() for k, v in state.items()}
    args = (tokens, lps, got["live"][:b], got["count"][:b], got["out_tok"], got["out_lp"], got["next_tok"][:b],
            got["pos"][:b], stop_ids)  # fmt: skip
    assert slot_state.record_fits(*args)
    slot_state.record(*args, max_new)
    for k in state:
        assert torch.equal(got[k], want[k]), k
    assert not torch.equal(got["live"], state["live"]) and not torch.equal(got["count"], state["count"])
    if stops:
        assert not bool(got["live"][:20].any())  # every stop token ended its row
    assert not slot_state.record_fits(tokens, lps.double(), *args[2:])  # another dtype: the torch ops serve


def test_engine_with_the_slot_kernels_gives_the_same_completions(monkeypatch):
    """Sampled, layout-invariant, with stop tokens, max-length finishes and compaction (slots moved with their
    keys): the engine with the kernels under the interpreter equals the engine with the torch ops."""
    from megatron_rl.kernels import compile as compile_trials
    from megatron_rl.rollout import engine as engine_mod
    from megatron_rl.rollout.engine import EngineConfig, RolloutEngine

    monkeypatch.setattr(engine_mod, "_SYNC_EVERY", 2)
    hf = tiny_hf("qwen2")
    spec = spec_of(hf)
    params = hf_to_mcore(hf, spec, 1, 0, 1, 0)
    prompts = random_prompts(7, seed=5)
    common = dict(temperature=1.0, n=3, max_new_tokens=14, seed=9, layout_invariant_sampling=True)
    probe = RolloutEngine(params, spec, EngineConfig(max_num_seqs=21)).generate(
        prompts, SamplingParams(**common)
    )
    stops = tuple({c.response_ids[2] for c in probe[:4]})  # tokens that do get drawn: some rows stop early
    sp = SamplingParams(**common, stop_token_ids=stops)
    monkeypatch.setattr(compile_trials, "_PROBED", set())  # the trial runs here, before the counting starts
    monkeypatch.setattr(compile_trials, "_FAILED", {})
    monkeypatch.setattr(slot_state, "RUN_ON_CPU", True)
    assert slot_state.usable(torch.zeros(1, dtype=torch.long))
    calls = {"record": 0, "row_keys": 0}
    for name in calls:  # count the kernels' calls: they must serve every decode step with the switch on
        real = getattr(slot_state, name)

        def spy(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)

        monkeypatch.setattr(slot_state, name, spy)
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(slot_state, "RUN_ON_CPU", on)
        engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=21))
        runs[on] = (engine.generate(prompts, sp), engine.last_stats)
        if not on:
            assert calls == {"record": 0, "row_keys": 0}
    (a, stats), (b, stats_on) = runs[False], runs[True]
    assert calls["record"] == stats_on.decode_steps and calls["row_keys"] == stats_on.decode_steps > 0
    assert [c.response_ids for c in a] == [c.response_ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    assert {c.finish_reason for c in a} == {"stop", "length"}
    assert stats.compactions > 0
    for x, y in zip(a, b):
        assert torch.equal(torch.tensor(x.logprobs), torch.tensor(y.logprobs))


def test_record_reference_is_the_engine_record(monkeypatch):
    """``record_reference`` (the kernel's trial reference and the decode step's torch path) does what
    ``_Runner._record`` (prefill and multi-turn rows: a gather and a scatter) does on rows 0..B-1."""
    from megatron_rl.rollout.engine import _Runner

    g = torch.Generator().manual_seed(3)
    slots, b, max_new = 12, 10, 4
    live = torch.rand(slots, generator=g) < 0.7
    count = torch.randint(0, max_new, (slots,), generator=g)
    runner = _Runner.__new__(_Runner)  # only the attributes _record reads
    runner.count, runner.live, runner.stop_ids = count.clone(), live.clone(), torch.tensor([2])
    runner.out_tok, runner.out_lp = (
        torch.zeros(slots, max_new + 1, dtype=torch.long),
        torch.zeros(slots, max_new + 1),
    )
    runner.params = SamplingParams(max_new_tokens=max_new)
    runner.state = type("S", (), {"tok": torch.zeros(slots, dtype=torch.long), "pos": torch.arange(slots)})()
    tokens, lps = torch.randint(0, 4, (b,), generator=g), torch.randn(b, generator=g)
    runner._record(torch.arange(b), tokens, lps, runner.live[:b].clone(), runner.state.pos[:b] + 1)
    mine = [live.clone(), count.clone(), torch.zeros(slots, max_new + 1, dtype=torch.long),
            torch.zeros(slots, max_new + 1), torch.zeros(slots, dtype=torch.long), torch.arange(slots)]  # fmt: skip
    slot_state.record_reference(tokens, lps, mine[0][:b], mine[1][:b], mine[2], mine[3], mine[4][:b], mine[5][:b],
                                runner.stop_ids, max_new)  # fmt: skip
    theirs = [runner.live, runner.count, runner.out_tok, runner.out_lp, runner.state.tok, runner.state.pos]
    for x, y in zip(mine, theirs):
        assert torch.equal(x, y)


def test_a_failing_trial_warns_once_and_the_torch_ops_serve(monkeypatch):
    from megatron_rl.kernels import compile as compile_trials

    monkeypatch.setattr(slot_state, "RUN_ON_CPU", True)
    monkeypatch.setattr(compile_trials, "_PROBED", set())
    monkeypatch.setattr(compile_trials, "_FAILED", {})
    assert slot_state.usable(torch.zeros(3, dtype=torch.long))  # the real kernels pass
    monkeypatch.setattr(compile_trials, "_PROBED", set())
    monkeypatch.setattr(slot_state, "record", lambda *a: None)  # a kernel that writes nothing
    with pytest.warns(UserWarning, match=r"slot kernels \(kernels.slot_state\) failed their trial.*differs"):
        assert not slot_state.usable(torch.zeros(3, dtype=torch.long))
    assert not slot_state.usable(torch.zeros(3, dtype=torch.long))  # remembered: no second trial or warning
