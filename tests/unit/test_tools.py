"""Tools of multi-turn rollouts: loading a tool file, the hermes parser and its registry, the calculator's
safe evaluation, and the executor's concurrency, timeouts and error answers."""

import threading
import time
from pathlib import Path

import pytest

from megatron_rl.config.schema import MultiTurnConfig
from megatron_rl.data import build_char_tokenizer
from megatron_rl.rollout import calculator
from megatron_rl.rollout.multi_turn import TurnRenderer
from megatron_rl.rollout.tool_parsers import ToolCall, get_parser, parse_hermes, register_parser
from megatron_rl.rollout.tools import TOOL_SETS, Tool, ToolExecutor, load_tool_set

TOOL_FILE = """
from megatron_rl.rollout.tools import Interaction, Tool


class Lookup(Tool):
    name = "lookup"
    schema = {"type": "function", "function": {"name": "lookup", "description": "the secret",
              "parameters": {"type": "object", "properties": {}}}}

    def call(self, args, state):
        return str(state["ground_truth"]), 0.1, False


class Nudge(Interaction):
    def respond(self, turn_text, state):
        return ("try again", 0.0, False) if state["turn"] < 2 else (None, 0.0, True)


def get_tools():
    return [Lookup()]


def get_interaction():
    return Nudge()
"""


def test_a_tool_file_loads_with_its_interaction(tmp_path):
    f = tmp_path / "my_tools.py"
    f.write_text(TOOL_FILE)
    ts = load_tool_set(str(f))
    assert list(ts.tools) == ["lookup"] and ts.schemas[0]["function"]["name"] == "lookup"
    assert ts.tools["lookup"].call({}, {"ground_truth": 42}) == ("42", 0.1, False)
    assert ts.interaction.respond("x", {"turn": 1}) == ("try again", 0.0, False)
    assert "calculator" in TOOL_SETS and list(load_tool_set("calculator").tools) == ["calculate"]


@pytest.mark.parametrize(
    "text, match",
    [
        (None, "rollout.multi_turn.tool_path"),
        ("x = 1\n", "defines no get_tools"),
        ("def get_tools():\n    return []\n", "non-empty list of Tool"),
        (
            "from megatron_rl.rollout.tools import Tool\nclass T(Tool):\n    name = 't'\n"
            "def get_tools():\n    return [T()]\n",
            "needs `schema`",
        ),
        ("raise RuntimeError('boom')\n", "importing rollout.multi_turn.tool_path.*boom"),
    ],
)
def test_bad_tool_files_fail_with_the_key_and_the_fix(tmp_path, text, match):
    path = None
    if text is not None:
        path = tmp_path / "t.py"
        path.write_text(text)
    with pytest.raises((ValueError, TypeError, AttributeError, ImportError), match=match):
        load_tool_set(str(path) if path else None)
    with pytest.raises(FileNotFoundError, match="neither a file nor a built-in tool set"):
        load_tool_set(str(tmp_path / "missing.py"))


def test_hermes_parser_reads_calls_and_reports_malformed_ones():
    text = (
        'I will compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "2*3"}}\n</tool_call>'
        '<tool_call>{"name": "calculate", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
    )
    calls = parse_hermes(text)
    assert calls[0] == ToolCall("calculate", {"expression": "2*3"})
    assert calls[1] == ToolCall("calculate", {"expression": "1"})
    assert "not valid JSON" in calls[2].error and "needs" in calls[3].error
    assert parse_hermes("no call here") == [] and get_parser("hermes") is parse_hermes
    with pytest.raises(ValueError, match="already registered"):
        register_parser("hermes", parse_hermes)
    with pytest.raises(ValueError, match="rollout.multi_turn.parser='nope'"):
        get_parser("nope")


def test_calculator_evaluates_arithmetic_and_refuses_code():
    calc = calculator.Calculator()
    assert calc.call({"expression": "(48 / 2) * 3 - 2**3 % 5"}, {}) == ("69", 0.0, False)
    assert calc.call({"expression": "7 / 2"}, {})[0] == "3.5"
    for bad, why in [
        ("__import__('os').system('true')", "not Call"),
        ("().__class__", "not Attribute"),
        ("x + 1", "not Name"),
        ("9**9**9", "exponent"),
        ("1/0", "division by zero"),
        ("2 +", "not an arithmetic expression"),
    ]:
        text, reward, done = calc.call({"expression": bad}, {})
        assert text.startswith("Error:") and why in text and (reward, done) == (0.0, False)
    assert calc.call({"expr": "1"}, {})[0].startswith("Error: calculate needs")


class Slow(Tool):
    name = "slow"
    schema = {"type": "function", "function": {"name": "slow"}}

    def __init__(self):
        self.running, self.peak, self.lock = 0, 0, threading.Lock()

    def call(self, args, state):
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(args["s"])
        with self.lock:
            self.running -= 1
        if args.get("raise"):
            raise KeyError("bad key")
        return "done", 1.0, True


