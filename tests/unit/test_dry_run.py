"""trainer.dry_run and the memory model: layout, the estimate's components at known shapes, the auto
budgets and the refusal of jobs that cannot fit (issue 15 item 4), from config.json alone."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys

import pytest

from megatron_rl.config.schema import JobConfig
from megatron_rl.config.validate import ConfigError
from megatron_rl.distributed.dims import ParallelDims
from megatron_rl.models import ModelArgs
from megatron_rl.models.shapes import hf_config
from megatron_rl.trainer.dry_run import dry_run, rank_table
from megatron_rl.trainer.memory_model import GIB, estimate, layer_activation_bytes_per_token, micro_shape
from megatron_rl.trainer.memory_plan import apply_plan, plan

H200 = 139.8 * GIB
ONE = ParallelDims.build(1, 1, 1)


def grpo(budget=24576, shape="qwen2.5-3b") -> tuple[JobConfig, ModelArgs]:
    """issue 15's GRPO workload: 64 prompts x 8, 256 + 512 tokens, one optimizer step, bf16."""
    cfg = JobConfig()
    cfg.model.dtype, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens = "bfloat16", 256, 512
    cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size = 64, 8, 64
    cfg.actor.use_dynamic_bsz, cfg.actor.ppo_max_token_len_per_gpu = True, budget
    return cfg, ModelArgs.from_hf_config(hf_config(shape))


def test_components_at_a_known_shape():
    cfg, a = grpo(8192, "qwen2.5-0.5b")
    n = a.stage_params()["first"]
    b = estimate(cfg, ONE, a, 256)["bytes"]
    # bf16 weights; local AdamW: fp32 main params + moments, fp32 main_grad while training
    assert b["params"] == 2 * n and b["grads"] == 4 * n and b["optimizer"] == 12 * n
    # 10 sequences of 768 tokens; per token and layer (bf16): 5h + 2q + kv + 3f = 5*896 + 2*896 + 256 + 3*4864
    assert layer_activation_bytes_per_token(cfg, a, 1, "actor") == 2 * (5 * 896 + 2 * 896 + 256 + 3 * 4864)
    assert b["activations"] == pytest.approx(10 * 768 * 24 * 2 * (5 * 896 + 2 * 896 + 256 + 3 * 4864))
    # logits at the 10 x 512 response positions: the bf16 logits the kernel keeps + their bf16 gradient
    assert b["logits"] == 10 * 512 * 151936 * (2 + 2)
    assert b["kv_cache"] == 512 * 768 * a.kv_bytes_per_token()  # all 512 sequences in one wave


def test_recompute_shrinks_the_activations():
    cfg, a = grpo(16384)
    full = estimate(cfg, ONE, a, 256)["bytes"]["activations"]
    cfg.actor.recompute_granularity, cfg.actor.recompute_method, cfg.actor.recompute_num_layers = (
        "full",
        "uniform",
        1,
    )
    uniform = estimate(cfg, ONE, a, 256)["bytes"]["activations"]
    per_layer = layer_activation_bytes_per_token(cfg, a, 1, "actor")
    assert uniform == pytest.approx(21 * 768 * (36 * 2048 * 2 + per_layer))  # 36 layer inputs + one layer
    cfg.actor.recompute_granularity, cfg.actor.recompute_method, cfg.actor.recompute_num_layers = (
        "selective", None, None)  # fmt: skip
    cfg.actor.recompute_modules = ["mlp"]
    assert estimate(cfg, ONE, a, 256)["bytes"]["activations"] == pytest.approx(
        full * (1 - 3 * 11008 / (per_layer / 2))
    )


