"""Prompt data: verl-format parquet files -> tokenized rows -> seeded, resumable global batches."""

from megatron_rl.data.parquet_source import SourceRow, read_prompt_files
from megatron_rl.data.prompt_dataset import TRUNCATION_MODES, PromptDataset, PromptRow
from megatron_rl.data.sampler import PromptDataLoader, PromptSampler, dp_share, eval_batches
from megatron_rl.data.tiny_tokenizer import build_char_tokenizer

__all__ = [
    "TRUNCATION_MODES",
    "PromptDataLoader",
    "PromptDataset",
    "PromptRow",
    "PromptSampler",
    "SourceRow",
    "build_char_tokenizer",
    "dp_share",
    "eval_batches",
    "read_prompt_files",
]
