"""``reward.overlap``: the responses are scored (and the advantages estimated) inside the update's first loss,
after its forward is queued, so the host's scoring runs while the device computes. Same metrics as scoring
before the update, single-process (GRPO) and at DP 2 x TP 2 (PPO: the critic's loss reads the returns first);
at pipeline size 2 the scoring stays before the update (a last stage scoring in its loss would stall the others)."""

import pytest

from tests.integration.cli import metrics, train

NOISY = ("timing_s/", "perf/")
SHORT = ("trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false")
REWARD = """
import inspect, os

def score(data_source, solution_str, ground_truth, extra_info=None, **_):
    import torch
    path = os.environ["REWARD_STACK_LOG"] + f".{os.environ.get('RANK', '0')}"
    if not os.path.exists(path):  # the first call's callers (outermost last), then whether grad was on
        with open(path, "w") as f:
            f.write(" ".join(frame.function for frame in inspect.stack()) + f" grad={torch.is_grad_enabled()}")
    return float(len(solution_str) % 3 == 0)
"""


def _run(tmp_path, name, overlap, *extra, nproc=1):
    out = tmp_path / name
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    custom = ("reward.reward_fn=custom", f"reward.custom_reward_function.path={reward}",
              "reward.custom_reward_function.name=score")  # fmt: skip
    env = {"REWARD_STACK_LOG": str(tmp_path / f"{name}.stack")}
    proc = train(out, *SHORT, *custom, f"reward.overlap={overlap}", *extra, nproc=nproc, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [{k: v for k, v in r.items() if not k.startswith(NOISY)} for r in metrics(out)]
    stacks = {p.name.rsplit(".", 1)[1]: p.read_text().split() for p in tmp_path.glob(f"{name}.stack.*")}
    return rows, stacks


@pytest.mark.parametrize(
    "algorithm, extra, nproc",
    [("grpo", (), 1),
     ("ppo", ("parallel.tensor_model_parallel_size=2",), 4)],
)  # fmt: skip
def test_overlapped_scoring_gives_the_same_metrics(tmp_path, algorithm, extra, nproc):
    on, on_stacks = _run(tmp_path, "on", True, f"algorithm={algorithm}", *extra, nproc=nproc)
    off, off_stacks = _run(tmp_path, "off", False, f"algorithm={algorithm}", *extra, nproc=nproc)
    assert len(on) == 2 and on == off
    assert "critic/advantages/mean" in on[-1] and ("critic/vf_loss" in on[-1]) == (algorithm == "ppo")
    assert len(on_stacks) == nproc and len(off_stacks) == nproc
    for rank, stack in on_stacks.items():
        assert "scored_rollout" in off_stacks[rank] and "run_micro_batches" not in off_stacks[rank]
        # every rank scored inside its first loss (PPO: the critic's), under no autograd graph
        assert "_loss" in stack and "run_micro_batches" in stack, (rank, stack[:12])
        assert stack[-1] == "grad=False"  # no autograd graph built by the scoring inside the loss
        assert "scored_rollout" not in stack and "train_step" in stack


def test_pipeline_parallel_scores_before_the_update(tmp_path):
    rows, stacks = _run(
        tmp_path, "pp", True, "algorithm=grpo", "parallel.pipeline_model_parallel_size=2", nproc=2
    )
    assert len(rows) == 2 and len(stacks) == 2
    for rank, stack in stacks.items():
        assert "scored_rollout" in stack and "run_micro_batches" not in stack, (rank, stack[:12])
