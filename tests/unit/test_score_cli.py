"""`megatron-rl score`: a reward function over a file of responses, with training's loader and checks."""

import json
import textwrap

import pytest

from megatron_rl.apps.score_file import read_scoring_rows, score_file
from megatron_rl.rewards import build_reward_fn
from megatron_rl.score import expand


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_short_forms_expand_to_config_keys():
    assert expand(["reward=gsm8k", "input=a.jsonl", "output=b.jsonl", "reward.gsm8k_mode=flexible"]) == [
        "reward.reward_fn=gsm8k",
        "score.input=a.jsonl",
        "score.output=b.jsonl",
        "reward.gsm8k_mode=flexible",
    ]
    assert expand(["reward=my/reward.py"]) == ["reward.custom_reward_function.path=my/reward.py"]


def test_custom_reward_scores_with_extras_and_summary(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(
        textwrap.dedent("""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            hit = solution_str.strip() == str(ground_truth)
            return {"score": float(hit), "length": len(solution_str)}
    """)
    )
    rows = [
        {"prompt": "1+1=", "response": "2", "data_source": "toy", "ground_truth": "2"},
        {"prompt": "2+2=", "response": "5", "data_source": "toy", "reward_model": {"ground_truth": 4}},
        {
            "prompt": "3+3=",
            "response": "6 ",
            "data_source": "other",
            "ground_truth": "6",
            "extra_info": {"i": 2},
        },
    ]
    out = tmp_path / "scores.jsonl"
    summary = score_file(build_reward_fn("auto", str(reward)), _jsonl(tmp_path / "in.jsonl", rows), out)
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["score"] for r in scored] == [1.0, 0.0, 1.0] and [r["length"] for r in scored] == [1, 1, 2]
    assert summary["rows"] == 3 and summary["score/mean"] == pytest.approx(2 / 3)
    assert summary["score/mean_by_data_source"] == {"other": 1.0, "toy": 0.5}
    assert summary["reward/length/mean"] == pytest.approx(4 / 3)
    assert json.loads((tmp_path / "scores.jsonl.summary.json").read_text()) == summary


def test_bad_rows_give_the_training_loaders_messages(tmp_path):
    no_truth = _jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "response": "r", "data_source": "s"}])
    with pytest.raises(KeyError, match="has no column 'reward_model'"):
        read_scoring_rows(no_truth)
    bad_truth = _jsonl(
        tmp_path / "b.jsonl", [{"prompt": "p", "response": "r", "data_source": "s", "reward_model": 3}]
    )
    with pytest.raises(
        ValueError, match="row 0: column 'reward_model' is 3, expected a struct with a 'ground_truth'"
    ):
        read_scoring_rows(bad_truth)
    no_response = _jsonl(tmp_path / "c.jsonl", [{"prompt": "p", "data_source": "s", "ground_truth": "1"}])
    with pytest.raises(KeyError, match="has no 'response' field"):
        read_scoring_rows(no_response)
    (tmp_path / "d.jsonl").write_text('{"prompt": "p"}\n{oops\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_scoring_rows(tmp_path / "d.jsonl")


def test_cli_scores_a_file_with_a_built_in_rule(tmp_path, capsys):
    from megatron_rl.cli import main

    rows = [
        {"prompt": "q", "response": "so #### 42", "data_source": "openai/gsm8k", "ground_truth": "42"},
        {"prompt": "q", "response": "41", "data_source": "openai/gsm8k", "ground_truth": "42"},
        {"prompt": "12=", "response": "2", "data_source": "megatron_rl/last_digit", "ground_truth": "2"},
    ]
    data = _jsonl(tmp_path / "responses.jsonl", rows)
    main(["score", "reward=auto", f"input={data}"])  # auto: the rule of each row's data_source
    out = capsys.readouterr().out
    assert '"score/mean_by_data_source"' in out and "wrote 3 scores" in out
    scored = [json.loads(line) for line in (tmp_path / "responses.scores.jsonl").read_text().splitlines()]
    assert [r["score"] for r in scored] == [1.0, 0.0, 1.0]
    with pytest.raises(SystemExit) as exit_info:
        main(["score", "reward=nope", f"input={data}"])
    assert exit_info.value.code == 2 and "reward.reward_fn='nope'" in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists()
