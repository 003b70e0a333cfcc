"""Synthetic GSM8K-format data and a Qwen-vocab-sized tokenizer made in code (the GPU box has no network).

Writes ``<data-dir>/{train,test}.parquet`` in verl's format (chat prompt with GSM8K's instruction,
``reward_model.ground_truth``) and saves a char-level tokenizer with 151936 ids and a Qwen-style chat
template into ``<model-dir>`` next to the random-weight model.
"""

from __future__ import annotations

import argparse
import random
import string
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = sorted(set(string.printable))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    vocab.update({f"<|x{i}|>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
        chat_template=TEMPLATE,
    )


def rows(n: int, seed: int, split: str) -> pa.Table:
    rng = random.Random(seed)
    prompts, truths = [], []
    for _ in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        q = f"Tom has {a} apples and buys {b} bags with {c} apples each. How many apples does Tom have now?"
        prompts.append([{"role": "user", "content": q + " " + INSTRUCTION}])
        truths.append(str(a + b * c))
    return pa.table(
        {
            "data_source": ["openai/gsm8k"] * n,
            "prompt": prompts,
            "ability": ["math"] * n,
            "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
            "extra_info": [{"split": split, "index": i} for i in range(n)],
        }
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--vocab-size", type=int, default=151936)
    a = p.parse_args()
    tokenizer(a.vocab_size).save_pretrained(a.model_dir)
    Path(a.data_dir).mkdir(parents=True, exist_ok=True)
    pq.write_table(rows(2048, 0, "train"), Path(a.data_dir) / "train.parquet")
    pq.write_table(rows(128, 1, "test"), Path(a.data_dir) / "test.parquet")
