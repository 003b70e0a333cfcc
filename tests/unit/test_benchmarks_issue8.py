"""The issue-8 benchmark drivers' pure parts: the Hydra overrides compose into a valid job, prompts are one
token per character, and the 6N parameter count matches the model's own count (tied embedding once)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_rl_step  # noqa: E402
import bench_update_mfu  # noqa: E402


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_overrides_compose_to_the_issue_8_workload(algo, tmp_path):
    from hydra import compose, initialize_config_dir

    from megatron_rl.config.store import CONFIG_DIR, to_job_config

    a = bench_rl_step.parse(["--algo", algo, "--model-dir", str(tmp_path / "m"), "--data-dir", str(tmp_path)])
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = to_job_config(compose("config", overrides=bench_rl_step.overrides(a)))
    seqs = cfg.data.train_batch_size * cfg.rollout.n
    assert seqs == 512 and cfg.rollout.max_new_tokens == 512 and cfg.data.max_prompt_length == 256
    assert cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size  # one optimizer step per rollout
    assert cfg.model.dtype == "bfloat16"
    assert cfg.algorithm.adv_estimator == ("grpo" if algo == "grpo" else "gae")
    assert not cfg.actor.use_kl_loss


def test_prompts_are_one_token_per_character():
    from make_synthetic_gsm8k import tokenizer

    tok = tokenizer(1000)
    texts = bench_rl_step.prompts(3, 40)
    assert [len(tok(t, add_special_tokens=False).input_ids) for t in texts] == [40, 40, 40]


def test_no_eos_tokenizer_hides_only_eos():
    class Tok:
        eos_token_id, pad_token_id = 7, 0

    t = bench_rl_step.NoEosTokenizer(Tok())
    assert t.eos_token_id is None and t.pad_token_id == 0


def test_param_count_is_the_models_weight_matrices_with_the_tied_embedding_once():
    from transformers import AutoConfig, Qwen2ForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in bench_rl_step.TINY.items() if k != "architectures"})
    cfg.tie_word_embeddings = True
    model = Qwen2ForCausalLM(cfg)
    matrices = {p.data_ptr(): p.numel() for p in model.parameters() if p.dim() == 2}
    assert bench_update_mfu.param_count(cfg) == sum(matrices.values())


def test_roofline_is_written_out_and_adds_up():
    from megatron_rl.models.facts import roofline_step_s

    r = roofline_step_s(10**9, 4000, 1000, 4.8e12)
    assert r["update_s"] == pytest.approx(6e9 * 4000 / 790e12) and r["decode_s"] == pytest.approx(1.0)
    assert r["total_s"] == pytest.approx(r["update_s"] + r["prefill_s"] + r["decode_s"])
    slow = roofline_step_s(10**9, 4000, 1000, 4.8e12, hbm_bytes_per_s=2.4e12, flops_per_s=395e12)
    assert slow["total_s"] == pytest.approx(2 * r["total_s"])  # a machine at half the rates: twice the time


def test_shapes_build_the_benchmark_configs():
    assert bench_rl_step.shape_config("llama-3.1-8b").get("rope_scaling") is None  # dropped for the decoder
    assert bench_rl_step.shape_config("qwen2.5-7b")["vocab_size"] == 152064
    a = bench_rl_step.parse(["--shape", "qwen2.5-3b"])
    assert a.model_dir == "/tmp/bench_qwen2_5_3b_random"


def test_live_kv_counts_each_rows_prompt_or_each_groups_prompt_once():
    """The decode floor's live KV: per row (prompt + keys so far, every step the row decodes), and with
    each group's prompt read once per step while any of its samples decodes (prompt_kv_sharing)."""
    from types import SimpleNamespace

    batch = SimpleNamespace(prompt_lens=torch.tensor([4, 4, 6, 6]), response_lens=torch.tensor([3, 5, 2, 2]),
                            group_index=torch.tensor([10, 10, 11, 11]))  # fmt: skip
    assert bench_rl_step.live_kv(batch) == (5.0, 3 * 4 + 3 + 5 * 4 + 10 + 2 * 6 + 1 + 2 * 6 + 1)
    assert bench_rl_step.live_kv_unique_prompts(batch) == (3 + 10 + 1 + 1) + 4 * 5 + 6 * 2


