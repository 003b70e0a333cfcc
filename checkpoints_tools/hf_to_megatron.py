"""Convert an HF checkpoint (Llama / Mistral / Qwen2 / Qwen3, safetensors) to a Megatron checkpoint.

    python checkpoints_tools/hf_to_megatron.py --hf-path DIR --output DIR [--tp N --pp M] \
        [--format torch_dist|legacy]

torch_dist (megatron-core dist_checkpointing) loads at any TP/PP; run under torchrun with a world that is a
multiple of TP x PP to convert big models sharded (one process converts at TP=PP=1). legacy writes the
Megatron-LM ``iter_0000001/mp_rank_XX[_YYY]/model_optim_rng.pt`` layout for exactly --tp x --pp. The HF
config.json and tokenizer files are saved alongside (``<output>/hf``).
"""

from __future__ import annotations

import argparse
import sys

import _cli  # noqa: F401  (puts the repository on sys.path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-path", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--output", required=True, help="checkpoint root directory to write")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the written layout")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the written layout")
    p.add_argument("--format", choices=("torch_dist", "legacy"), default="torch_dist")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)

    def convert():
        from megatron_rl.checkpoint.convert import hf_to_megatron

        report = hf_to_megatron(a.hf_path, a.output, tp=a.tp, pp=a.pp, fmt=a.format)
        if report is None:
            return None
        line = report.line("hf_to_megatron")
        if a.format == "torch_dist" and f"TP={a.tp} PP={a.pp}" not in report.layout:
            # one process cannot build TP x PP shards; say what was written and why it still fits
            line += (
                f"\n  --tp {a.tp} --pp {a.pp} asked for, one process wrote it at TP=1 PP=1: torch_dist is "
                f"layout-free and loads at TP={a.tp} PP={a.pp} (or any other layout); run under torchrun "
                f"with {a.tp * a.pp} processes to build it sharded"
            )
        return line

    return _cli.run("hf_to_megatron", convert)


if __name__ == "__main__":  # required: dist_checkpointing's writer starts a spawn-context Manager
    sys.exit(main())
