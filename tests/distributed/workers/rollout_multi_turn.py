"""torchrun worker (world 2, TP=2): multi-turn rollouts where the two generating ranks must agree.

The tool answers with text that differs per rank and per call (rank, a process-local counter), so the
ranks agree only if the tool runs on the generation group's source rank and its answer is broadcast:
- both ranks return identical completions (ids, masks, turn counts, tool rewards);
- the tool ran on rank 0 only;
- sampled tokens' rollout log-probs equal a teacher-forced HF forward over the whole multi-turn sequence.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(__file__))
from rollout_common import hf_logprobs, hf_to_mcore, spec_of  # noqa: E402

from megatron_rl.data import build_char_tokenizer  # noqa: E402
from megatron_rl.distributed import init_distributed  # noqa: E402
from megatron_rl.rollout.engine import EngineConfig, RolloutEngine  # noqa: E402
from megatron_rl.rollout.multi_turn import MultiTurn, TurnRenderer  # noqa: E402
from megatron_rl.rollout.sampling import SamplingParams  # noqa: E402
from megatron_rl.rollout.tool_parsers import ToolCall  # noqa: E402
from megatron_rl.rollout.tools import Tool, ToolExecutor, ToolSet  # noqa: E402


class RankTool(Tool):
    name = "where"
    schema = {"type": "function", "function": {"name": "where", "parameters": {"type": "object"}}}

    def __init__(self):
        self.calls = 0

    def call(self, args, state):
        self.calls += 1
        return f"r{dist.get_rank()}c{self.calls}", 0.5, False


def main():
    init_distributed(2, 1, seed=0)
    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      initializer_range=0.1, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(cfg).eval()
    spec = spec_of(hf, tp=2)
    params = hf_to_mcore(hf, spec, 2, dist.get_rank(), 1, 0)
    tool = RankTool()
    tools = ToolSet({"where": tool})
    mt = MultiTurn(tools, parser=lambda text: [ToolCall("where", {})], renderer=TurnRenderer(tok, tools.schemas),
                   executor=ToolExecutor(tools.tools, 5.0, 2), max_turns=3,
                   decode=lambda ids: tok.decode(ids, skip_special_tokens=True))  # fmt: skip
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    stops = tuple(tok.convert_tokens_to_ids(list("abcdefghijklmnopqrstuvwxyz")))
    sp = SamplingParams(temperature=1.0, n=4, max_new_tokens=48, stop_token_ids=stops, seed=1)
    out = RolloutEngine(params, spec, EngineConfig(max_num_seqs=2)).generate(
        [prompt], sp, session=mt.session([{}])
    )
    assert max(c.turns for c in out) >= 2, [c.turns for c in out]
    mine = [(c.response_ids, c.response_mask, c.turns, c.tool_reward, c.tool_counts) for c in out]
    both: list = [None, None]
    dist.all_gather_object(both, mine)
    assert both[0] == both[1], "the TP ranks disagree on a multi-turn rollout"
    ran: list = [None, None]
    dist.all_gather_object(ran, tool.calls)
    assert ran[0] > 0 and ran[1] == 0, f"the tool ran {ran} times on ranks 0, 1; it must run on rank 0 only"
    for c in out:
        mask = torch.tensor(c.response_mask) == 1
        ref = hf_logprobs(hf, c.prompt_ids, c.response_ids, 1.0)
        err = (torch.tensor(c.logprobs) - ref)[mask].abs().max().item()
        assert err < 1e-5, f"multi-turn rollout log-probs at TP=2 off by {err}"
    if dist.get_rank() == 0:
        print(f"ok multi_turn TP=2 turns={[c.turns for c in out]}", flush=True)
    mt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
