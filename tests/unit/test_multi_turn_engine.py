"""Multi-turn rollouts in the engine: the KV cache carries across turns, appended ids are masked, and the
trained tokens are what the model saw (compared with re-rendering the conversation)."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "workers"))
from rollout_common import hf_logprobs, hf_to_mcore, spec_of  # noqa: E402

from megatron_rl.data import build_char_tokenizer  # noqa: E402
from megatron_rl.rollout.batch import build_batch  # noqa: E402
from megatron_rl.rollout.engine import EngineConfig, RolloutEngine  # noqa: E402
from megatron_rl.rollout.multi_turn import MultiTurn, TurnRenderer  # noqa: E402
from megatron_rl.rollout.sampling import SamplingParams  # noqa: E402
from megatron_rl.rollout.tool_parsers import ToolCall  # noqa: E402
from megatron_rl.rollout.tools import Tool, ToolExecutor, ToolSet  # noqa: E402

ANSWER = "ok7"


class Echo(Tool):
    name = "echo"
    schema = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}

    def call(self, args, state):
        state["seen"] = state.get("seen", 0) + 1
        return ANSWER, 0.25, False


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (the shorter one's length if one is a
    prefix of the other), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _chat_ids(tok, messages, generation_prompt=False) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tok(text, add_special_tokens=False)["input_ids"]


def _setup(max_turns=3):
    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      initializer_range=0.1, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(cfg).eval()
    spec = spec_of(hf)
    params = hf_to_mcore(hf, spec, 1, 0, 1, 0)
    tools = ToolSet({"echo": Echo()})
    mt = MultiTurn(
        tools,
        parser=lambda text: [ToolCall("echo", {})],  # every turn calls the tool: the test needs turns
        renderer=TurnRenderer(tok, tools.schemas),
        executor=ToolExecutor(tools.tools, timeout_s=5, max_workers=2),
        max_turns=max_turns,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
    )
    return tok, hf, spec, params, mt


@pytest.mark.parametrize("sync_every", [16, 2])  # 2: slots freed and episodes moved down mid-run
def test_turns_continue_in_the_same_slot_with_exact_logprobs_and_masks(monkeypatch, sync_every):
    from megatron_rl.rollout import engine as engine_mod

    monkeypatch.setattr(engine_mod, "_SYNC_EVERY", sync_every)
    tok, hf, spec, params, mt = _setup()
    prompts = [_chat_ids(tok, [{"role": "user", "content": q}], True) for q in ("12+3", "what", "7*8=", "hi")]
    stops = tuple(tok.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz")))  # turns end soon
    sp = SamplingParams(temperature=1.0, n=2, max_new_tokens=60, stop_token_ids=stops, seed=3)
    engine = RolloutEngine(params, spec, EngineConfig(max_num_seqs=3))  # fewer slots than sequences
    session = mt.session([{"ground_truth": i} for i in range(len(prompts))])
    out = engine.generate(prompts, sp, session=session)
    appended = mt.renderer.ids([{"role": "tool", "content": ANSWER}], None)
    assert max(c.turns for c in out) >= 2
    if sync_every == 2:  # episodes in flight also moved to lower slots (engine._Runner._compact)
        assert engine.last_stats.moved_slots > 0
    for c in out:
        mask = torch.tensor(c.response_mask)
        assert len(mask) == len(c.response_ids) == len(c.logprobs) and mask[-1] == 1
        assert int((mask == 0).sum()) == (c.turns - 1) * len(appended)  # one tool answer between turns
        # a call whose answer no longer fits the response budget ran, but ended the episode ("length")
        calls = c.turns - 1 + (c.finish_reason == "length" and c.response_ids[-1] in stops)
        assert c.tool_counts == (calls, 0, 0) and abs(c.tool_reward - 0.25 * calls) < 1e-9
        # every sampled token's rollout log-prob equals a fresh forward over the whole sequence: the
        # cache after each appended prefill is exactly the sequence's
        ref = hf_logprobs(hf, c.prompt_ids, c.response_ids, 1.0)
        assert (torch.tensor(c.logprobs) - ref)[mask == 1].abs().max() < 1e-5
        assert torch.tensor(c.logprobs)[mask == 0].abs().max() == 0 if (mask == 0).any() else True
        assert c.finish_reason in ("stop", "length")
        if c.turns < mt.max_turns and c.finish_reason == "stop":
            assert c.response_ids[-1] in stops
    batch = build_batch(out, [None] * len(prompts), 0, 60, 0, torch.device("cpu"))
    gaps = [torch.tensor(c.response_mask) for c in out]
    for i, g in enumerate(gaps):
        assert torch.equal(batch.response_mask[i, : len(g)], g.float())
        assert batch.response_mask[i, len(g) :].sum() == 0
    assert batch.turns.tolist() == [c.turns for c in out]
    assert batch.tool_counts[:, 0].tolist() == [c.tool_counts[0] for c in out]


def test_trained_tokens_against_rerendering_the_conversation():
    """Re-render each episode as chat messages through the template: it agrees token for token with what
    the engine produced up to the end of the last turn; the re-render then adds the closing
    ``<|im_end|>\\n`` the model never produced (and would differ wherever re-encoding a turn's text gives
    other ids, which the char tokenizer never does)."""
    tok, _, spec, params, mt = _setup(max_turns=2)
    prompt = _chat_ids(tok, [{"role": "user", "content": "go"}], True)
    stops = tuple(tok.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz")))
    sp = SamplingParams(temperature=1.0, n=4, max_new_tokens=80, stop_token_ids=stops, seed=5)
    out = RolloutEngine(params, spec).generate([prompt], sp, session=mt.session([{}]))
    checked = 0
    for c in out:
        mask = c.response_mask
        turns, cur = [], []
        for t, m in zip(c.response_ids, mask):
            if m:
                cur.append(t)
            elif cur:
                turns.append(cur)
                cur = []
        turns.append(cur)
        messages = [{"role": "user", "content": "go"}]
        for k, ids in enumerate(turns):
            messages.append({"role": "assistant", "content": tok.decode(ids)})
            if k < len(turns) - 1:
                messages.append({"role": "tool", "content": ANSWER})
        rerendered = _chat_ids(tok, messages)
        ours = c.prompt_ids + c.response_ids
        at = first_difference(ours, rerendered)
        assert at == len(ours), (
            at,
            tok.decode(ours[at - 5 : at + 5]),
            tok.decode(rerendered[at - 5 : at + 5]),
        )
        assert tok.decode(rerendered[at:]) == "<|im_end|>\n"
        checked += len(turns) > 1
    assert checked >= 1
