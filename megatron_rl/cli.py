"""The `megatron-rl` console script: `megatron-rl <train|generate|score|report|ckpt> [arguments...]`."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("megatron_rl.train", "train a policy with PPO/GRPO (Hydra app; --help for options)"),
    "generate": ("megatron_rl.generate", "sample from a model or checkpoint with the rollout engine"),
    "score": ("megatron_rl.score", "score (prompt, response, ground truth) rows with a reward function"),
    "report": ("megatron_rl.report", "plot a run or a sweep: report.html + PNGs from metrics.jsonl"),
    "ckpt": ("megatron_rl.ckpt", "ckpt info DIR: step, shape, layout, contents, sizes, verification"),
}

USAGE = (
    "usage: megatron-rl <command> [arguments ...] (megatron-rl <command> --help for each)\n\ncommands:\n"
    + "\n".join(f"  {name:<10} {text}" for name, (_, text) in COMMANDS.items())
)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    if argv[0] not in COMMANDS:
        print(f"megatron-rl: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(COMMANDS[argv[0]][0])
    sys.argv = [f"megatron-rl {argv[0]}", *argv[1:]]
    module.main()


if __name__ == "__main__":
    main()
