"""Job configuration: dataclasses (schema), Hydra registration (store) and start-up validation."""

from megatron_rl.config.schema import JobConfig
from megatron_rl.config.validate import ConfigError, validate_job

__all__ = ["ConfigError", "JobConfig", "validate_job"]
