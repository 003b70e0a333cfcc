"""The TRL baseline of issue 8: ``trl.GRPOTrainer`` (``use_vllm=False``) on the workload of
``bench_rl_step.py`` — same random-weight model directory, same 256-token prompts, 8 samples per prompt,
64 prompts (512 completions) per optimizer step, 512 new tokens every time (``min_new_tokens`` keeps EOS
from being sampled), bf16, a random reward, one optimizer step per rollout (``steps_per_generation`` =
``gradient_accumulation_steps``, ``num_iterations=1``), no gradient checkpointing (``--gradient-checkpointing`` turns it on).

Step time is measured between ``on_step_begin`` and ``on_step_end`` (device synchronised); the first
step is warm-up and excluded from the median. Generation (``_generate``) and rollout
(``_generate_and_score_completions``: generation, rewards, old/ref log-probs) are timed by wrapping the
trainer's methods on the instance; the update is the rest of the step. Writes ``--out`` (JSON).

``--lengths spread`` (issue 16): no ``min_new_tokens``; EOS is forced at the lengths ``bench_rl_step.py
--lengths spread`` uses (``spread_lengths.ForcedEosProcessor`` handed to each ``generate`` call), and
tokens per step count the real completions.

Needs ``trl`` and ``datasets`` (carried as wheels to the GPU box, see run_all.sh).

    python benchmarks/bench_trl_grpo.py --out $OUT/trl_grpo.json
    accelerate launch --num_processes 2 benchmarks/bench_trl_grpo.py --out $OUT/trl2.json   # two GPUs
    python benchmarks/bench_trl_grpo.py --tiny --prompts 4 --n 2 --prompt-len 16 --response-len 8  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rl_step import SHAPES, prepare, prompts  # noqa: E402


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_reward(completions, **_) -> list[float]:
    return [random.random() for _ in completions]


class Phases:
    """Seconds spent in wrapped trainer methods since the last ``take()``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, fn):
        def wrapped(*args, **kwargs):
            _sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            return out

        return wrapped

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


def step_timer(phases: Phases, rows: list[dict], save=None):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            _sync()
            phases.take()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync()
            seconds = time.perf_counter() - self.t0
            rows.append({"step": state.global_step, "step_s": seconds, "phases": phases.take()})
            if save is not None:
                save()

    return StepTimer()


def run(a: argparse.Namespace) -> dict:
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    seqs = a.prompts * a.n
    if seqs % (a.micro * world):
        raise SystemExit(f"--prompts x --n = {seqs} must be a multiple of --micro x GPUs = {a.micro * world}")
    accum = seqs // (a.micro * world)
    cuda = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=a.output_dir,
        per_device_train_batch_size=a.micro,
        gradient_accumulation_steps=accum,
        steps_per_generation=accum,  # one generation of prompts x n completions per optimizer step
        num_iterations=1,
        num_generations=a.n,
        max_completion_length=a.response_len,
        # fixed: EOS never sampled, fixed work per step; spread: EOS forced by force_lengths below
        generation_kwargs={"min_new_tokens": a.response_len} if a.lengths == "fixed" else None,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=a.kl_coef,
        learning_rate=1e-6,
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=a.gradient_checkpointing,
        use_vllm=False,
        max_steps=a.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        log_completions=False,
        dataloader_num_workers=0,
        seed=0,
        model_init_kwargs={"dtype": torch.bfloat16 if cuda else torch.float32},
    )
    train = datasets.Dataset.from_dict({"prompt": prompts(a.prompts * (a.steps + 1), a.prompt_len, seed=1)})
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    tok.padding_side = "left"
    trainer = GRPOTrainer(
        model=a.model_dir,
        reward_funcs=random_reward,
        args=config,
        train_dataset=train,
        processing_class=tok,
    )
    tokens = [seqs * (a.prompt_len + a.response_len)] * (a.steps + 1)
    if a.lengths == "spread":
        tokens = force_lengths(trainer, a, tok.eos_token_id, world)
    phases, rows, logs = Phases(), [], []
    trainer._generate = phases.wrap("gen", trainer._generate)
    trainer._generate_and_score_completions = phases.wrap("rollout", trainer._generate_and_score_completions)
    meta = {
        "workload": {
            "prompts": a.prompts,
            "n": a.n,
            "prompt_len": a.prompt_len,
            "response_len": a.response_len,
            "micro_batch_per_gpu": a.micro,
            "gradient_accumulation_steps": accum,
            "kl_coef": a.kl_coef,
            "lengths": a.lengths,
            "model": f"{a.shape} shape, random {'fp32' if a.shape == 'tiny' else 'bf16'}",
            "gradient_checkpointing": a.gradient_checkpointing,
        },
        "versions": {
            "trl": trl.__version__,
            "datasets": datasets.__version__,
            "transformers": transformers.__version__,
        },
        "world_size": world,
        "tokens_per_step": tokens[: a.steps],
    }
    save = partial(write_report, a.out, meta, rows, logs) if int(os.environ.get("RANK", "0")) == 0 else None
    trainer.add_callback(step_timer(phases, rows, save))  # a result after every step: a timeout keeps them
    trainer.add_callback(_log_collector(logs))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    return report(meta, rows, logs)


