"""Algorithm registries and their config: a name registered twice is an error, start-up validation reads
its choices from the registries, the new settings are bounded at start-up, and experiment=gsm8k_dapo
composes into a job that validates."""

from __future__ import annotations

import pytest

from megatron_rl import algos
from megatron_rl.algos.aggregation import AGG_MODES
from megatron_rl.algos.kl import KL_KINDS
from megatron_rl.algos.registry import Registry
from megatron_rl.config import ConfigError, JobConfig, validate_job
from megatron_rl.config.validate import choices


@pytest.mark.parametrize(
    "registry",
    [AGG_MODES, KL_KINDS, algos.IS_MODES, algos.REJECTION_MODES],
    ids=["loss_agg_mode", "kl", "tis_mode", "rollout_rs"],
)
def test_every_registry_refuses_a_name_twice(registry):
    name = registry.names()[0]
    with pytest.raises(ValueError, match=f"'{name}' is already registered"):
        registry.add(name, lambda *a: None)


def test_estimator_and_policy_loss_registries_refuse_a_name_twice():
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is already registered"):
        algos.register_advantage_estimator("grpo")(lambda **_: None)
    with pytest.raises(ValueError, match="policy loss 'vanilla' is already registered"):
        algos.register_policy_loss("vanilla")(lambda **_: None)


def test_validation_takes_its_choices_from_the_registries():
    table = choices()
    assert table["algorithm.adv_estimator"] == algos.advantage_estimator_names()
    assert table["actor.policy_loss"] == algos.policy_loss_names()
    assert table["actor.loss_agg_mode"] == algos.LOSS_AGG_MODES == table["critic.loss_agg_mode"]
    assert set(table["actor.kl_loss_type"]) >= {"k3", "low_var_kl", "k3+"}
    assert table["actor.tis_mode"] == (None, "icepop", "sequence", "token")
    # a newly registered estimator becomes a valid choice without editing validate.py
    algos.register_advantage_estimator("_test_only_estimator")(lambda **_: None)
    cfg = JobConfig()
    cfg.algorithm.adv_estimator = "_test_only_estimator"
    validate_job(cfg, world_size=1)
    cfg.algorithm.adv_estimator = "nope"
    with pytest.raises(ConfigError, match="_test_only_estimator"):
        validate_job(cfg, world_size=1)


def test_a_fresh_registry_lists_sorted_names_and_names_the_choices_on_a_miss():
    reg = Registry("thing")
    reg.register("b", "a")(len)
    assert reg.names() == ("a", "b") and reg.get("a") is len and "b" in reg
    with pytest.raises(ValueError, match="Unknown thing 'c'; choose one of a, b"):
        reg.get("c")


@pytest.mark.parametrize(
    "setting, value, needle",
    [
        ("reward.overlong_buffer.len", 16, "reward.overlong_buffer.len=16 must be in"),
        ("rollout.n", 1, "set rollout.n >= 2"),
        ("algorithm.filter_groups.max_num_gen_batches", 0, "max_num_gen_batches must be >= 1"),
        ("actor.tis_low", 1.5, "actor.tis_low / actor.tis_cap"),
        ("actor.rollout_rs_high", 0.9, "actor.rollout_rs_low / actor.rollout_rs_high"),
    ],
)
def test_algorithm_settings_are_bounded_at_start_up(setting, value, needle):
    cfg = JobConfig()
    cfg.algorithm.filter_groups.enable = True
    cfg.rollout.n, cfg.actor.tis_mode, cfg.actor.rollout_rs = 4, "icepop", "seq_mean"
    validate_job(cfg, world_size=1)  # the defaults of the new keys are valid
    obj, *path = setting.split(".")
    target = getattr(cfg, obj)
    for part in path[:-1]:
        target = getattr(target, part)
    setattr(target, path[-1], value)
    with pytest.raises(ConfigError, match=needle):
        validate_job(cfg, world_size=1)


def test_gsm8k_dapo_experiment_composes_and_validates(tmp_path):
    from hydra import compose, initialize_config_dir

    from megatron_rl.config.store import CONFIG_DIR, to_job_config

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        overrides = ["experiment=gsm8k_dapo", f"trainer.output_dir={tmp_path}"]
        cfg = to_job_config(compose("config", overrides=overrides))
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.max_num_gen_batches == 10
    assert cfg.reward.overlong_buffer.len == 256 and cfg.actor.clip_ratio_high == 0.28
    assert not cfg.actor.use_kl_loss and cfg.actor.loss_agg_mode == "token-mean"
    assert cfg.model.name == "qwen2_5_0_5b" and cfg.rollout.n == 8
    validate_job(cfg, world_size=8, num_layers=24)