def test_the_3b_budget_that_died_is_no_longer_called_safe():
    cfg, a = grpo(24576)  # issue 15: OOM in the log-prob backward at > 137 GiB
    assert estimate(cfg, ONE, a, 256)["peaks"]["actor_update"] > H200
    with pytest.raises(ConfigError) as err:
        plan(cfg, ONE, a, 256, H200)
    msg = str(err.value)
    assert "actor.ppo_max_token_len_per_gpu=24576" in msg and "actor.ppo_max_token_len_per_gpu=19968" in msg
    cfg.actor.ppo_max_token_len_per_gpu = 8192  # measured 74.3 GiB: within 15%
    assert estimate(cfg, ONE, a, 256)["peaks"]["actor_update"] / GIB == pytest.approx(74.3, rel=0.15)
    # no auto budget: none chosen; at 8192 tokens the kept KV cache and graphs fit beside the update
    assert plan(cfg, ONE, a, 256, H200)["chosen"] == {"actor_share_prompts": False, "keep_cache": True}


def test_auto_picks_the_largest_budget_and_slots_that_fit():
    cfg, a = grpo("auto")
    cfg.rollout.max_num_seqs = "auto"
    got = plan(cfg, ONE, a, 256, H200)["chosen"]
    assert got["actor"] % 768 == 0 and got["max_num_seqs"] == 512
    assert got["kv_cache_tokens"] == 512 * 768  # the cache sized for the slots, not from free memory
    fitted = copy.deepcopy(cfg)
    apply_plan(fitted, got)
    assert (fitted.actor.ppo_max_token_len_per_gpu, fitted.rollout.kv_cache_tokens) == (
        got["actor"],
        512 * 768,
    )
    over = copy.deepcopy(cfg)
    over.actor.ppo_max_token_len_per_gpu = got["actor"] + 768
    assert plan(cfg, ONE, a, 256, H200)["chosen"]["actor"] == got["actor"]
    with pytest.raises(ConfigError, match="actor.ppo_max_token_len_per_gpu"):
        plan(over, ONE, a, 256, H200)  # one sequence more than auto's choice is refused
    small = plan(copy.deepcopy(cfg), ONE, a, 256, 80 * GIB)["chosen"]  # a smaller GPU: a smaller budget
    assert small["actor"] < got["actor"]
    with pytest.raises(ConfigError, match="trainer.gpu_memory_gb"):
        plan(cfg, ONE, a, 256, None)  # auto without a GPU and without the key


def test_an_8b_full_fine_tune_does_not_fit_one_gpu_and_the_dry_run_says_so(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(hf_config("llama-3.1-8b", rope_scaling=None)))
    cfg, _ = grpo(8192)
    cfg.model.path, cfg.trainer.output_dir, cfg.trainer.gpu_memory_gb = (
        str(tmp_path / "m"),
        str(tmp_path / "o"),
        139.8,
    )
    with pytest.raises(ConfigError) as err:
        dry_run(cfg, ONE)
    msg = str(err.value)  # the hybrid-device optimizer keys, with a host fraction that fits
    assert "actor update peak" in msg and "actor.optim.optimizer_cpu_offload=true" in msg
    assert "actor.optim.optimizer_offload_fraction=0.3" in msg
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "peak: actor_update" in out
    assert "refused" in json.loads((tmp_path / "o" / "dry_run.json").read_text())


def test_tp_and_pp_split_the_estimate():
    cfg, a = grpo(8192, "qwen2.5-0.5b")
    one = estimate(cfg, ONE, a, 256)["params_per_gpu"]
    tp2 = estimate(cfg, ParallelDims.build(2, 2, 1, num_layers=24), a.with_tp(2), 256)["params_per_gpu"]
    assert 0.5 * one < tp2 < 0.51 * one


def test_rank_table_megatron_order():
    rows = rank_table(ParallelDims.build(8, 2, 2, num_layers=4), layers=4)
    assert [(r["tp"], r["dp"], r["pp"]) for r in rows[:4]] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert rows[4]["pp"] == 1 and "layers 2-3" in rows[4]["holds"] and "LM/value head" in rows[4]["holds"]


