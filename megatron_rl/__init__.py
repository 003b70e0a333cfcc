"""megatron_rl: a tensor/pipeline-parallel RL trainer for LLM post-training, built on megatron-core."""

__version__ = "0.1.0"
