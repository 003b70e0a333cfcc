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
        ".venv/bin/python -m pytest -q tests",
    ):
        assert cmd in readme and cmd in ci
