"""One output directory per run, whatever the number of ranks.

Hydra names a run's directory from the clock (``outputs/<date>/<time>``) in each process, so the ranks of
one torchrun launch that straddle a second boundary would each pick their own directory (and disagree
about where the built-in tokenizer was saved). Before Hydra starts, rank 0 picks the time and publishes it
in torchrun's agent store (the TCP store every worker of a launch can reach); the other ranks read it, and
all of them pass the same ``hydra.run.dir``. Only rank 0 writes Hydra's ``.hydra/`` files and log.
With ``trainer.output_dir=X`` the run directory is X itself, so no ``outputs/`` tree is created.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence

from megatron_rl.distributed.runtime import LaunchEnv, read_launch_env

RUN_DIR_FORMAT = "outputs/%Y-%m-%d/%H-%M-%S"  # the same as configs/config.yaml's hydra.run.dir
STORE_KEY = "megatron_rl/run_dir"
STORE_TIMEOUT_S = 300.0


def _value(argv: Sequence[str], key: str) -> str | None:
    for arg in argv:
        name, eq, value = arg.partition("=")
        if eq and name.lstrip("+") == key:
            return value
    return None


def _agent_store(launch: LaunchEnv):
    """torchrun's store (every worker of the launch connects to it as a client), or None outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed import TCPStore

    return TCPStore(
        launch.master_addr,
        launch.master_port,
        world_size=None,
        is_master=False,
        timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
        wait_for_workers=False,
    )


def shared_run_dir(launch: LaunchEnv, now: Callable[[], datetime.datetime], store=None) -> str | None:
    """Rank 0's time-stamped run directory, the same string on every rank of the launch; None when the
    ranks have no store to agree through (then Hydra picks, as for a single process)."""
    store = store if store is not None else _agent_store(launch)
    if store is None:
        return None
    if launch.rank == 0:
        store.set(STORE_KEY, now().strftime(RUN_DIR_FORMAT))
    return store.get(STORE_KEY).decode()


def run_dir_overrides(
    argv: Sequence[str],
    launch: LaunchEnv | None = None,
    now: Callable[[], datetime.datetime] = datetime.datetime.now,
    store=None,
) -> list[str]:
    """The Hydra overrides to append to ``argv`` so that every rank uses one run directory."""
    if "-m" in argv or "--multirun" in argv or _value(argv, "hydra.run.dir") is not None:
        return []  # a sweep names its own sub-directories; an explicit hydra.run.dir is the user's
    launch = launch or read_launch_env()
    out = []
    output_dir = _value(argv, "trainer.output_dir")
    if output_dir is not None:
        out.append(f"hydra.run.dir={output_dir}")
    elif launch.world_size > 1:
        shared = shared_run_dir(launch, now, store)
        if shared is not None:
            out.append(f"hydra.run.dir={shared}")
    if launch.rank != 0:
        out += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    return out


def with_run_dir(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``run_dir_overrides`` placed right after the user's overrides: Hydra reads its
    overrides as one run of positional arguments, so ``... a=1 --cfg job b=2`` would not parse."""
    extra = run_dir_overrides(argv)
    positions = [i for i, arg in enumerate(argv) if "=" in arg and not arg.startswith("-")]
    at = positions[-1] + 1 if positions else 0
    return [*argv[:at], *extra, *argv[at:]]