def test_executor_runs_calls_concurrently_with_a_timeout_and_error_answers():
    tool = Slow()
    ex = ToolExecutor({"slow": tool}, timeout_s=0.5, max_workers=3)
    calls = [(ToolCall("slow", {"s": 0.2}), {}) for _ in range(3)]
    calls += [
        (ToolCall("slow", {"s": 0.0, "raise": True}), {}),
        (ToolCall("slow", {"s": 3.0}), {}),  # runs past the timeout
        (ToolCall("other", {}), {}),
        (ToolCall("", error="tool call is not valid JSON"), {}),
    ]
    t0 = time.monotonic()
    out = ex.run(calls)
    took = time.monotonic() - t0
    assert [r.status for r in out] == ["ok"] * 3 + ["error", "timeout", "error", "error"]
    assert out[0].text == "done" and out[0].reward == 1.0 and out[0].done
    assert "raised KeyError" in out[3].text and "timed out after 0.5 s" in out[4].text
    assert "unknown tool 'other'" in out[5].text and "not valid JSON" in out[6].text
    assert tool.peak == 3 and took < 1.5  # three at once; the slow call was abandoned at its timeout
    ex.close()


def test_the_readme_tool_example_is_the_shipped_file_and_it_works():
    repo = Path(__file__).resolve().parents[2]
    code = (repo / "examples/tools/lookup_tool.py").read_text()
    body = code[code.index("from megatron_rl.rollout.tools") :].strip()
    assert body in (repo / "README.md").read_text()
    ts = load_tool_set(str(repo / "examples/tools/lookup_tool.py"))
    state = {"turn": 1}
    assert ts.tools["convert_units"].call({"value": 2, "from_unit": "km", "to_unit": "m"}, state) == (
        "2000 m",
        0.0,
        False,
    )
    assert state["conversions"] == 1
    assert ts.interaction.respond("so #### 4", state) == (None, 0.0, True)
    assert ts.interaction.respond("so 4", state)[0].startswith("Please end")


def test_multi_turn_config_rejects_bad_values():
    with pytest.raises(ValueError, match="rollout.multi_turn.max_turns=0"):
        MultiTurnConfig(max_turns=0)
    with pytest.raises(ValueError, match="rollout.multi_turn.tool_timeout_s"):
        MultiTurnConfig(tool_timeout_s=0)


# Qwen2.5's way of rendering tool answers (a user turn of <tool_response> blocks), on the char tokenizer
QWEN_LIKE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_turn_renderer_appends_what_the_template_writes_after_the_model_stopped():
    tok = build_char_tokenizer(chat_template=QWEN_LIKE)
    r = TurnRenderer(tok, None)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    two = [{"role": "tool", "content": "4"}, {"role": "tool", "content": "9"}]
    # the model produced <|im_end|>: the template's "\n" after it is still owed
    assert r.text(two, im_end) == (
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n9\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    # the turn ended elsewhere (e.g. at </tool_call>): the whole closing is appended
    assert r.text([{"role": "user", "content": "go on"}], tok.convert_tokens_to_ids("x")) == (
        "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    )
    assert r.ids(two, im_end) == tok(r.text(two, im_end), add_special_tokens=False)["input_ids"]
    # memoised: the same answer again, a caller's edit of the list it got does not leak into the next
    # call, and another stop token or message is another entry
    got = r.ids(two, im_end)
    got.append(-1)
    assert r.ids(two, im_end) == tok(r.text(two, im_end), add_special_tokens=False)["input_ids"]
    assert r.ids(two, None) == tok(r.text(two, None), add_special_tokens=False)["input_ids"] != got[:-1]
    assert r.ids(two[:1], im_end) == tok(r.text(two[:1], im_end), add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="chat template"):
        TurnRenderer(build_char_tokenizer(chat_template=None), None)


def test_builtin_tool_task_pieces(tmp_path):
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.rollout.multi_turn import build_multi_turn
    from megatron_rl.tasks import register_builtin_tasks
    from megatron_rl.tasks import secret_digit as task

    register_builtin_tasks()

    model_dir, train, val = task.prepare_tool_task(ModelConfig(), tmp_path, seed=0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    mt = build_multi_turn(MultiTurnConfig(enable=True, tool_path=task.TOOL_SET, parser="secret_call"), tok)
    assert mt.turn_stop_ids == (tok.convert_tokens_to_ids("?"),)  # a turn ends at the call marker
    state = {"extra_info": {"prompt": "123"}}
    assert mt.tool_set.tools["secret"].call({}, state) == (
        task.secret("123"),
        0.0,
        False,
    )  # no credit for calling
    assert mt.parser("?") == [ToolCall("secret", {})] and mt.parser("7") == []
    answer = mt.renderer.text([{"role": "tool", "content": "7"}], tok.convert_tokens_to_ids("?"))
    solved = "?" + tok.decode(tok(answer)["input_ids"], skip_special_tokens=True) + "7"
    assert task.compute_score("", solved, "7") == 1.0 and task.compute_score("", solved, "3") == 0.0
    assert task.compute_score("", "7", "7") == 0.0  # a right guess without the tool earns nothing
    assert solved == "?t7a7"  # one-letter roles: the tool's digit is 3 tokens before the answer
    assert task.compute_score("", solved.replace("t7a", "t3a"), "7") == 0.0  # nor a final that ignores it
    assert task.compute_score("", "x?" + solved[1:] + "3?", "7") == 1.0  # only the final turn's start counts
    assert task.compute_score("", "t7a7", "7") == 0.0  # the tool's message written by the model is no call
    assert task.compute_score("", "?\nt7a\n7", "7") == 1.0  # newlines the model writes are stripped
    # validation prompts never occur in training, so a policy that never calls cannot memorise the hash
    import pyarrow.parquet as pq

    seen = set(pq.read_table(train).column("prompt").to_pylist())
    assert seen.isdisjoint(pq.read_table(val).column("prompt").to_pylist())
    mt.close()
