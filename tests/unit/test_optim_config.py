"""Start-up validation of the optimizer keys that choose offloading (issue 15 items 2 and 3)."""

import pytest

from megatron_rl.config.schema import JobConfig
from megatron_rl.config.validate import ConfigError, validate_job


def _hybrid(**optim) -> JobConfig:
    cfg = JobConfig()
    cfg.model.dtype = "bfloat16"
    for k, v in {"backend": "megatron", "use_distributed_optimizer": True, "optimizer_cpu_offload": True,
                 **optim}.items():  # fmt: skip
        setattr(cfg.actor.optim, k, v)
    return cfg


def test_hybrid_optimizer_accepted_with_the_distributed_optimizer_on_bf16():
    validate_job(_hybrid(optimizer_offload_fraction=0.5, overlap_cpu_optimizer_d2h_h2d=True), 2, num_layers=2)


@pytest.mark.parametrize(
    "change, keys",
    [
        ({"backend": "local", "use_distributed_optimizer": False}, "actor.optim.backend=megatron"),
        ({"use_distributed_optimizer": False}, "actor.optim.use_distributed_optimizer=true"),
        ({"optimizer_offload_fraction": 1.5}, "actor.optim.optimizer_offload_fraction=1.5"),
        ({"optimizer_offload": True}, "actor.optim.optimizer_offload=true"),
    ],
)
def test_hybrid_optimizer_misuse_names_the_keys(change, keys):
    with pytest.raises(ConfigError) as err:
        validate_job(_hybrid(**change), world_size=2, num_layers=2)
    assert keys in str(err.value) and "actor.optim.optimizer_cpu_offload" in str(err.value)


def test_hybrid_optimizer_needs_bf16_and_checkpoints():
    cfg = _hybrid()
    cfg.model.dtype = "float32"
    with pytest.raises(ConfigError, match="needs model.dtype=bfloat16"):
        validate_job(cfg, world_size=2, num_layers=2)
    cfg = _hybrid()  # its state is checkpointed (tests/integration/test_hybrid_checkpoint.py)
    cfg.trainer.save_freq, cfg.trainer.save_final, cfg.trainer.save_on_signal = 5, True, True
    validate_job(cfg, world_size=2, num_layers=2)


def test_generation_offload_keys_valid_on_both_backends():
    for backend in ("local", "megatron"):
        cfg = JobConfig()
        cfg.actor.optim.backend = backend
        cfg.actor.optim.param_offload = cfg.actor.optim.optimizer_offload = cfg.actor.optim.grad_offload = (
            True
        )
        validate_job(cfg, world_size=1, num_layers=2)
