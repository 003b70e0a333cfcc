"""Rule rewards, the data_source registry, custom reward files and batch scoring checks."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest
import torch

from megatron_rl.rewards import (
    build_reward_fn,
    default_compute_score,
    gsm8k,
    load_custom_reward_fn,
    math_boxed,
    registry,
    score_batch,
)


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("so she has 5 + 7 = 12 apples.\n#### 12", "12", "12"),
        ("total is 1,234 dollars #### 1,234.", "1234", "1234"),
        ("#### $-3", "-3", "-3"),
        ("the answer is 12", None, "12"),
        ("no numbers here", None, None),
        ("#### 4 then later 5", "4", "5"),
    ],
)
def test_gsm8k_extraction(text, strict, flexible):
    assert gsm8k.extract_solution(text, "strict") == strict
    assert gsm8k.extract_solution(text, "flexible") == flexible


def test_gsm8k_scores_and_format_score():
    assert gsm8k.compute_score("#### 1,234", "1234") == 1.0
    assert gsm8k.compute_score("#### 12.0", "12") == 1.0
    assert gsm8k.compute_score("#### 13", "12") == 0.0
    assert gsm8k.compute_score("#### 13", "12", format_score=0.1) == 0.1
    assert gsm8k.compute_score("answer: 12", "12", format_score=0.1) == 0.0  # strict: not formatted
    assert gsm8k.compute_score("answer: 12", "12", method="flexible") == 1.0
    assert gsm8k.compute_score("#### 12", "12", score=2.0) == 2.0
    assert gsm8k.compute_score("x" * 1000 + "#### 7", "7") == 1.0
    with pytest.raises(ValueError, match="'loose'"):
        gsm8k.compute_score("#### 1", "1", method="loose")


def test_boxed_extraction_with_nested_braces():
    text = r"first \boxed{1} then \boxed{\frac{1}{\sqrt{2}}} done"
    assert math_boxed.last_boxed_content(text) == r"\frac{1}{\sqrt{2}}"
    assert math_boxed.last_boxed_content(r"\fbox{a{b}c}") == "a{b}c"
    assert math_boxed.last_boxed_content(r"so $\boxed 5$.") == "5"
    assert math_boxed.last_boxed_content(r"\boxed{unclosed") is None
    assert math_boxed.last_boxed_content("plain") is None


def test_math_normalisation_and_numeric_compare():
    assert math_boxed.compute_score(r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}") == 1.0
    assert math_boxed.compute_score(r"\boxed{0.5}", r"\frac12") == 0.0  # not parseable: strings differ
    assert math_boxed.compute_score(r"\boxed{0.5}", r"\frac{1}{2}") == 1.0
    assert math_boxed.compute_score(r"\boxed{ \left( 1, 2 \right) .}", "(1,2)") == 1.0
    assert math_boxed.compute_score(r"\boxed{2.0}", "2") == 1.0
    assert math_boxed.compute_score(r"\boxed{3}", "2") == 0.0
    assert math_boxed.compute_score(r"\boxed{3}", "2", format_score=0.2) == 0.2
    assert math_boxed.compute_score("3", "3") == 0.0
    assert math_boxed.compute_score(r"\boxed{7}", r"so the answer is $\boxed{7}$") == 1.0


def test_default_dispatch_by_data_source():
    assert default_compute_score("openai/gsm8k", "#### 3", "3") == 1.0
    assert default_compute_score("lighteval/MATH", r"\boxed{3}", "3") == 1.0
    assert default_compute_score("DigitalLearningGmbH/MATH-lighteval", "#### 3", "3") == 0.0
    with pytest.raises(KeyError, match="data_source='mystery'.*reward.reward_fn"):
        default_compute_score("mystery", "#### 3", "3")
    flexible = build_reward_fn("gsm8k", gsm8k_method="flexible", format_score=0.1)
    assert flexible("anything", "it is 3", "3") == 1.0
    assert flexible("anything", "it is 4", "3") == 0.1
    auto = build_reward_fn("auto", format_score=0.2)
    assert auto(data_source="lighteval/MATH", solution_str=r"\boxed{4}", ground_truth="3") == 0.2
    assert auto(data_source="openai/gsm8k", solution_str="it is 3", ground_truth="3") == 0.0  # strict
    with pytest.raises(ValueError, match="reward.gsm8k_mode='loose'"):
        build_reward_fn("auto", gsm8k_method="loose")
    with pytest.raises(ValueError, match="reward.reward_fn='nope'"):
        build_reward_fn("nope")
    with pytest.raises(ValueError, match="RewardModelScorer"):
        build_reward_fn("model")


def test_register_rule_is_used_by_name_and_by_auto(monkeypatch):
    monkeypatch.setattr("megatron_rl.rewards.registry.RULES", dict(registry.RULES))
    monkeypatch.setattr("megatron_rl.rewards.registry.DATA_SOURCE_RULES", dict(registry.DATA_SOURCE_RULES))

    def first_char(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str[:1] == ground_truth)

    registry.register_rule("first_char", first_char, data_sources=("toy/task",))
    assert build_reward_fn("first_char")("x", "7 apples", "7") == 1.0
    assert build_reward_fn("auto")("toy/task", "8", "7") == 0.0
    assert "first_char" in registry.reward_fn_names()
    with pytest.raises(ValueError, match="reserved"):
        registry.register_rule("auto", first_char)


def write_reward_file(tmp_path, body):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_custom_float_and_dict_returns(tmp_path):
    path = write_reward_file(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return float(solution_str == ground_truth)

        def with_extras(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
            return {"score": 1.0 + bonus, "acc": solution_str == ground_truth, "len": len(solution_str)}
        """,
    )
    fn = build_reward_fn("custom", custom_path=path)
    scores, extras = score_batch(fn, ["a", "b"], ["x", "y"], ["x", "z"], [None, {"k": 1}])
    assert scores == [1.0, 0.0] and extras == {}
    fn = load_custom_reward_fn(path, "with_extras", {"bonus": 0.5})
    scores, extras = score_batch(fn, ["a", "b"], ["x", "yy"], ["x", "z"], None)
    assert scores == [1.5, 1.5]
    assert extras == {"acc": [1.0, 0.0], "len": [1.0, 2.0]}


