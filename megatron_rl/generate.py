"""`megatron-rl generate`: sample from a model with the trainer's rollout engine (same sampling keys).

    megatron-rl generate model.path=<HF dir> generate.prompts=<jsonl with "prompt"> generate.output=<jsonl> \
        rollout.temperature=0 rollout.max_new_tokens=64 [generate.chat_template=true]
Runs under torchrun with parallel.tensor_model_parallel_size / pipeline_model_parallel_size and
rollout.tensor_model_parallel_size; prompts are split over data-parallel ranks, rank 0 writes the output.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from megatron_rl.config.entry import checked_layout, fail, quiet_third_party, reported_errors
from megatron_rl.config.store import CONFIG_DIR, to_job_config


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="config")
def main(dcfg: DictConfig) -> None:
    quiet_third_party()
    cfg = to_job_config(dcfg)
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

    import torch

    from megatron_rl.apps.generate_job import generate_from_config, read_prompts
    from megatron_rl.rollout.engine import EngineConfig
    from megatron_rl.rollout.sampling import SamplingParams

    r = cfg.rollout
    sampling = SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        n=r.n,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=tuple(r.stop_token_ids),
        seed=cfg.trainer.seed,
    )
    with reported_errors(cfg.trainer.output_dir):
        rows = generate_from_config(
            cfg.model.path,
            read_prompts(cfg.generate.prompts),
            sampling,
            chat_template=cfg.generate.chat_template,
            engine_config=EngineConfig.from_config(r),
            tp=dims.tp,
            pp=dims.pp,
            dtype=getattr(torch, cfg.model.dtype),
            output=cfg.generate.output,
        )
        print(f"megatron-rl generate: wrote {len(rows)} completions to {cfg.generate.output}")


if __name__ == "__main__":
    main()