def force_lengths(trainer, a: argparse.Namespace, eos: int, world: int) -> list[int]:
    """Make every ``generate`` call of ``trainer`` stop its rows at the spread lengths (call k: step k's
    prompts x n, this process's share); returns the real prompt + completion tokens of each step."""
    from spread_lengths import ForcedEosProcessor, length_table
    from transformers import LogitsProcessorList

    table = length_table(a.steps + 1, a.prompts, a.n, a.response_len)
    rank = int(os.environ.get("RANK", "0"))
    seqs = a.prompts * a.n
    mine = table.view(a.steps + 1, world, seqs // world)[:, rank].reshape(-1)  # this process's rows
    proc = ForcedEosProcessor(mine, eos)
    model = trainer.model
    generate = model.generate

    def forced_generate(*args, **kwargs):
        proc.new_call(kwargs.get("input_ids", args[0] if args else None))
        return generate(*args, **kwargs, logits_processor=LogitsProcessorList([proc]))

    model.generate = forced_generate
    per_step = table.view(a.steps + 1, seqs).sum(1) + seqs * a.prompt_len
    return [int(x) for x in per_step]


def report(meta: dict, rows: list[dict], logs: list[dict]) -> dict:
    """Per-step rows with the phase split, and medians over the steps after the first."""
    import torch

    for i, r in enumerate(rows):
        gen, rollout = r["phases"].get("gen", 0.0), r["phases"].get("rollout", 0.0)
        r["timing_s"] = {"gen": gen, "score_and_logprobs": rollout - gen, "update": r["step_s"] - rollout}
        r["tok_per_s_per_gpu"] = meta["tokens_per_step"][i] / r["step_s"] / meta["world_size"]
    timed = rows[1:] or rows
    lengths = [entry[k] for entry in logs for k in entry if k.endswith("completions/mean_length")]
    return meta | {
        "completion_mean_length_logged": lengths,
        "steps": rows,
        "median_after_warmup": {
            "step_s": statistics.median(r["step_s"] for r in timed),
            "tok_per_s_per_gpu": statistics.median(r["tok_per_s_per_gpu"] for r in timed),
            "timing_s": {k: statistics.median(r["timing_s"][k] for r in timed) for k in timed[0]["timing_s"]},
        },
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30
        if torch.cuda.is_available()
        else None,
    }


def write_report(path: str, meta: dict, rows: list[dict], logs: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report(meta, rows, logs), indent=2))


def _log_collector(logs: list[dict]):
    from transformers import TrainerCallback

    class Collect(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                store.append(dict(logs))

    store = logs
    return Collect()


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--micro", type=int, default=16, help="per_device_train_batch_size (completions)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps; the first is warm-up")
    p.add_argument("--kl-coef", type=float, default=0.0, help="GRPOConfig.beta (0: no reference model)")
    p.add_argument(
        "--shape", default="qwen2.5-0.5b", choices=[*SHAPES, "tiny"], help="model shape, random weights"
    )
    p.add_argument("--tiny", action="store_true", help="= --shape tiny: CPU smoke")
    p.add_argument("--gradient-checkpointing", action="store_true", help="GRPOConfig.gradient_checkpointing")
    p.add_argument("--lengths", choices=["fixed", "spread"], default="fixed",
                   help="fixed: min_new_tokens = the cap; spread: EOS forced at bench_rl_step's spread lengths")  # fmt: skip
    p.add_argument("--model-dir", default=None)
    p.add_argument("--output-dir", default="/tmp/bench_trl_grpo")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_trl_grpo.json"))
    a = p.parse_args(argv)
    a.shape = "tiny" if a.tiny else a.shape
    tag = a.shape.replace(".", "_").replace("-", "_")
    a.model_dir = a.model_dir or f"/tmp/bench_{tag}_random"
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        prepare(
            a.model_dir,
            f"/tmp/bench_{a.shape.replace('.', '_').replace('-', '_')}_prompts{a.prompt_len}",
            a.shape,
            512,
            a.prompt_len,
        )
    else:
        while not (Path(a.model_dir) / "tokenizer_config.json").is_file():
            time.sleep(1)
    result = run(a)
    if rank == 0:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2))
        m = result["median_after_warmup"]
        print(
            f"trl grpo: {m['step_s']:.2f} s/step, {m['tok_per_s_per_gpu']:.0f} tok/s/GPU, "
            f"phases {json.dumps(m['timing_s'])}, completion lengths {result['completion_mean_length_logged']}",
            flush=True,
        )
    return result


if __name__ == "__main__":
    main()
