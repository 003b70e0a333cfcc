"""`megatron-rl generate`: sample from a model with the trainer's rollout engine (same sampling keys).

    megatron-rl generate model.path=<HF dir> generate.prompts=<jsonl with "prompt"> generate.output=<jsonl> \
        [generate.max_new_tokens=128] [generate.n=1] [generate.temperature=0] [generate.chat_template=true]
Defaults: one greedy completion of up to 128 tokens per prompt; generate.temperature > 0 samples (with
rollout.top_p / rollout.top_k).
Runs under torchrun with parallel.tensor_model_parallel_size / pipeline_model_parallel_size and
rollout.tensor_model_parallel_size; prompts are split over data-parallel ranks, rank 0 writes the output.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from megatron_rl.config.entry import (
    checked_layout,
    fail,
    job_config,
    quiet_third_party,
    reported_errors,
    run_command,
)
from megatron_rl.config.store import CONFIG_DIR
from megatron_rl.logging.noise import quiet_dependencies

COMMAND = "generate"


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="config")
def _main(dcfg: DictConfig) -> None:
    quiet_third_party()
    quiet_dependencies()
    cfg = job_config(dcfg)
    missing = [
        k
        for k, v in (
            ("model.path", cfg.model.path),
            ("generate.prompts", cfg.generate.prompts),
            ("generate.output", cfg.generate.output),
        )
        if not v
    ]
    if missing:
        fail(
            f"megatron-rl generate needs {', '.join(missing)} (e.g. model.path=/models/Qwen2.5-0.5B-Instruct "
            f"generate.prompts=prompts.jsonl generate.output=out.jsonl)."
        )
    dims = checked_layout(cfg, training=False)

    import dataclasses

    import torch

    from megatron_rl.apps.generate_job import generate_from_config, read_prompts

    g = cfg.generate  # its own n / length / temperature: the training preset's (n=8, 4 tokens) do not fit
    rollout = dataclasses.replace(
        cfg.rollout, n=g.n, temperature=g.temperature, max_new_tokens=g.max_new_tokens
    )
    with reported_errors(cfg.trainer.output_dir):
        rows = generate_from_config(
            cfg.model.path,
            read_prompts(cfg.generate.prompts),
            rollout,
            seed=cfg.trainer.seed,
            chat_template=cfg.generate.chat_template,
            tp=dims.tp,
            pp=dims.pp,
            dtype=getattr(torch, cfg.model.dtype),
            output=cfg.generate.output,
        )
        print(f"megatron-rl generate: wrote {len(rows)} completions to {cfg.generate.output}")


def main() -> None:
    run_command(COMMAND, _main)


if __name__ == "__main__":
    main()
