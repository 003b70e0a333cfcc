"""Convert a Megatron checkpoint (torch_dist or legacy Megatron-LM, auto-detected) to an HF directory.

    python checkpoints_tools/megatron_to_hf.py --checkpoint DIR --output DIR [--hf-config DIR]

Writes config.json, safetensors (vocab padding removed) and the tokenizer files, loadable with
``transformers.AutoModelForCausalLM.from_pretrained``. A LoRA training checkpoint (adapters only) gives a
PEFT adapter folder (adapter_config.json + adapter_model.safetensors) for the base model it names, which
``peft.PeftModel.from_pretrained`` loads, or with --merged the full model with the adapters merged in. --hf-config is only needed for checkpoints not
written by hf_to_megatron (they lack ``megatron_rl_model.json`` and ``hf/config.json``).
"""

from __future__ import annotations

import argparse
import sys

import _cli  # noqa: F401  (puts the repository on sys.path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint root (or iteration directory)")
    p.add_argument("--output", required=True, help="HF directory to write")
    p.add_argument("--hf-config", default=None, help="HF directory or config.json describing the model")
    p.add_argument("--tp", type=int, default=1, help="TP used to read a torch_dist checkpoint under torchrun")
    p.add_argument("--pp", type=int, default=1, help="PP used to read a torch_dist checkpoint under torchrun")
    p.add_argument(
        "--merged",
        action="store_true",
        help="LoRA training checkpoint: write the full model with the adapters merged (default: a PEFT adapter folder)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)

    def convert():
        from megatron_rl.checkpoint.convert import megatron_to_hf

        report = megatron_to_hf(
            a.checkpoint, a.output, hf_config=a.hf_config, tp=a.tp, pp=a.pp, merged=a.merged
        )
        return report.line("megatron_to_hf") if report else None

    return _cli.run("megatron_to_hf", convert)


if __name__ == "__main__":  # required: dist_checkpointing starts a spawn-context Manager
    sys.exit(main())
