"""What every entry point does first: compose, convert, validate — and report bad input in one paragraph."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

from megatron_rl.config.schema import JobConfig, ModelConfig
from megatron_rl.config.validate import ConfigError, validate_job
from megatron_rl.distributed.dims import LayoutError, ParallelDims
from megatron_rl.distributed.runtime import read_launch_env


def fail(message: str, code: int = 2) -> None:
    """Print a one-paragraph error (once, from rank 0) and exit non-zero on every rank."""
    if read_launch_env().rank == 0:
        print(f"megatron-rl: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def model_num_layers(model: ModelConfig) -> int:
    """Layer count of the configured model, read cheaply (config.json only) before any heavy work."""
    if model.path is None:
        return model.num_layers
    from megatron_rl.models.args import find_hf_config

    found = find_hf_config(model.path)
    if found is not None:
        return int(json.loads(found.read_text())["num_hidden_layers"])
    raise ConfigError(
        f"model.path={model.path!r} has no config.json (looked in {model.path} and {model.path}/hf_config). "
        f"Point model.path at an HF model directory or a megatron_rl checkpoint."
    )


def job_config(dcfg) -> JobConfig:
    """The composed Hydra config as a ``JobConfig``; on an unknown key, exit with the message."""
    from megatron_rl.config.store import to_job_config

    try:
        return to_job_config(dcfg)
    except ConfigError as err:
        fail(str(err))


def checked_layout(cfg: JobConfig, training: bool = True) -> ParallelDims:
    """Validate ``cfg`` against the launch's world size; on bad input, exit with the message."""
    try:
        world = read_launch_env().world_size
        dims = validate_job(cfg, world, num_layers=model_num_layers(cfg.model), training=training)
    except LayoutError as err:
        fail(str(err))
    from megatron_rl.kernels import decode_gemm

    try:
        decode_gemm.table()  # MEGATRON_RL_DECODE_GEMM_TABLE's file, read and checked before any GPU work
    except ValueError as err:
        fail(str(err))
    return dims


def quiet_third_party() -> None:
    """megatron-core warns at import that apex/TE are absent; they are optional here."""
    import warnings

    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@contextlib.contextmanager
def reported_errors(output_dir: str):
    """Turn an exception into a one-paragraph message on stderr (rank 0) and the full traceback in
    ``<output_dir>/error_rank<R>.log``; ``MEGATRON_RL_TRACEBACK=1`` lets it propagate instead."""
    try:
        yield
    except Exception as err:
        if os.environ.get("MEGATRON_RL_TRACEBACK") == "1":
            raise
        rank = read_launch_env().rank
        log = Path(output_dir) / f"error_rank{rank}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(traceback.format_exc())
        fail(f"{type(err).__name__}: {err} (traceback: {log}; MEGATRON_RL_TRACEBACK=1 shows it)", code=1)


def run_command(command: str, hydra_main) -> None:
    """What ``megatron-rl <command>`` does around its Hydra app: ``--help`` lists every key with its
    description (``config/help.py``); every rank of a launch gets the same run directory
    (``config/run_dir.py``); Ctrl-C ends with one line (the traceback only with MEGATRON_RL_VERBOSE=1)."""
    from megatron_rl.config.run_dir import with_run_dir
    from megatron_rl.logging.noise import verbose

    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        from megatron_rl.config.help import render_help

        print(render_help(command, [a for a in sys.argv[1:] if a not in ("--help", "-h")]))
        return
    sys.argv[1:] = with_run_dir(sys.argv[1:])
    try:
        hydra_main()
    except KeyboardInterrupt:
        if verbose():
            raise
        print(f"\nmegatron-rl {command}: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
