"""torchrun worker (world 2, DP=2): ``generate_from_config`` from an HF directory with a tokenizer.

Checks: one output row per prompt x sample in prompt order on every rank, text = decoded ids, greedy ids
equal HF greedy (stopping at EOS), the chat template is applied, and rank 0 wrote the JSONL.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch.distributed as dist
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(__file__))
from rollout_common import EOS, VOCAB, hf_greedy, tiny_hf  # noqa: E402

from megatron_rl.apps.generate_job import encode_prompts, generate_from_config, read_prompts  # noqa: E402
from megatron_rl.config.schema import RolloutConfig  # noqa: E402


def word_tokenizer():
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"w{EOS}", pad_token="w0")
    fast.chat_template = "{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}w4"
    return fast


def main():
    dist.init_process_group("gloo")
    hf, tokenizer = tiny_hf("qwen2"), word_tokenizer()
    prompts = [" ".join(f"w{(7 * i + j) % 300 + 5}" for j in range(i % 6 + 1)) for i in range(5)]
    with tempfile.TemporaryDirectory() as tmp:
        root = [tmp]
        dist.broadcast_object_list(root, src=0)
        model_dir, prompt_file, out_file = (os.path.join(root[0], n) for n in ("model", "p.jsonl", "o.jsonl"))
        if dist.get_rank() == 0:
            hf.save_pretrained(model_dir)
            with open(prompt_file, "w") as f:
                f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
        dist.barrier()
        rows = generate_from_config(
            model_dir,
            read_prompts(prompt_file),
            RolloutConfig(temperature=0, max_new_tokens=6),
            tokenizer=tokenizer,
            chat_template=True,
            output=out_file,
        )
        assert [r["prompt"] for r in rows] == prompts
        for r, ids in zip(rows, encode_prompts(tokenizer, prompts, True)):
            assert r["prompt_ids"] == ids and ids[0] == 2 and ids[-1] == 4, r
            ref = hf_greedy(hf, ids, 6)
            assert r["response_ids"] == ref[: ref.index(EOS) + 1] if EOS in ref else ref
            assert r["response"] == tokenizer.decode(r["response_ids"], skip_special_tokens=True)
            assert len(r["logprobs"]) == len(r["response_ids"]) and r["finish_reason"] in ("stop", "length")
        dist.barrier()
        if dist.get_rank() == 0:
            written = [json.loads(line) for line in open(out_file)]
            assert written == rows
            print("ok generate_job", flush=True)
        dist.barrier()


if __name__ == "__main__":
    main()
