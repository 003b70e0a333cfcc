"""World 4 on CPU/gloo: parallel_state layouts and a ColumnParallel/RowParallel pair vs nn.Linear."""

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron_rl.distributed import init_distributed, seed_everything


def check_layout(tp, pp, expect_tp, expect_pp, expect_dp):
    dims = init_distributed(tp, pp, seed=7)
    rank = dist.get_rank()
    assert (dims.tp, dims.pp, dims.dp) == (tp, pp, 4 // (tp * pp))
    groups = {
        "tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
        "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        "dp": dist.get_process_group_ranks(ps.get_data_parallel_group()),
    }
    for name, expected in (("tp", expect_tp), ("pp", expect_pp), ("dp", expect_dp)):
        assert groups[name] == expected[rank], f"rank {rank} {name} group {groups[name]} != {expected[rank]}"


def check_parallel_linear_pair():
    init_distributed(2, 1, seed=11)
    tp_rank = ps.get_tensor_model_parallel_rank()
    torch.manual_seed(0)
    w1, w2 = torch.randn(32, 16, dtype=torch.float64), torch.randn(16, 32, dtype=torch.float64)
    x = torch.randn(5, 3, 16, dtype=torch.float64, requires_grad=True)  # [T, B, h]
    ref1, ref2 = torch.nn.Linear(16, 32, bias=False).double(), torch.nn.Linear(32, 16, bias=False).double()
    ref1.weight.data.copy_(w1)
    ref2.weight.data.copy_(w2)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = ref2(torch.relu(ref1(x_ref)))
    y_ref.square().sum().backward()

    cfg = ModelParallelConfig(
        tensor_model_parallel_size=2, use_cpu_initialization=True, params_dtype=torch.float64
    )
    col = ColumnParallelLinear(
        16, 32, config=cfg, init_method=torch.nn.init.zeros_, bias=False, gather_output=False
    )
    row = RowParallelLinear(
        32,
        16,
        config=cfg,
        init_method=torch.nn.init.zeros_,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=True,
    )
    col.weight.data.copy_(w1.chunk(2, dim=0)[tp_rank])
    row.weight.data.copy_(w2.chunk(2, dim=1)[tp_rank])
    h, _ = col(x)
    y, _ = row(torch.relu(h))
    y.square().sum().backward()
    assert torch.allclose(y, y_ref, atol=1e-12), (y - y_ref).abs().max()
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-12)
    assert torch.allclose(col.weight.grad, ref1.weight.grad.chunk(2, dim=0)[tp_rank], atol=1e-12)
    assert torch.allclose(row.weight.grad, ref2.weight.grad.chunk(2, dim=1)[tp_rank], atol=1e-12)


def check_seeding_is_reproducible():
    seed_everything(5)
    a = torch.rand(4)
    seed_everything(5)
    assert torch.equal(a, torch.rand(4))
    gathered = [torch.zeros(4) for _ in range(4)]
    dist.all_gather(gathered, a)
    assert all(torch.equal(g, a) for g in gathered), "DP/TP ranks share the base seed"


if __name__ == "__main__":
    # TP=2 x PP=2: megatron-core orders tp fastest, then dp, then pp.
    check_layout(
        2,
        2,
        {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]},
        {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]},
        {r: [r] for r in range(4)},
    )
    check_layout(
        2,
        1,
        {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]},
        {r: [r] for r in range(4)},
        {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]},
    )
    check_parallel_linear_pair()
    check_seeding_is_reproducible()
    if dist.get_rank() == 0:
        print("foundation checks passed")
