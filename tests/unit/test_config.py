"""Config composition, validation messages and the CLI surface (issue: foundation)."""

import os
import subprocess
import sys

import pytest

from megatron_rl.config import ConfigError, JobConfig, validate_job
from megatron_rl.config.help import schema_docs
from megatron_rl.distributed import LayoutError

CLI = [sys.executable, "-m", "megatron_rl.cli"]


def _run(args, tmp_path, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    env.update(env_extra or {})
    return subprocess.run(CLI + args, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


def test_defaults_validate_at_world_1():
    dims = validate_job(JobConfig(), world_size=1, num_layers=2)
    assert (dims.tp, dims.pp, dims.dp) == (1, 1, 1)


def test_tp3_with_4_ranks_names_key_and_alternative():
    cfg = JobConfig()
    cfg.parallel.tensor_model_parallel_size = 3
    with pytest.raises(LayoutError) as err:
        validate_job(cfg, world_size=4, num_layers=2)
    msg = str(err.value)
    assert "parallel.tensor_model_parallel_size=3" in msg and "world size 4" in msg
    assert "TP=2 x PP=2" in msg  # a valid alternative is offered


def test_pp_larger_than_layers():
    cfg = JobConfig()
    cfg.parallel.pipeline_model_parallel_size = 4
    with pytest.raises(LayoutError, match=r"pipeline_model_parallel_size=4 is larger than the model's 2"):
        validate_job(cfg, world_size=4, num_layers=2)


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("actor.ppo_mini_batch_size", 5, "actor.ppo_mini_batch_size=5 must divide data.train_batch_size=16"),
        ("actor.ppo_micro_batch_size_per_gpu", 3, "actor.ppo_micro_batch_size_per_gpu=3 must divide"),
        ("actor.ppo_mini_batch_size", 32, "must divide data.train_batch_size"),
    ],
)
def test_batch_sizes_that_do_not_divide(key, value, needle):
    cfg = JobConfig()
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        validate_job(cfg, world_size=1, num_layers=2)


def test_mini_batch_smaller_than_dp_never_loops():
    cfg = JobConfig()
    cfg.rollout.n = 1
    cfg.actor.ppo_mini_batch_size = 2
    cfg.actor.ppo_micro_batch_size_per_gpu = 1
    with pytest.raises(ConfigError, match="does not split evenly over the data-parallel size 4"):
        validate_job(cfg, world_size=4, num_layers=2)


def test_critic_batches_checked_only_with_gae():
    cfg = JobConfig()
    cfg.critic.ppo_micro_batch_size_per_gpu = 7
    validate_job(cfg, world_size=1, num_layers=2)  # grpo: no critic
    cfg.algorithm.adv_estimator = "gae"
    with pytest.raises(ConfigError, match="critic.ppo_micro_batch_size_per_gpu=7"):
        validate_job(cfg, world_size=1, num_layers=2)


def test_unknown_choice_and_logger():
    cfg = JobConfig()
    cfg.algorithm.adv_estimator = "ppo"
    with pytest.raises(ConfigError, match="algorithm.adv_estimator='ppo' is not one of"):
        validate_job(cfg, world_size=1)
    cfg = JobConfig()
    cfg.trainer.logger = ["console", "neptune"]
    with pytest.raises(ConfigError, match="trainer.logger"):
        validate_job(cfg, world_size=1)


def test_rollout_tp_must_divide_train_tp():
    cfg = JobConfig()
    cfg.parallel.tensor_model_parallel_size = 4
    cfg.rollout.tensor_model_parallel_size = 3
    with pytest.raises(ConfigError, match="rollout.tensor_model_parallel_size=3 must divide"):
        validate_job(cfg, world_size=4, num_layers=2)


