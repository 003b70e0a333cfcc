"""Hardware reference numbers every throughput figure is measured against (one H200, the GPU of the
benchmarks): MFU divides by the dense bf16 rate, the roofline's decode term by the HBM bandwidth.

Model facts (parameter counts, padded vocab, KV bytes per token, where config.json lives) are methods and
functions of ``models.args``; this module holds only what is not a property of the model.
"""

from __future__ import annotations

PEAK_BF16_FLOPS = 790e12  # H200 dense bf16 matmul, measured on random data (vendor: ~990)
PEAK_HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e, the datasheet figure the decode floors use
H100_HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3 (datasheet); its dense bf16 rate is taken as the H200's


def hbm_bytes_per_s(device_name: str) -> float:
    """The HBM bandwidth the roofline of a run on this GPU uses: the H100 SXM's where the name says H100
    (the H100 80GB HBM3 the device machines lend; PCIe and NVL parts differ), else the H200's (the GPU of
    the targets)."""
    return H100_HBM_BYTES_PER_S if "H100" in device_name else PEAK_HBM_BYTES_PER_S


def roofline_step_s(
    n_matmul: int, trained_tokens: float, prompt_tokens: float, decode_bytes: float,
    hbm_bytes_per_s: float = PEAK_HBM_BYTES_PER_S, flops_per_s: float = PEAK_BF16_FLOPS,
) -> dict:  # fmt: skip
    """The roofline step time of one RL step and its terms, in seconds:
    (6N per trained token + 2N per prefilled prompt token) / ``flops_per_s`` + decode bytes (weights and
    the live KV cache read once per decode step, summed over the steps) / ``hbm_bytes_per_s`` (the H200's
    rates unless others are given: another card's, or what a machine was measured to sustain)."""
    update_s = 6 * n_matmul * trained_tokens / flops_per_s
    prefill_s = 2 * n_matmul * prompt_tokens / flops_per_s
    decode_s = decode_bytes / hbm_bytes_per_s
    return {"update_s": update_s, "prefill_s": prefill_s, "decode_s": decode_s,
            "total_s": update_s + prefill_s + decode_s}  # fmt: skip