def test_dry_run_prints_layout_memory_and_the_auto_choice(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(hf_config("qwen2.5-0.5b")))
    cfg = JobConfig()
    cfg.model.path, cfg.model.dtype, cfg.trainer.output_dir = (
        str(tmp_path / "m"),
        "bfloat16",
        str(tmp_path / "o"),
    )
    cfg.algorithm.adv_estimator, cfg.trainer.gpu_memory_gb = "gae", 139.8
    cfg.critic.use_dynamic_bsz, cfg.critic.ppo_max_token_len_per_gpu = True, "auto"
    r = dry_run(cfg, ParallelDims.build(8, 2, 2, num_layers=24))
    text = capsys.readouterr().out
    assert "world=8 = TP 2 x PP 2 x DP 2" in text and "rank    7: tp=1 pp=1 dp=1" in text
    assert "critic.ppo_max_token_len_per_gpu: auto -> " in text and isinstance(
        cfg.critic.ppo_max_token_len_per_gpu, int
    )
    for key in (
        "params",
        "optimizer",
        "kv_cache",
        "activations",
        "peak: actor_update",
        "peak: critic_update",
    ):
        assert key in text
    assert r["memory"]["bytes"]["optimizer"] == pytest.approx(r["memory"]["params_per_gpu"] * 12, rel=0.01)
    assert json.loads((tmp_path / "o" / "dry_run.json").read_text())["layout"]["dp"] == 2


def test_builtin_model_needs_no_files(tmp_path):
    cfg = JobConfig()
    cfg.trainer.output_dir = str(tmp_path)
    r = dry_run(cfg, ONE)
    assert r["model"]["layers"] == cfg.model.num_layers and r["batches"]["actor"]["micro_batches"] >= 1


