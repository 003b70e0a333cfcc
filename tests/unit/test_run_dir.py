"""One output directory per run: the ranks of a launch agree on it; trainer.output_dir is used as is."""

import datetime
import re

from megatron_rl.config.run_dir import STORE_KEY, run_dir_overrides, with_run_dir
from megatron_rl.distributed.runtime import LaunchEnv
from tests.distributed.launch import run_torchrun


class FakeStore:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode()

    def get(self, key):
        return self.data[key]


def _launch(rank, world=4):
    return LaunchEnv(rank, world, rank, "127.0.0.1", 29500, "torchrun")


def test_rank0_picks_the_time_and_every_rank_uses_it():
    store, noon = FakeStore(), datetime.datetime(2026, 12, 1, 12, 0, 0)
    clocks = [noon + datetime.timedelta(seconds=0.999 * r) for r in range(4)]  # straddling seconds
    got = [run_dir_overrides([], _launch(r), now=lambda r=r: clocks[r], store=store) for r in range(4)]
    assert store.data[STORE_KEY] == b"outputs/2026-12-01/12-00-00"
    assert {o[0] for o in got} == {"hydra.run.dir=outputs/2026-12-01/12-00-00"}
    assert got[0] == ["hydra.run.dir=outputs/2026-12-01/12-00-00"]  # rank 0 keeps .hydra/ and its log
    assert got[3][1:] == ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]


def test_output_dir_given_is_the_hydra_dir_and_sweeps_are_left_alone():
    assert run_dir_overrides(["trainer.output_dir=runs/x"], _launch(0, 1)) == ["hydra.run.dir=runs/x"]
    assert run_dir_overrides(["-m", "actor.optim.lr=1,2"], _launch(1)) == []
    assert run_dir_overrides(["hydra.run.dir=mine"], _launch(0)) == []
    assert run_dir_overrides([], _launch(0, 1)) == []  # one process: Hydra's own time-stamped dir


def test_four_ranks_with_different_clocks_resolve_one_output_dir():
    out = run_torchrun("run_dir_worker.py", 4, timeout=600).stdout
    lines = [line.split() for line in out.splitlines() if line.startswith("rank ")]
    assert len(lines) == 4, out
    assert len({clock for _, _, clock, _ in lines}) > 1, out  # the ranks did read different seconds
    dirs = {d for _, _, _, d in lines}
    assert len(dirs) == 1 and re.search(r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d$", dirs.pop()), out


def test_added_overrides_join_the_users_so_hydra_flags_still_parse():
    argv = ["parallel.tensor_model_parallel_size=2", "trainer.output_dir=runs/x", "--cfg", "job"]
    assert with_run_dir(argv) == [*argv[:2], "hydra.run.dir=runs/x", "--cfg", "job"]
    assert with_run_dir(["--cfg", "job", "trainer.output_dir=y"]) == [
        "--cfg",
        "job",
        "trainer.output_dir=y",
        "hydra.run.dir=y",
    ]