def test_machine_rates_time_the_gemms_and_the_copy_they_count():
    """``_timing.machine_rates`` (recorded by ``bench_rl_step`` before and after its steps) on CPU: the GEMM
    rate counts 2 n^3 a call over the calls it timed (at least 3, about ``seconds`` of them) and the copy
    both the bytes read and written; no nvidia-smi fields off CUDA."""
    from _timing import machine_rates

    r = machine_rates("cpu", seconds=0.2, n=96, copy_mib=4)
    assert r["gemm_iters"] >= 3 and 0 < r["gemm_s"] < 5
    assert r["gemm_tflops"] == pytest.approx(2 * 96**3 * r["gemm_iters"] / r["gemm_s"] / 1e12)
    assert r["copy_bytes"] == 2 * 4 * 2**20 and r["copy_tb_s"] == pytest.approx(
        r["copy_bytes"] / r["copy_s"] / 1e12
    )
    assert not {"sm_clock_mhz", "power_w", "clocks_event_reasons"} & set(r)


def test_nvidia_smi_lines_parse_with_missing_fields():
    """``_timing.parse_smi``: numbers as floats, the clock-event mask as written, N/A fields left out (a
    power reading of [N/A] leaves the clock and the rest)."""
    from _timing import SMI_FIELDS, parse_smi

    full = parse_smi("GPU-1234, 1425, 685.10, 700.00, 62, 0x0000000000000004")
    assert full == {"uuid": "GPU-1234", "sm_clock_mhz": 1425.0, "power_w": 685.1, "power_limit_w": 700.0,
                    "temperature_c": 62.0, "clocks_event_reasons": "0x0000000000000004"}  # fmt: skip
    assert len(SMI_FIELDS) == 5
    part = parse_smi("GPU-1234, 1410, [N/A], [N/A], 63, [N/A]")
    assert part == {"uuid": "GPU-1234", "sm_clock_mhz": 1410.0, "temperature_c": 63.0}


def test_measured_rates_are_the_means_of_the_measurements_that_ran():
    """``bench_rl_step``'s roofline at the rates a machine sustained: the means of ``machine.before`` /
    ``after`` where they ran (a failed ``after`` records an error instead), None without any; in one process
    ``slowest_rates`` is the same."""
    before = {"gemm_tflops": 680.0, "copy_tb_s": 3.0}
    after = {"gemm_tflops": 690.0, "copy_tb_s": 2.9}
    assert bench_rl_step.measured_rates({"before": before, "after": after}) == pytest.approx(
        (685e12, 2.95e12)
    )
    assert bench_rl_step.measured_rates({"before": before, "after": {"error": "CUDA out of memory"}}) == (
        680e12,
        3.0e12,
    )
    assert bench_rl_step.measured_rates({}) is None
    assert bench_rl_step.slowest_rates({"before": before}) == (680e12, 3.0e12)


def test_host_timeline_spans_union_and_the_trainer_pieces_it_wraps():
    """``HostTimeline``: spans from the step's start (also when the wrapped call raises), collections of the
    collector as ``gc<generation>``, the step's time outside every span; and every piece it wraps is still a
    function of the trainer's loop module (a rename fails here, not on a device)."""
    import time

    from megatron_rl.trainer import run as trainer_run

    tl = bench_rl_step.HostTimeline()
    assert all(callable(getattr(trainer_run, name)) for name in tl.PIECES)
    tl.start(time.perf_counter())

    def boom():
        raise ValueError("x")

    assert tl.wrap("ok", lambda x: x + 1)(1) == 2
    with pytest.raises(ValueError):
        tl.wrap("boom", boom)()
    tl.gc_callback("start", {"generation": 2})
    tl.gc_callback("stop", {"generation": 2, "collected": 7})
    tl.gc_callback("start", {"generation": 0})
    tl.gc_callback("stop", {"generation": 0, "collected": 3})
    assert [s[0] for s in tl.spans] == ["ok", "boom", "gc2", "gc0"]
    assert len(tl.full) == 1 and tl.full[0][2] == 7  # full collections only, with what they freed
    assert tl.count_allocator(lambda: 5)() == 5 and tl.alloc_generate == {}  # CPU: no allocator counters
    state = tl.collector_state()
    assert state["tracked"] > 1000 and state["frozen"] >= 0 and len(state["counts"]) == 3
    tl.spans = [("a", 0.000, 0.010), ("b", 0.005, 0.020), ("c", 0.030, 0.040)]  # a and b overlap
    got = tl.report(0.050)
    assert got["uncovered_ms"] == pytest.approx(50 - 20 - 10) and got["full_collections"] == tl.full
    tl.gc_callback("start", {"generation": 2})  # after the report (after_first_step's): not in it
    tl.gc_callback("stop", {"generation": 2, "collected": 1})
    assert len(got["full_collections"]) == 1 and len(tl.full) == 2
    assert [s[0] for s in got["spans_ms"]] == ["a", "b", "c"] and got["spans_ms"][1][1:] == [5.0, 20.0]