def test_cli_help_and_cfg_job(tmp_path):
    out = _run(["train", "--help", "algorithm=ppo"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "algorithm=grpo | ppo" in out.stdout  # the YAML groups and their options
    lines = out.stdout.splitlines()
    for key, text in schema_docs():  # every key, with its composed value and its schema description
        assert any(
            line.split()[0].startswith(f"{key}=") and line.endswith(text) for line in lines if line.strip()
        ), key
    assert any(
        line.split()[:1] == ["algorithm.adv_estimator=gae"] for line in lines
    )  # ppo's value, not grpo's
    assert any(line.split()[:1] == ["actor.optim.lr=0.003"] for line in lines)  # the tiny model group's value
    assert not (tmp_path / "outputs").exists()
    out = _run(["train", "--cfg", "job", "algorithm=ppo", "rollout.temperature=0.7"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "adv_estimator: gae" in out.stdout and "temperature: 0.7" in out.stdout
    top = _run([], tmp_path)
    assert top.returncode == 2 and "train" in top.stdout


def test_cli_tp2_single_process_fails_fast(tmp_path):
    out = _run(["train", "parallel.tensor_model_parallel_size=2"], tmp_path)
    assert out.returncode != 0
    assert "parallel.tensor_model_parallel_size=2" in out.stderr and "world size 1" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_bad_batch_is_one_paragraph(tmp_path):
    out = _run(["train", "actor.ppo_micro_batch_size_per_gpu=3"], tmp_path)
    assert out.returncode != 0
    assert "actor.ppo_micro_batch_size_per_gpu=3" in out.stderr and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0


def test_optim_backend_choice_and_distributed_optimizer_needs_megatron():
    cfg = JobConfig()
    cfg.actor.optim.backend = "apex"
    with pytest.raises(ConfigError, match=r"actor\.optim\.backend='apex' is not one of: local \| megatron"):
        validate_job(cfg, world_size=1, num_layers=2)
    cfg = JobConfig()
    cfg.actor.optim.use_distributed_optimizer = True
    with pytest.raises(ConfigError) as err:
        validate_job(cfg, world_size=2, num_layers=2)
    msg = str(err.value)
    assert "actor.optim.use_distributed_optimizer=true needs actor.optim.backend=megatron" in msg
    assert "\n" not in msg
    cfg.actor.optim.backend = "megatron"  # megatron-core's optimizer runs on CPU/gloo too (cpu_compat)
    validate_job(cfg, world_size=2, num_layers=2)
    cfg.critic.optim.use_distributed_optimizer = True
    validate_job(cfg, world_size=2, num_layers=2)  # grpo: no critic, its optimizer is never built
    cfg.algorithm.adv_estimator = "gae"
    with pytest.raises(ConfigError, match=r"critic\.optim\.use_distributed_optimizer=true needs"):
        validate_job(cfg, world_size=2, num_layers=2)


def test_cli_distributed_optimizer_without_megatron_is_one_paragraph(tmp_path):
    out = _run(["train", "actor.optim.use_distributed_optimizer=true"], tmp_path)
    assert out.returncode != 0
    assert "actor.optim.backend=megatron" in out.stderr and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0


def test_dynamic_batch_size_replaces_the_micro_batch_check_and_needs_room_for_one_sequence():
    cfg = JobConfig()
    cfg.actor.ppo_micro_batch_size_per_gpu = 7  # divides nothing: ignored with use_dynamic_bsz
    cfg.actor.use_dynamic_bsz = True
    cfg.actor.ppo_max_token_len_per_gpu = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    validate_job(cfg, world_size=1, num_layers=2)
    cfg.actor.ppo_max_token_len_per_gpu -= 1
    with pytest.raises(ConfigError, match=r"actor.ppo_max_token_len_per_gpu=.*at least"):
        validate_job(cfg, world_size=1, num_layers=2)


@pytest.mark.parametrize(
    "keys, needle",
    [
        ({"recompute_granularity": "some"}, r"actor\.recompute_granularity='some': use null, selective or full"),
        ({"recompute_granularity": "full"}, r"needs actor\.recompute_method=uniform\|block"),
        ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3},
         r"actor\.recompute_num_layers=3 .* 1\.\.2"),
        ({"recompute_granularity": "selective", "recompute_method": "uniform"}, r"full only"),
        ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, r"choose from"),
    ],
)  # fmt: skip
def test_recompute_keys_are_checked_with_our_key_names(keys, needle):
    cfg = JobConfig()
    for k, v in keys.items():
        setattr(cfg.actor, k, v)
    with pytest.raises(ConfigError, match=needle):
        validate_job(cfg, world_size=1, num_layers=2)


def test_recompute_keys_reach_the_transformer_config():
    cfg = JobConfig()
    assert cfg.actor.recompute_kwargs() == {} and cfg.critic.recompute_kwargs() == {}
    cfg.critic.recompute_granularity, cfg.critic.recompute_method, cfg.critic.recompute_num_layers = (
        "full",
        "uniform",
        1,
    )
    cfg.algorithm.adv_estimator = "gae"
    validate_job(cfg, world_size=1, num_layers=2)
    kw = cfg.critic.recompute_kwargs()
    assert kw["recompute_granularity"] == "full" and kw["recompute_method"] == "uniform"
    assert kw["recompute_num_layers"] == 1 and kw["recompute_modules"] == ["core_attn"]
