"""Rollout settings have one owner: the schema's rollout keys define the engine's and the sampler's defaults,
one builder each turns the config into them, and their rules run at start-up validation."""

import dataclasses

import pytest

from megatron_rl.config import ConfigError, JobConfig, validate_job
from megatron_rl.config.reference import render
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.engine import EngineConfig
from megatron_rl.rollout.sampling import SamplingParams, logprob_temperature


def test_engine_and_sampling_defaults_are_the_schemas():
    schema = RolloutConfig()
    for params in (SamplingParams(), EngineConfig()):
        shared = [f.name for f in dataclasses.fields(params) if hasattr(schema, f.name)]
        assert len(shared) >= 5, shared
        for name in shared:
            got, want = getattr(params, name), getattr(schema, name)
            if name == "kv_cache_tokens":  # the schema's 0 ("sized from the batch") is the engine's None
                got = 0 if got is None else got
            if name == "keep_cache":  # the schema's auto is resolved by the memory plan; unresolved: off
                assert want == "auto" and got is False
                continue
            assert got == (tuple(want) if isinstance(want, list) else want), name


def test_builders_carry_every_key():
    r = RolloutConfig(top_p=0.9, top_k=7, max_new_tokens=33, stop_token_ids=[5, 6], layout_invariant_sampling=True,
                      max_num_seqs=12, kv_cache_tokens=640, max_prefill_tokens=99, cuda_graphs=False,
                      keep_cache=True, gpu_memory_utilization=0.3, tensor_model_parallel_size=1)  # fmt: skip
    sp = SamplingParams.from_config(r, temperature=0.7, n=3, seed=11, eos_token_id=2)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.n, sp.max_new_tokens, sp.seed) == (0.7, 0.9, 7, 3, 33, 11)
    assert sp.stop_token_ids == (2, 5, 6) and sp.layout_invariant_sampling
    assert SamplingParams.from_config(r, temperature=1.0, n=1, seed=0, eos_token_id=None).stop_token_ids == (
        5,
        6,
    )
    ec = EngineConfig.from_config(r)
    assert dataclasses.asdict(ec) == {f.name: getattr(r, f.name) for f in dataclasses.fields(ec)}


@pytest.mark.parametrize(
    "key, value",
    [("rollout.top_p", 0.0), ("rollout.top_k", 0), ("rollout.val_temperature", -1.0),
     ("rollout.gpu_memory_utilization", 1.5), ("rollout.max_num_seqs", 0), ("rollout.max_prefill_tokens", 0),
     ("rollout.kv_cache_tokens", -4), ("rollout.temperature", -0.5), ("rollout.keep_cache", "yes")],
)  # fmt: skip
def test_engine_and_sampler_rules_run_at_startup(key, value):
    cfg = JobConfig()
    setattr(cfg.rollout, key.split(".")[1], value)
    with pytest.raises(ConfigError, match=f"{key}={value}"):
        validate_job(cfg, world_size=1, num_layers=2)


def test_greedy_rollouts_score_at_temperature_one_and_startup_says_so():
    assert logprob_temperature(0.0) == 1.0 and logprob_temperature(0.6) == 0.6
    cfg = JobConfig()
    cfg.rollout.temperature = 0.0
    with pytest.warns(UserWarning, match="rollout.temperature=0.*temperature 1.0"):
        validate_job(cfg, world_size=1, num_layers=2)


def test_config_reference_keeps_nested_overrides():
    """The critic's optimizer default (lr 1e-5) is a per-field override of OptimConfig's 1e-6."""
    table = render()
    assert "| `critic.optim.lr` | `1e-05` |" in table and "| `actor.optim.lr` | `1e-06` |" in table
