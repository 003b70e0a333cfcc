"""The README stays true: its config reference is the generated one, and CI runs its commands."""

from pathlib import Path

from megatron_rl.config.reference import BEGIN, END, render

REPO = Path(__file__).resolve().parents[2]


def test_config_reference_is_current():
    text = (REPO / "README.md").read_text()
    section = text[text.index(BEGIN) : text.index(END) + len(END)]
    assert section == render(), "regenerate with: python -m megatron_rl.config.reference"


def test_ci_runs_readme_setup_and_test_commands():
    readme, ci = (REPO / "README.md").read_text(), (REPO / ".ci/run").read_text()
    for cmd in (
        'python3 -m venv .venv && .venv/bin/pip install "torch==2.13.0" -e ".[dev]"',
        ".venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=25 tests",
    ):
        assert cmd in readme and cmd in ci


CPU_BEGIN, CPU_END = "<!-- cpu-recipes:begin -->", "<!-- cpu-recipes:end -->"
SHORT = "trainer.total_training_steps=2 trainer.test_freq=2 trainer.log_generations_freq=1"


def cpu_recipes() -> list[str]:
    """The commands of the README's "First hour on CPU" block, comments stripped."""
    text = (REPO / "README.md").read_text()
    block = text[text.index(CPU_BEGIN) : text.index(CPU_END)]
    body = block.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("   #")[0].strip() for line in body.splitlines() if line.strip()]


def as_tested(command: str) -> str:
    """A README command made cheap without changing what it runs: training gets 2 steps (so the step in a
    checkpoint path is 2); the 4-rank launch starts as written but only composes its config (`--cfg job`),
    the sweep runs each job as a dry run (Hydra refuses --cfg with -m): their full runs are
    tests/integration/test_train_builtin.py::test_tp2_pp2_learns and tests/unit/test_launch_sweep.py."""
    command = command.replace("global_step_120", "global_step_2")
    if command.startswith("torchrun"):
        return f"{command} --cfg job"
    if " -m " in command:
        return f"{command} trainer.dry_run=true"
    if command.startswith("megatron-rl train") and "--help" not in command:
        return f"{command} {SHORT}"
    return command


def test_cpu_recipes_run_as_written_after_activation(tmp_path):
    import os
    import shlex
    import subprocess
    import sys

    commands = cpu_recipes()
    assert commands[0] == "megatron-rl train trainer.output_dir=runs/first" and len(commands) >= 8
    # the README's set-up leaves the venv in the repo root, where the commands run; this venv stands in
    (tmp_path / ".venv").symlink_to(sys.prefix)
    script = "set -euo pipefail\nsource .venv/bin/activate\n" + "".join(
        f"echo {shlex.quote('>>> ' + c)}\n{as_tested(c)}\n" for c in commands
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "VIRTUAL_ENV")}
    env |= {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}  # no venv on PATH
    proc = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500
    )
    ran = [line[4:] for line in proc.stdout.splitlines() if line.startswith(">>> ")]
    assert proc.returncode == 0, f"failed at: {ran[-1:]}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert ran == commands
    assert (tmp_path / "runs/first/report.html").is_file() and (tmp_path / "completions.jsonl").is_file()
    assert "verified    ok" in proc.stdout and (tmp_path / "runs/first/generations.scores.jsonl").is_file()
