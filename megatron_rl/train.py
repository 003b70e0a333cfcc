"""`megatron-rl train` / `python -m megatron_rl.train`: compose the config, init distributed, train."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from megatron_rl.config.entry import checked_layout, job_config, quiet_third_party, reported_errors
from megatron_rl.config.run_dir import with_run_dir
from megatron_rl.config.store import CONFIG_DIR
from megatron_rl.logging.noise import quiet_dependencies, verbose

COMMAND = "train"


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="config")
def _main(dcfg: DictConfig) -> None:
    quiet_third_party()
    quiet_dependencies()
    cfg = job_config(dcfg)
    dims = checked_layout(cfg)  # exits with a message before any process group or GPU work

    from megatron_rl.distributed.shutdown import ended_children, install_stop_handlers, own_children
    from megatron_rl.trainer.run import run_training

    install_stop_handlers()  # SIGTERM/SIGINT: every rank finishes the step, saves, exits EXIT_SIGNALLED
    own_children()
    with ended_children(), reported_errors(cfg.trainer.output_dir):
        run_training(cfg, dims)


def main() -> None:
    """Every rank of a launch gets the same run directory (``config/run_dir.py``), then Hydra runs;
    ``--help`` lists every key with its description (``config/help.py``)."""
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        from megatron_rl.config.help import render_help

        print(render_help(COMMAND, [a for a in sys.argv[1:] if a not in ("--help", "-h")]))
        return
    sys.argv[1:] = with_run_dir(sys.argv[1:])
    try:
        _main()
    except KeyboardInterrupt:
        if verbose():
            raise
        print(f"\nmegatron-rl {COMMAND}: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
