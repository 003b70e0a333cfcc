"""`megatron-rl ckpt info DIR`: step, model shape, saved layout, contents, sizes and verification of a
training checkpoint (DIR: ``.../checkpoints/global_step_N`` or a run's ``trainer.output_dir``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megatron-rl ckpt", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    info = sub.add_parser(
        "info", help="describe a checkpoint (reads its JSON files and sizes; loads no tensor)"
    )
    info.add_argument("dir", help="checkpoints/global_step_N, a checkpoints folder, or a run's output_dir")
    info.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from megatron_rl.logging.noise import quiet_dependencies

    quiet_dependencies()  # the checkpoint constants' package imports megatron-core, which warns
    from megatron_rl.apps.ckpt_info import format_summary, inspect_checkpoint

    try:
        summary = inspect_checkpoint(args.dir)
    except FileNotFoundError as err:
        parser.exit(2, f"megatron-rl ckpt: error: {err}\n")
    if args.json:
        print(
            json.dumps(
                {**dataclasses.asdict(summary), "path": str(summary.path), "verified": summary.verified}
            )
        )
    else:
        print(format_summary(summary))
    sys.exit(0 if summary.verified else 1)


if __name__ == "__main__":
    main()
