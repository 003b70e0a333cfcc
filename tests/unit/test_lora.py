"""LoRA config keys (off by default, validated at start-up), the recipe, the PEFT mapping's pure parts and
the memory model's LoRA accounting. The TP/PP parity with PEFT is tests/distributed/test_lora_dist.py."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import ConfigError, JobConfig, validate_job
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.models.args import ModelArgs
from megatron_rl.models.lora_hf import adapter_params_per_layer, adapters_from_peft, peft_from_adapter_shards
from megatron_rl.models.shapes import tiny_hf_config


def test_lora_is_off_by_default_for_actor_and_critic():
    cfg = JobConfig()
    assert not cfg.actor.lora.enabled and not cfg.critic.lora.enabled
    validate_job(cfg, world_size=1, num_layers=2)


@pytest.mark.parametrize(
    "role,field,value,needle",
    [
        ("actor", "rank", -1, "actor.lora.rank=-1 must be an integer >= 0"),
        ("actor", "alpha", 0.0, "actor.lora.alpha=0.0 must be > 0"),
        ("actor", "dropout", 1.0, r"actor.lora.dropout=1.0 must be in \[0, 1\)"),
        (
            "actor",
            "target_modules",
            ["q_proj"],
            "actor.lora.target_modules=\\['q_proj'\\]: use a non-empty list",
        ),
        ("actor", "target_modules", [], "actor.lora.target_modules=\\[\\]"),
        ("actor", "init", "zeros", "actor.lora.init='zeros' is not one of: kaiming_uniform | gaussian"),
        ("critic", "alpha", -2.0, "critic.lora.alpha=-2.0 must be > 0"),
    ],
)
def test_bad_lora_settings_fail_at_start_up_naming_the_key(role, field, value, needle):
    cfg = JobConfig()
    if role == "critic":
        cfg.algorithm.adv_estimator = "gae"
    lora = getattr(cfg, role).lora
    lora.rank = 8 if field != "rank" else value
    setattr(lora, field, value)
    with pytest.raises(ConfigError, match=needle):
        validate_job(cfg, world_size=1, num_layers=2)


def test_lora_recipe_composes_and_validates(tmp_path):
    from hydra import compose, initialize_config_dir

    from megatron_rl.config.store import CONFIG_DIR, to_job_config

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        overrides = ["experiment=gsm8k_qwen2_5_0_5b_grpo_lora", f"trainer.output_dir={tmp_path}"]
        cfg = to_job_config(compose("config", overrides=overrides))
    assert cfg.actor.lora.rank == 32 and cfg.actor.lora.alpha == 64 and cfg.actor.optim.lr == 1e-5
    assert cfg.actor.use_kl_loss and cfg.reward.reward_fn == "gsm8k" and not cfg.critic.lora.enabled
    validate_job(cfg, world_size=1, num_layers=24)


ARGS = ModelArgs.from_hf_config(
    tiny_hf_config("qwen2", vocab_size=250), tp=2
)  # hidden 64, 4 layers, 4 heads / 2 KV, ffn 128


def _random_peft(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, d = ARGS.hidden_size, ARGS.head_dim
    outs = {"q_proj": 4 * d, "k_proj": 2 * d, "v_proj": 2 * d, "o_proj": h, "gate_proj": 128, "up_proj": 128,
            "down_proj": h}  # fmt: skip
    ins = {
        "q_proj": h,
        "k_proj": h,
        "v_proj": h,
        "o_proj": 4 * d,
        "gate_proj": h,
        "up_proj": h,
        "down_proj": 128,
    }
    sd = {}
    for i in range(ARGS.num_layers):
        shared = {"attn": torch.randn(rank, h, generator=g), "mlp": torch.randn(rank, h, generator=g)}
        for m in outs:
            parent = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            pre = f"base_model.model.model.layers.{i}.{parent}.{m}"
            fused = {
                "q_proj": "attn",
                "k_proj": "attn",
                "v_proj": "attn",
                "gate_proj": "mlp",
                "up_proj": "mlp",
            }
            a = shared[fused[m]] if m in fused else torch.randn(rank, ins[m], generator=g)
            sd[f"{pre}.lora_A.weight"], sd[f"{pre}.lora_B.weight"] = (
                a,
                torch.randn(outs[m], rank, generator=g),
            )
    return sd


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2), (1, 4)])
def test_peft_mapping_round_trips_at_every_layout(tp, pp):
    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    sd = _random_peft(rank=3)
    shards = {(t, p): adapters_from_peft(sd, ARGS, targets, tp=tp, tp_rank=t, pp=pp, pp_rank=p)
              for t in range(tp) for p in range(pp)}  # fmt: skip
    per_rank = adapter_params_per_layer(ARGS, targets, 3, tp)["adapters"]
    assert sum(v.numel() for v in shards[(0, 0)].values()) == per_rank * ARGS.num_layers // pp
    back = peft_from_adapter_shards(shards, ARGS, targets)
    assert set(back) == set(sd) and all(torch.equal(back[k], v) for k, v in sd.items())


def test_unfusable_peft_adapters_are_refused():
    sd = _random_peft(rank=2)
    k = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    sd[k] = sd[k] + 1.0  # a new tensor: q/k/v share one A here
    with pytest.raises(ValueError, match="different lora_A"):
        adapters_from_peft(sd, ARGS, ["linear_qkv"], tp=1, tp_rank=0, pp=1, pp_rank=0)


def test_memory_model_counts_only_adapters_and_no_reference_model():
    from megatron_rl.distributed.dims import ParallelDims
    from megatron_rl.trainer.memory_model import estimate

    cfg = JobConfig()
    cfg.actor.use_kl_loss = True
    dims = ParallelDims.build(1, 1, 1, num_layers=ARGS.num_layers)
    full = estimate(cfg, dims, ARGS, 16)
    cfg.actor.lora = LoRAConfig(rank=4)
    lora = estimate(cfg, dims, ARGS, 16)
    assert "ref" not in lora["roles"] and "ref" in full["roles"]
    n_adapters = (
        adapter_params_per_layer(ARGS, cfg.actor.lora.target_modules, 4)["adapters"] * ARGS.num_layers
    )
    assert lora["bytes"]["optimizer"] == n_adapters * 8  # fp32 weights: Adam moments only
    assert lora["bytes"]["optimizer"] < full["bytes"]["optimizer"] / 4


def test_resume_refuses_adapters_on_another_base(tmp_path):
    from megatron_rl.checkpoint.layout import CheckpointError
    from megatron_rl.checkpoint.lora_base import _digests, check_base

    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"weights v1")
    saved = {"path": str(base), "digests": dict(_digests(str(base)))}
    check_base("actor", saved, dict(saved), tmp_path / "ckpt")  # same base: fine
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"weights v2")
    now = {"path": str(other), "digests": dict(_digests(str(other)))}
    with pytest.raises(CheckpointError, match="were trained on the base model in .*base.*differ"):
        check_base("actor", saved, now, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="holds actor LoRA adapters but this run uses full fine-tuning"):
        check_base("actor", saved, None, tmp_path / "ckpt")


class _MatmulLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The (op, shapes) of every mm/bmm dispatched inside the context."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
            self.ops.append((func._overloadpacket.__name__, tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


def test_frozen_base_runs_as_single_gemms_with_unchanged_results():
    """A frozen weight's matmul with a non-contiguous [T, B, in] operand used to run as a bmm of T batches
    of [B, in] (torch.matmul folds only when the weight needs grad): linear_proj's forward after flash SDPA
    (simulated here by a transposed input) and the LM head's input gradient (GPTModel's logits transpose).
    Every matmul is now one 2D GEMM, with the same outputs and gradients as the plain formula."""
    from megatron_rl.distributed.runtime import destroy_distributed, init_distributed
    from megatron_rl.models.builder import build_model

    init_distributed(1, 1, seed=0)
    try:
        args = ModelArgs.from_hf_config(tiny_hf_config("llama", vocab_size=256, tie_word_embeddings=False))
        model = build_model(args, "actor", backend="local", lora=LoRAConfig(rank=4, alpha=8))
        ids = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(0))
        with _MatmulLog() as log:
            model(ids, torch.arange(10).expand(3, 10), None).logsumexp(-1).mean().backward()
        assert log.ops and all(op == "mm" for op, _, _ in log.ops), [o for o in log.ops if o[0] != "mm"]

        model.zero_grad(set_to_none=True)
        proj = model.decoder.layers[0].self_attention.linear_proj
        torch.nn.init.normal_(proj.lora_B, generator=torch.Generator().manual_seed(1))
        x = torch.randn(3, 10, proj.input_size).transpose(0, 1).requires_grad_()  # [T, B, in], strided
        with _MatmulLog() as log:
            out, _ = proj(x)
            out.square().sum().backward()
        assert all(op == "mm" for op, _, _ in log.ops), log.ops
        x_ref = x.detach().clone().requires_grad_()
        a, b = proj.lora_A.detach().clone().requires_grad_(), proj.lora_B.detach().clone().requires_grad_()
        ref = x_ref @ proj.weight.t() + proj.lora_scale * (x_ref @ a.t()) @ b.t()
        ref.square().sum().backward()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(proj.lora_A.grad, a.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(proj.lora_B.grad, b.grad, rtol=1e-5, atol=1e-5)
    finally:
        destroy_distributed()


def test_lora_backward_runs_no_frozen_weight_gradient_and_no_bmm():
    """The trainer's forward/backward (LM head at the response positions only, ``set_head_positions``):
    with LoRA every matmul is one 2D GEMM and the frozen weights get no weight-gradient GEMM, so its
    FLOPs are at most ~2/3 of full fine-tuning's plus the adapters'. The head's output gradient is
    [B*R, 1, V] with strides (V, B*R*V, 1): ``is_contiguous()`` but not foldable by matmul, which ran it
    as B*R GEMVs of the frozen [V, h] head (session 7's 8B LoRA update at 2.4x full fine-tuning's time).
    The adapters' gradients equal those through the full-length head gathered at the same positions."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_rl.distributed.runtime import destroy_distributed, init_distributed
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.head import set_head_positions

    init_distributed(1, 1, seed=0)
    try:
        args = ModelArgs.from_hf_config(tiny_hf_config("llama", vocab_size=512, tie_word_embeddings=False))
        b, t, r = 3, 12, 7
        ids = torch.randint(0, 512, (b, t), generator=torch.Generator().manual_seed(0))
        pos, score = (
            torch.arange(t).expand(b, t),
            torch.arange(t - r - 1, t - 1).expand(b, r),
        )  # [B, T], [B, R]
        flops, grads = {}, {}
        for mode in ("lora", "full", "lora_full_head"):
            torch.manual_seed(0)
            lora = None if mode == "full" else LoRAConfig(rank=2, alpha=4)
            model = build_model(args, "actor", backend="local", lora=lora)
            if lora is not None:
                for _, p in sorted((n, p) for n, p in model.named_parameters() if n.endswith("lora_B")):
                    torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(p.numel()))
            if mode != "lora_full_head":
                set_head_positions(model, score)
            with _MatmulLog() as log, FlopCounterMode(display=False) as fc:
                logits = model(ids, pos, None)  # [1, B*R, V] or [B, T, V]
                if mode == "lora_full_head":
                    logits = logits[torch.arange(b)[:, None], score]  # [B, R, V]
                logits.float().logsumexp(-1).square().mean().backward()
            flops[mode] = fc.get_total_flops()
            if lora is not None:
                assert log.ops and all(op == "mm" for op, _, _ in log.ops), [
                    o for o in log.ops if o[0] != "mm"
                ]
                grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
                assert grads[mode] and all(n.endswith(("lora_A", "lora_B")) for n in grads[mode])
        # forward + dgrad + the adapters: 0.69 of full fine-tuning here (>= 1 if frozen wgrads were computed)
        assert flops["lora"] <= 0.75 * flops["full"], flops
        assert grads["lora"].keys() == grads["lora_full_head"].keys()
        for n, g in grads["lora"].items():
            torch.testing.assert_close(g, grads["lora_full_head"][n], rtol=1e-5, atol=1e-6, msg=n)

        # full fine-tuning's frozen reference model: a strided input (flash SDPA's output) is one GEMM too
        proj = build_model(args, "ref", backend="local").decoder.layers[0].self_attention.linear_proj
        x = torch.randn(3, t, proj.input_size).transpose(0, 1)  # [T, B, in], strided
        with torch.no_grad(), _MatmulLog() as log:
            out, _ = proj(x)
        assert [op for op, _, _ in log.ops] == ["mm"], log.ops
        torch.testing.assert_close(out, x @ proj.weight.t(), rtol=1e-5, atol=1e-5)
    finally:
        destroy_distributed()