def test_custom_loading_errors_name_the_keys(tmp_path):
    with pytest.raises(FileNotFoundError, match="reward.custom_reward_function.path='.*missing.py'"):
        load_custom_reward_fn(str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="reward.custom_reward_function.path"):
        build_reward_fn("custom")
    path = write_reward_file(
        tmp_path, "def other(data_source, solution_str, ground_truth, extra_info=None):\n    return 0\n"
    )
    with pytest.raises(
        AttributeError, match=r"no 'compute_score'.*\['other'\].*reward.custom_reward_function.name"
    ):
        load_custom_reward_fn(path)
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ImportError, match="broken.py"):
        load_custom_reward_fn(str(broken))


def test_raising_and_bad_values_are_reported(tmp_path):
    path = write_reward_file(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "boom":
                raise ZeroDivisionError("bad sample")
            if solution_str == "nan":
                return float("nan")
            if solution_str == "str":
                return "1.0"
            if solution_str == "nodict":
                return {"acc": 1.0}
            return 1.0
        """,
    )
    fn = load_custom_reward_fn(path)
    with pytest.raises(RuntimeError) as err:
        score_batch(fn, ["a", "src/b"], ["ok", "boom"], ["", ""], None)
    msg = str(err.value)
    assert "sample 1" in msg and "'src/b'" in msg and "my_reward.py" in msg and "ZeroDivisionError" in msg
    with pytest.raises(ValueError, match=r"score=nan .*sample 0.*finite number"):
        score_batch(fn, ["a"], ["nan"], [""], None)
    with pytest.raises(ValueError, match=r"score='1.0' \(str\)"):
        score_batch(fn, ["a"], ["str"], [""], None)
    with pytest.raises(ValueError, match="without 'score'"):
        score_batch(fn, ["a"], ["nodict"], [""], None)
    with pytest.raises(ValueError, match="one entry per sample"):
        score_batch(fn, ["a"], ["x", "y"], ["", ""], None)


def test_scalar_types_and_inconsistent_extras():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        values = {"np": np.float32(0.5), "t": torch.tensor(0.25), "b": True, "inf": math.inf}
        return values[solution_str]

    assert score_batch(fn, ["s"] * 3, ["np", "t", "b"], [""] * 3)[0] == [0.5, 0.25, 1.0]
    with pytest.raises(ValueError, match="score=inf"):
        score_batch(fn, ["s"], ["inf"], [""])

    def uneven(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1.0, "a": 1.0} if solution_str == "0" else {"score": 1.0}

    with pytest.raises(ValueError, match="extra keys .* for sample 1"):
        score_batch(uneven, ["s", "s"], ["0", "1"], ["", ""])


def test_a_rule_name_or_data_source_taken_by_another_function_is_refused(monkeypatch):
    monkeypatch.setattr("megatron_rl.rewards.registry.RULES", dict(registry.RULES))
    monkeypatch.setattr("megatron_rl.rewards.registry.DATA_SOURCE_RULES", dict(registry.DATA_SOURCE_RULES))

    def mine(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0

    with pytest.raises(ValueError, match="reward rule 'gsm8k' is already registered"):
        registry.register_rule("gsm8k", mine)
    with pytest.raises(ValueError, match=r"data_source\(s\) \{'openai/gsm8k': 'gsm8k'\} already map"):
        registry.register_rule("mine", mine, data_sources=("openai/gsm8k",))
    assert "mine" not in registry.RULES  # a refused registration leaves nothing behind
    registry.register_rule("mine", mine, data_sources=("toy/mine",))
    registry.register_rule("mine", mine, data_sources=("toy/mine",))  # the same function again: a no-op
    assert registry.RULES["gsm8k"] is registry.gsm8k_reward


def test_auto_with_a_custom_path_uses_the_custom_function(tmp_path):
    path = write_reward_file(
        tmp_path,
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.25\n",
    )
    assert (
        build_reward_fn("auto", custom_path=path)("openai/gsm8k", "#### 3", "3") == 0.25
    )  # not the gsm8k rule


def test_built_in_tasks_register_only_when_asked():
    import subprocess
    import sys

    code = (
        "import megatron_rl.tasks as t, megatron_rl.rewards.registry as r\n"
        "assert 'builtin' not in r.RULES and 'megatron_rl/last_digit' not in r.DATA_SOURCE_RULES\n"
        "t.register_builtin_tasks(); t.register_builtin_tasks()\n"
        "assert r.RULES['builtin'] is t.last_digit.compute_score\n"
        "assert r.DATA_SOURCE_RULES['megatron_rl/last_digit'] == 'builtin'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
