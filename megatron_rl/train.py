"""`megatron-rl train` / `python -m megatron_rl.train`: compose the config, init distributed, train."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from megatron_rl.config.entry import (
    checked_layout,
    job_config,
    quiet_third_party,
    reported_errors,
    run_command,
)
from megatron_rl.config.store import CONFIG_DIR
from megatron_rl.logging.noise import quiet_dependencies

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
    run_command(COMMAND, _main)


if __name__ == "__main__":
    main()
