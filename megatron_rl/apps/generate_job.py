"""Library entry of ``megatron-rl generate``: prompt strings in, completions (text, ids, log-probs) out.

Plain arguments only (the CLI converts its Hydra config). SPMD: every rank calls it; each DP rank
generates a contiguous share of the prompts, the shares are gathered, and rank 0 writes the JSONL.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.engine import EngineConfig, RolloutEngine
from megatron_rl.rollout.reshard import split_range
from megatron_rl.rollout.sampling import SamplingParams


def read_prompts(path: str | Path) -> list[str]:
    """The ``prompt`` field of each line of a JSONL file (``generate.prompts``)."""
    out = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt" not in row:
            raise KeyError(f"{path}:{number}: no 'prompt' field (generate.prompts needs one per line)")
        out.append(row["prompt"])
    return out


def encode_prompts(tokenizer, prompts: list[str], chat_template: bool) -> list[list[int]]:
    """Token ids per prompt; with ``chat_template`` each prompt becomes one user turn plus the
    assistant generation prompt."""
    if not chat_template:
        return [tokenizer(p).input_ids for p in prompts]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def _load_actor(model_path: str, dtype: torch.dtype, tp: int, pp: int):
    from megatron.core import parallel_state as ps

    from megatron_rl.distributed import init_distributed
    from megatron_rl.models import ModelArgs, build_model, load_hf_weights

    info = _trainer_checkpoint(model_path)
    args = info.args.with_tp(tp) if info else ModelArgs.from_hf_config(model_path, tp=tp)
    if not ps.model_parallel_is_initialized():
        init_distributed(tp, pp, num_layers=args.num_layers)
    model = build_model(args, role="actor", dtype=dtype)
    if info:
        from megatron_rl.checkpoint.convert import load_checkpoint_weights

        load_checkpoint_weights(model, info)
    else:
        load_hf_weights(model, model_path, args)
    return model, args


def _trainer_checkpoint(model_path: str):
    """The ``CheckpointInfo`` when ``model_path`` is a trainer checkpoint (``global_step_<N>``), else None."""
    from megatron_rl.checkpoint.convert import inspect_checkpoint
    from megatron_rl.checkpoint.names import DIST

    if not (Path(model_path) / DIST).is_dir():
        return None
    return inspect_checkpoint(model_path)


def generate_from_config(
    model_path: str,
    prompts: list[str],
    rollout: RolloutConfig,
    *,
    seed: int = 0,
    tokenizer=None,
    chat_template: bool = False,
    tp: int = 1,
    pp: int = 1,
    dtype: torch.dtype = torch.float32,
    output: str | Path | None = None,
) -> list[dict]:
    """Generate ``rollout.n`` completions per prompt from the HF checkpoint at ``model_path``, with the
    engine and sampling settings of the ``rollout`` config section (the trainer's builders).

    Initializes distributed (TP ``tp`` x PP ``pp``) if megatron-core's parallel_state is not set up.
    The tokenizer's EOS is a stop token. Returns, on every rank, one dict per
    completion (ordered by prompt, then sample): ``prompt``, ``sample_index``, ``response``,
    ``prompt_ids``, ``response_ids``, ``logprobs``, ``finish_reason``; rank 0 writes them to ``output``
    as JSONL when given.
    """
    if tokenizer is None:
        from transformers import AutoTokenizer

        info = _trainer_checkpoint(model_path)
        tokenizer = AutoTokenizer.from_pretrained(info.hf_side if info else model_path)
    model, spec = _load_actor(model_path, dtype, tp, pp)
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = split_range(len(prompts), dp, dp_rank)
    params = SamplingParams.from_config(
        rollout, temperature=rollout.temperature, n=rollout.n, seed=seed, eos_token_id=tokenizer.eos_token_id
    )
    ids = encode_prompts(tokenizer, [prompts[i] for i in share], chat_template)
    completions = RolloutEngine(model, spec, EngineConfig.from_config(rollout)).generate(ids, params)
    rows = [
        {
            "prompt": prompts[share[c.prompt_index]],
            "sample_index": c.sample_index,
            "response": tokenizer.decode(c.response_ids, skip_special_tokens=True),
            "prompt_ids": c.prompt_ids,
            "response_ids": c.response_ids,
            "logprobs": c.logprobs,
            "finish_reason": c.finish_reason,
        }
        for c in completions
    ]
    if dp > 1:
        every: list = [None] * dp
        dist.all_gather_object(every, rows, group=ps.get_data_parallel_group())
        rows = [row for part in every for row in part]
    if output is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows
