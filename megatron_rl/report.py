"""`megatron-rl report RUN_DIR [--output DIR]`: plots of a run or a multirun sweep -> report.html + PNGs."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="megatron-rl report",
        description="Plot a run's metrics.jsonl (score, KL, entropy, response length, time per phase, "
        "throughput, MFU, memory); a sweep directory overlays its runs, labelled by their overrides.",
    )
    parser.add_argument("run_dir", help="a run's trainer.output_dir, or a Hydra multirun sweep directory")
    parser.add_argument("--output", help="where report.html and report/*.png go (default: RUN_DIR)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from megatron_rl.logging.report import write_report

    try:
        report = write_report(args.run_dir, args.output)
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"megatron-rl report: error: {err}\n")
    print(
        f"megatron-rl report: wrote {report.html} ({len(report.pngs)} charts in {report.html.parent}/report)"
    )


if __name__ == "__main__":
    main()
