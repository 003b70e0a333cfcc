"""`megatron-rl generate` end to end on a tiny HF model: greedy output equals transformers' greedy."""

import json
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM

from megatron_rl.data import build_char_tokenizer
from megatron_rl.models.shapes import TINY
from tests.distributed.launch import cpu_env


def test_generate_cli_greedy_matches_transformers(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_char_tokenizer("0123456789=+ abc")
    torch.manual_seed(0)
    shape = dict(TINY, vocab_size=len(tok), num_hidden_layers=2, max_position_embeddings=32768)
    cfg = Qwen2Config(**shape, tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
    model_dir = tmp_path / "m"
    Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    prompts = ["12+3=", "abc", "7"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl.cli",
            "generate",
            f"model.path={model_dir}",
            f"generate.prompts={tmp_path / 'p.jsonl'}",
            f"generate.output={out}",
            "generate.max_new_tokens=6",  # no generate.n / temperature: the defaults are 1 and greedy
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        env=cpu_env(),
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [
        r["prompt"] for r in rows
    ] == prompts  # one completion each, not the training preset's rollout.n=8
    assert not (tmp_path / "outputs").exists()  # trainer.output_dir given: Hydra writes into it, not outputs/
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for row in rows:
        ids = torch.tensor([tok(row["prompt"])["input_ids"]])
        ref = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id)[
            0, ids.shape[1] :
        ]
        assert row["response_ids"] == ref.tolist()[: len(row["response_ids"])]
        assert set(row) >= {"prompt", "response", "response_ids", "logprobs", "finish_reason"}
        assert len(row["logprobs"]) == len(row["response_ids"])


def test_generate_cli_names_missing_keys(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "generate"],
        capture_output=True,
        text=True,
        env=cpu_env(),
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "model.path" in proc.stderr and "generate.prompts" in proc.stderr
