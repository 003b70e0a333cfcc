"""`megatron-rl score reward=<rule or file.py> input=<rows.jsonl> [output=...] [reward.* overrides]`.

Scores (prompt, response, ground truth) rows with the reward function a training run would build from
the same ``reward.*`` keys, and writes the scores plus a summary; no model, no process group.
``reward=NAME`` is short for ``reward.reward_fn=NAME``, ``reward=FILE.py`` for
``reward.custom_reward_function.path=FILE.py``, ``input=`` / ``output=`` for ``score.input`` /
``score.output``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megatron_rl.config.entry import fail

SHORT = {"input": "score.input", "output": "score.output"}


def expand(argv: list[str]) -> list[str]:
    """The short forms above -> config keys; other overrides unchanged."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key == "reward":
            key = "reward.custom_reward_function.path" if value.endswith(".py") else "reward.reward_fn"
        out.append(f"{SHORT.get(key, key)}={value}" if eq else arg)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return
    from hydra import compose, initialize_config_dir

    from megatron_rl.config.store import CONFIG_DIR, to_job_config

    # compose, not hydra.main: scoring a file makes no output directory; "." only fills the
    # ${hydra:runtime.output_dir} interpolation, which compose cannot resolve
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = to_job_config(compose("config", overrides=[*expand(argv), "trainer.output_dir=."]))
    if not cfg.score.input:
        fail("megatron-rl score needs input=<rows.jsonl> (score.input), e.g. "
             "megatron-rl score reward=gsm8k input=responses.jsonl")  # fmt: skip
    if cfg.reward.reward_fn == "model":
        fail("megatron-rl score runs rule and custom rewards; reward.reward_fn=model needs the trainer")
    from megatron_rl.logging.noise import quiet_dependencies

    quiet_dependencies()
    from megatron_rl.apps.score_file import score_file
    from megatron_rl.rewards import build_reward_fn
    from megatron_rl.tasks import register_builtin_tasks

    register_builtin_tasks()
    rw = cfg.reward
    output = cfg.score.output or str(Path(cfg.score.input).with_suffix(".scores.jsonl"))
    try:
        fn = build_reward_fn(rw.reward_fn, rw.custom_reward_function.path, rw.custom_reward_function.name,
                             format_score=rw.format_score, gsm8k_method=rw.gsm8k_mode)  # fmt: skip
        summary = score_file(fn, cfg.score.input, output, prompt_key=cfg.data.prompt_key)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, ImportError, AttributeError) as err:
        fail(f"{type(err).__name__}: {err}")
    print(json.dumps(summary, indent=2))
    print(
        f"megatron-rl score: wrote {summary['rows']} scores to {output} and the summary to {output}.summary.json"
    )


if __name__ == "__main__":
    main()