def test_missing_config_names_the_key(tmp_path):
    cfg = JobConfig()
    cfg.model.path = str(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.path="):
        dry_run(cfg, ONE)


def test_cli_dry_run_exits_without_training(tmp_path):
    from tests.distributed.launch import cpu_env

    cmd = [
        sys.executable,
        "-m",
        "megatron_rl.cli",
        "train",
        "trainer.dry_run=true",
        f"trainer.output_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cpu_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "megatron-rl dry run: world=1" in proc.stdout and "peak: actor_update" in proc.stdout
    assert (tmp_path / "dry_run.json").is_file() and not (tmp_path / "metrics.jsonl").exists()


def test_distributed_optimizer_shards_the_optimizer_estimate_over_dp():
    cfg, a = grpo(8192, "qwen2.5-0.5b")
    dims = ParallelDims.build(4, 1, 1, num_layers=24)
    n = a.stage_params()["first"]
    local = estimate(cfg, dims, a, 256)["bytes"]
    cfg.actor.optim.backend = "megatron"
    mcore = estimate(cfg, dims, a, 256)["bytes"]
    cfg.actor.optim.use_distributed_optimizer = True
    dist_opt = estimate(cfg, dims, a, 256)["bytes"]
    assert local["optimizer"] == pytest.approx(12 * n) and local["grads"] == pytest.approx(
        4 * n
    )  # fp32 main_grad
    assert (
        mcore["optimizer"] == pytest.approx(16 * n) and mcore["grads"] == 0
    )  # + fp32 grad buffers, resident
    assert dist_opt["optimizer"] == pytest.approx(12 * n / 4 + 4 * n)  # main params + moments split over DP=4


def test_cli_train_refuses_a_job_that_cannot_fit_before_building_models(tmp_path):
    from tests.distributed.launch import cpu_env

    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "trainer.gpu_memory_gb=0.001",
           "trainer.val_before_train=false", f"trainer.output_dir={tmp_path}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cpu_env(), cwd=tmp_path)
    assert proc.returncode != 0 and "does not fit the 0.0 GiB GPU" in proc.stderr, proc.stderr[-2000:]
    assert "with actor.ppo_micro_batch_size_per_gpu=" in proc.stderr  # the key at fault, named
    assert not (tmp_path / "metrics.jsonl").exists()


# Session 4 on one H200 (benchmarks/results/2026-12-01-h200-session4, the GRPO workload of grpo()): the
# token budget the run resolved, the most KV slots a step decoded with, and the measured peaks (GiB,
# max_memory_allocated per phase). 7B and 8B ran megatron-core's hybrid-device optimizer (host fraction 0.5).
MEASURED = [
    ("qwen2.5-0.5b", 66048, 512, 97.27, 11.76),
    ("qwen2.5-1.5b", 36096, 512, 113.42, 31.98),
    ("qwen2.5-3b", 19200, 512, 122.22, 55.30),
    ("qwen2.5-7b", 8448, 512, 125.72, 106.88),
    ("llama-3.1-8b", 7680, 257, 127.03, 111.66),
]


@pytest.mark.parametrize("shape,budget,slots,update_gib,gen_gib", MEASURED)
def test_the_memory_model_is_within_5_percent_of_the_measured_peaks(
    shape, budget, slots, update_gib, gen_gib
):
    """Issue 15's target is 15% per phase; the model is held to 5% here so a drift shows before it matters.
    (Counting a third pair of bytes per logit, as before, put 0.5B's update 23% over.)"""
    cfg, a = grpo(budget, shape)
    if shape in ("qwen2.5-7b", "llama-3.1-8b"):
        o = cfg.actor.optim
        o.backend, o.use_distributed_optimizer, o.optimizer_cpu_offload = "megatron", True, True
        o.optimizer_offload_fraction = 0.5
    peaks = estimate(cfg, ONE, a, 256, {"max_num_seqs": slots})["peaks"]
    assert peaks["actor_update"] / GIB == pytest.approx(update_gib, rel=0.05)
    assert peaks["generation"] / GIB == pytest.approx(gen_gib, rel=0.05)


def test_exact_logprobs_counts_its_extra_logits_and_refuses_the_budget_that_ran_out():
    """Session 5, 0.5B, rollout.exact_logprobs=true at the default path's auto budget (84480 tokens): the
    update asked for one more 15.9 GiB logits tensor with 136.0 GiB allocated; at 16384 it peaked at
    37.0 GiB. The plan must refuse the first and keep the second."""
    cfg, a = grpo(84480, "qwen2.5-0.5b")
    base = estimate(cfg, ONE, a, 256)["peaks"]["actor_update"]
    cfg.rollout.exact_logprobs = True
    exact = estimate(cfg, ONE, a, 256)["peaks"]["actor_update"]
    assert exact > 0.98 * (136.0 + 15.9) * GIB and exact > H200 > base  # the asked-for total, a lower bound
    with pytest.raises(ConfigError, match="actor.ppo_max_token_len_per_gpu=84480"):
        plan(cfg, ONE, a, 256, H200)
    cfg.actor.ppo_max_token_len_per_gpu = 16384
    assert estimate(cfg, ONE, a, 256)["peaks"]["actor_update"] / GIB == pytest.approx(37.0, rel=0.15)
    cfg.actor.ppo_max_token_len_per_gpu = "auto"
    assert plan(cfg, ONE, a, 256, H200)["chosen"]["actor"] < 84480


# Measured on one H200 with shared prompts: (shape, token budget, update peak GiB, hybrid optimizer).
# Session 7 (results/2026-12-02-h200-session7, share_prompts=true): budgets of the whole groups of 8 each
# micro-batch held then. Session 8 (results/2026-12-02-h200-session8, defaults): the auto budgets as
# chosen then, between multiples of a group (256 + 8 x 512 = 4352 tokens), so the split held fewer
# sequences than budget // 544: 3B 19040 -> 32, 7B 9248 -> 16, 8B 8160 -> 8 (+ grad_offload).
MEASURED_SHARED = [("qwen2.5-1.5b", 48 * 544, 96.25, False), ("qwen2.5-3b", 24 * 544, 104.59, False),
                   ("qwen2.5-7b", 8 * 544, 108.07, True), ("qwen2.5-3b", 19040, 122.03, False),
                   ("qwen2.5-7b", 9248, 130.76, True), ("llama-3.1-8b", 8160, 112.91, True)]  # fmt: skip


@pytest.mark.parametrize("shape,budget,update_gib,hybrid", MEASURED_SHARED)
def test_the_memory_model_counts_shared_prompts_once(shape, budget, update_gib, hybrid):
    """With shared prompts a micro-batch holds whole GRPO groups of 256 + 8 x 512 tokens (each prompt once,
    not 8 times): the model counts those (and the gathered key segments), and the auto budget is a multiple
    of a group."""
    cfg, a = grpo(budget, shape)
    cfg.actor.share_prompts = True
    if hybrid:
        o = cfg.actor.optim
        o.backend, o.use_distributed_optimizer, o.optimizer_cpu_offload = "megatron", True, True
        o.optimizer_offload_fraction, o.grad_offload = 0.5, shape == "llama-3.1-8b"
    shared = estimate(cfg, ONE, a, 256)["peaks"]["actor_update"]
    assert shared / GIB == pytest.approx(update_gib, rel=0.05)
    seqs, tokens = micro_shape(cfg, "actor", 256)
    assert tokens == seqs // 8 * 4352 and tokens <= budget < tokens + 4352  # whole groups only
    cfg.actor.share_prompts = False  # the same budget unshared: sequences of 768 tokens
    assert micro_shape(cfg, "actor", 256) == (budget // 768, budget // 768 * 768)
    cfg.actor.share_prompts, cfg.actor.ppo_max_token_len_per_gpu = True, "auto"
    got = plan(cfg, ONE, a, 256, H200)["chosen"]["actor"]
    assert got % 4352 == 0 and got > 0


def test_share_prompts_auto_is_on_only_where_varlen_runs_and_the_job_is_covered(monkeypatch):
    import megatron_rl.models.packed_attention as pa
    import megatron_rl.trainer.memory_plan as mp

    cfg, a = grpo("auto")
    assert cfg.actor.share_prompts == "auto"  # the default
    got = plan(copy.deepcopy(cfg), ONE, a, 256, H200)  # this machine: no CUDA
    assert got["chosen"]["actor_share_prompts"] is False and got["chosen"]["actor"] % 768 == 0
    assert "actor.share_prompts" not in got["notes"]  # not printed on a machine without a GPU
    assert "no CUDA device" in mp.share_choice(cfg, "actor")[1]
    # a dry run here planning for the GPU (trainer.gpu_memory_gb) plans what that GPU's run will do, and says so
    dry = plan(copy.deepcopy(cfg), ONE, a, 256, H200, dry_run=True)
    assert dry["chosen"]["actor_share_prompts"] is True and dry["chosen"]["actor"] % 544 == 0
    assert dry["notes"]["actor.share_prompts"].startswith("auto -> true (assumed for the GPU")
    # a GPU whose varlen_attn passes the trial: on, and the budget counts shared sequences
    monkeypatch.setattr(mp.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mp.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(pa, "varlen_available", lambda dev, dtype, shared=False: True)
    got = plan(copy.deepcopy(cfg), ONE, a, 256, H200)
    assert got["chosen"]["actor_share_prompts"] is True and got["chosen"]["actor"] % 544 == 0
    assert got["notes"]["actor.share_prompts"].startswith("auto -> true")
    assert (
        f"attention kernel: {pa.varlen_kernel(mp.torch.device('cuda', 0))}"
        in got["notes"]["actor.share_prompts"]
    )
    assert "shared prompts" in got["notes"]["actor.ppo_max_token_len_per_gpu"]
    fitted = copy.deepcopy(cfg)
    apply_plan(fitted, got["chosen"])
    assert fitted.actor.share_prompts is True and cfg.actor.share_prompts == "auto"  # plan left cfg alone
    exact = copy.deepcopy(cfg)
    exact.rollout.exact_logprobs = True  # the batch-invariant attention serves packed and shared rows too
    assert mp.share_choice(exact, "actor")[0]
    for key, value, why in [("rollout.n", 1, "rollout.n=1"),
                            ("rollout.multi_turn.enable", True, "multi-turn"), ("actor.lora.rank", 8, "lora"),
                            ("parallel.sequence_parallel", True, "sequence_parallel"),
                            ("model.dtype", "float32", "model.dtype=float32")]:  # fmt: skip
        blocked = copy.deepcopy(cfg)
        *path, last = key.split(".")
        setattr(functools.reduce(getattr, path, blocked), last, value)
        on, note = mp.share_choice(blocked, "actor")
        assert not on and why in note, (key, note)
    # the trial failed on this GPU: off, with its errors
    pa._VARLEN_WHY[("cuda:0", mp.torch.bfloat16, True)] = (
        "largest relative error vs float32: varlen_attn 1e-1"
    )
    monkeypatch.setattr(pa, "varlen_available", lambda dev, dtype, shared=False: False)
    on, note = mp.share_choice(cfg, "actor")
    assert not on and "failed its trial" in note and "1e-1" in note
    pa._VARLEN_WHY.pop(("cuda:0", mp.torch.bfloat16, True))


def test_share_prompts_takes_true_false_or_auto():
    from megatron_rl.config.validate import validate_job

    cfg, _ = grpo(24576)
    for bad in ("yes", 1):
        cfg.actor.share_prompts = bad
        with pytest.raises(ConfigError, match=f"actor.share_prompts={bad!r}: use true, false or auto"):
            validate_job(cfg, 1)


def test_keep_cache_auto_keeps_the_cache_only_where_the_update_keeps_its_micro_batches():
    """rollout.keep_cache=auto: kept where the plan with the cache held through the update (its bytes in the
    update peak) gives the same number of update micro-batches as without; else freed, and the budget is the
    one planned without it. An explicit true counts the cache in the update (a budget that no longer fits
    is refused), false and auto without a GPU do not."""

    def planned(shape, total, keep="auto"):
        cfg, a = grpo("auto", shape)
        cfg.rollout.max_num_seqs, cfg.actor.share_prompts, cfg.rollout.keep_cache = "auto", True, keep
        return cfg, a, plan(copy.deepcopy(cfg), ONE, a, 256, total)

    cfg, a, small = planned("qwen2.5-0.5b", H200)
    _, _, off = planned("qwen2.5-0.5b", H200, keep=False)
    assert small["chosen"]["keep_cache"] is True and "keep_cache" not in off["chosen"]
    assert "auto -> true" in small["notes"]["rollout.keep_cache"]
    # with the cache counted the budget is smaller, but both split the 512 sequences into 4 micro-batches
    assert small["chosen"]["actor"] < off["chosen"]["actor"]
    for budget in (small["chosen"]["actor"], off["chosen"]["actor"]):
        assert -(-512 // micro_shape(cfg, "actor", 256, budget)[0]) == 4
    kept = copy.deepcopy(cfg)
    apply_plan(kept, small["chosen"])
    assert kept.rollout.keep_cache is True
    b = estimate(kept, ONE, a, 256)
    assert (
        b["bytes"]["kept_generation"]
        == b["bytes"]["kv_cache"] + b["bytes"]["generation_temporaries"]
        > 5 * GIB
    )
    kept.rollout.keep_cache = False
    freed = estimate(kept, ONE, a, 256)
    assert b["peaks"]["actor_update"] - freed["peaks"]["actor_update"] == b["bytes"]["kept_generation"]
    assert b["peaks"]["generation"] == freed["peaks"]["generation"]

    cfg, a, big = planned("qwen2.5-3b", H200)  # 15 GiB kept would cost the update 16 -> 22 micro-batches
    _, _, big_off = planned("qwen2.5-3b", H200, keep=False)
    assert big["chosen"]["keep_cache"] is False and big["chosen"]["actor"] == big_off["chosen"]["actor"]
    assert "16 -> 22" in big["notes"]["rollout.keep_cache"]
    assert "do not fit" in planned("qwen2.5-3b", 80 * GIB)[2]["notes"]["rollout.keep_cache"]
    cfg.rollout.keep_cache, cfg.actor.ppo_max_token_len_per_gpu = True, big_off["chosen"]["actor"]
    with pytest.raises(ConfigError, match="actor.ppo_max_token_len_per_gpu"):
        plan(cfg, ONE, a, 256, H200)  # true: the cache counted, the budget planned without it refused
    cfg.rollout.keep_cache, cfg.actor.ppo_max_token_len_per_gpu, cfg.rollout.max_num_seqs = "auto", 8192, 512
    assert plan(cfg, ONE, a, 256, None)["chosen"]["keep_cache"] is False  # no GPU to plan: not kept
