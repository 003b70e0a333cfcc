"""Bad input refused (or warned about) at start-up, before any weights load, naming the key and a fix:
unknown keys added with '+', impossible optimizer values, a tokenizer larger than the embedding, rows
without ground truth."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from megatron_rl.config import ConfigError, JobConfig, validate_job
from megatron_rl.config.store import CONFIG_DIR, schema_keys, to_job_config
from megatron_rl.data import PromptDataset, build_char_tokenizer
from megatron_rl.data.tokenizer_fit import TokenizerMismatchError, check_tokenizer_fits
from tests.unit.test_config import _run


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose("config", overrides=["trainer.output_dir=/tmp/unused", *overrides])


@pytest.mark.parametrize(
    "override,named,closest",
    [
        ("+actor.optim.lrr=1", "actor.optim.lrr", "actor.optim.lr"),
        ("+trainer.save_frequency=5", "trainer.save_frequency", "trainer.save_freq"),
        ("+rollout.temprature=0.5", "rollout.temprature", "rollout.temperature"),
        ("+actor.clip_ratio=0.3", "actor.clip_ratio", "actor.clip_ratio_c"),
    ],
)
def test_unknown_plus_key_is_refused_naming_the_closest_key(override, named, closest):
    with pytest.raises(ConfigError) as err:
        to_job_config(_compose(override))
    msg = str(err.value)
    assert f"unknown config key {named}" in msg and f"Did you mean {closest}?" in msg and "\n" not in msg


def test_known_keys_pass_and_free_form_values_are_not_checked():
    cfg = to_job_config(_compose("actor.optim.lr=2e-6", "data.train_files=[a.parquet,b.parquet]"))
    assert cfg.actor.optim.lr == 2e-6 and "algorithm.kl_ctrl.kl_coef" in set(schema_keys())


def test_cli_plus_typo_is_one_paragraph_before_any_work(tmp_path):
    out = _run(["train", "+actor.optim.lrr=1"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unknown config key actor.optim.lrr" in out.stderr and "actor.optim.lr" in out.stderr
    assert out.stderr.strip().count("\n") == 0
    assert not any(tmp_path.rglob("builtin_task"))  # nothing was built


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("lr", -1e-3, "actor.optim.lr=-0.001 must be >= 0"),
        ("weight_decay", -0.1, "actor.optim.weight_decay=-0.1 must be >= 0"),
        ("eps", 0.0, "actor.optim.eps=0.0 must be > 0"),
        ("clip_grad", -1.0, "actor.optim.clip_grad=-1.0 must be >= 0"),
        ("min_lr_ratio", 1.5, "actor.optim.min_lr_ratio=1.5 must be in [0, 1]"),
        ("betas", [0.9, 1.0], "actor.optim.betas=[0.9, 1.0] must be two values in [0, 1)"),
        ("betas", [-0.1, 0.99], "actor.optim.betas=[-0.1, 0.99] must be two values in [0, 1)"),
        ("betas", [0.9], "actor.optim.betas=[0.9] must be two values"),
    ],
)
def test_impossible_optimizer_values_name_the_key(key, value, needle):
    cfg = JobConfig()
    setattr(cfg.actor.optim, key, value)
    with pytest.raises(ConfigError) as err:
        validate_job(cfg, world_size=1, num_layers=2)
    assert needle in str(err.value) and "e.g. actor.optim." in str(err.value)


def test_critic_optimizer_checked_with_a_critic_and_timeout_must_be_positive():
    cfg = JobConfig()
    cfg.critic.optim.lr = -1.0
    validate_job(cfg, world_size=1, num_layers=2)  # grpo: no critic is built
    cfg.algorithm.adv_estimator = "gae"
    with pytest.raises(ConfigError, match=r"critic\.optim\.lr=-1\.0 must be >= 0"):
        validate_job(cfg, world_size=1, num_layers=2)
    cfg = JobConfig()
    cfg.trainer.timeout_minutes = 0
    with pytest.raises(ConfigError, match=r"trainer\.timeout_minutes=0 must be > 0"):
        validate_job(cfg, world_size=1, num_layers=2)
    cfg = JobConfig()
    cfg.trainer.manual_gc_interval = -1
    with pytest.raises(ConfigError, match=r"trainer\.manual_gc_interval=-1 must be >= 0"):
        validate_job(cfg, world_size=1, num_layers=2)


def test_tokenizer_larger_than_embedding_names_both_sizes():
    tok = build_char_tokenizer()
    check_tokenizer_fits(tok, len(tok), "/m")
    check_tokenizer_fits(tok, len(tok) + 64, "/m")  # padded embeddings are fine
    with pytest.raises(TokenizerMismatchError) as err:
        check_tokenizer_fits(tok, len(tok) - 3, "/m")
    msg = str(err.value)
    assert f"has {len(tok)} tokens" in msg and f"embedding has {len(tok) - 3} rows" in msg
    assert "/m/config.json" in msg and "resize_token_embeddings" in msg


def test_rows_without_ground_truth_warn_once_with_the_count(tmp_path, caplog):
    path = tmp_path / "p.parquet"
    truths = ["1", None, "3", None]
    rows = {"prompt": ["a", "b", "c", "d"], "data_source": ["openai/gsm8k"] * 4,
            "reward_model": [{"style": "rule", "ground_truth": g} for g in truths]}  # fmt: skip
    pq.write_table(pa.table(rows), path)
    with caplog.at_level(logging.WARNING):
        ds = PromptDataset(str(path), build_char_tokenizer(), files_key="data.val_files")
    warned = [r.getMessage() for r in caplog.records if "ground_truth = null" in r.getMessage()]
    assert len(warned) == 1 and "data.val_files: 2 of 4 rows" in warned[0] and "dataset index 1" in warned[0]
    assert len(ds) == 4  # warned, not dropped: a reward model needs no ground truth
    caplog.clear()
    pq.write_table(pa.table({**rows, "reward_model": [{"style": "rule", "ground_truth": "1"}] * 4}), path)
    PromptDataset(str(path), build_char_tokenizer())
    assert "ground_truth" not in caplog.text
