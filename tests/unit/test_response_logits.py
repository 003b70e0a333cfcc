"""The LM head scores response tokens only (``models.pipeline.ResponseLogits``): on a micro-batch of uneven
response lengths it runs over sum(response lengths) rows, not rows x the longest response, and the
log-probs, entropies and every parameter's gradient equal those of the full [B, R] frame (the padding cells
computed and masked, as before). Padded rows, packed rows and shared prompts; one process, fp32, CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "workers"))
from rollout_common import spec_of, tiny_hf  # noqa: E402

from megatron_rl.distributed.runtime import destroy_distributed, init_distributed  # noqa: E402
from megatron_rl.models import pipeline  # noqa: E402
from megatron_rl.models.builder import build_model  # noqa: E402
from megatron_rl.models.weights import load_hf_weights, unwrap  # noqa: E402
from megatron_rl.rollout.batch import build_batch, trim  # noqa: E402
from megatron_rl.rollout.engine import Completion  # noqa: E402
from megatron_rl.rollout.packing import pack  # noqa: E402
from megatron_rl.rollout.shared_prompts import share  # noqa: E402
from megatron_rl.trainer.workers import response_log_probs  # noqa: E402

R, TEMP = 9, 0.7
RESPONSE_LENS = [9, 2, 5, 1, 7, 3]  # groups of 2 sharing a prompt: 27 of 54 frame cells are tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    init_distributed(1, 1, seed=0)
    hf = tiny_hf("qwen2")
    out = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(out, safe_serialization=True)
    args = spec_of(hf)
    model = build_model(args, "actor", torch.float32, backend="local")
    load_hf_weights(model, out, args)
    yield model, args
    destroy_distributed()


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    done = []
    for i, n in enumerate(RESPONSE_LENS):
        prompt = torch.randint(1, vocab - 1, (4 + i // 2,), generator=torch.Generator().manual_seed(i // 2))
        done.append(Completion(i // 2, i % 2, prompt.tolist(), torch.randint(1, vocab - 1, (n,), generator=g).tolist(),
                               [0.0] * n, "stop"))  # fmt: skip
    return build_batch(done, [None] * 3, 0, R, 0, torch.device("cpu"))


def _run(model, args, mb):
    """(lp, ent, {name: grad}, LM-head input rows) of one update micro-batch."""
    head = unwrap(model).output_layer
    seen = []
    handle = head.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[0] * a[0].shape[1]))

    def loss_fn(mb, logits):
        lp, ent = response_log_probs(logits, mb, TEMP, args.vocab_size, with_entropy=True)
        w = torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)  # every cell its own weight
        return ((lp + 0.1 * ent) * w * mb.response_mask).sum(), {"lp": lp.detach(), "ent": ent.detach()}

    model.train()
    out = pipeline.run_micro_batches(model, [mb], loss_fn, forward_only=False, response_logits=True)[0]
    handle.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out["lp"], out["ent"], grads, seen[0]


@pytest.mark.parametrize("head", ["response", "every_position"])
@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_the_head_scores_response_tokens_only_with_the_full_frames_results(setup, layout, head, monkeypatch):
    """``every_position``: the head over every position (as under sequence parallelism), the response
    tokens' rows taken out of its output."""
    model, args = setup
    ways = {"padded": lambda mb: mb, "packed": pack, "shared": share}
    mb = ways[layout](trim(_batch(args.vocab_size)))
    if head == "every_position":
        monkeypatch.setattr(pipeline, "head_on_response", lambda model, mb: False)
    lp, ent, grads, rows = _run(model, args, mb)
    monkeypatch.setattr(pipeline, "response_cells", lambda mb: None)  # the whole [B, R] frame, as before
    lp_all, ent_all, grads_all, rows_all = _run(model, args, mb)
    if head == "response":
        assert rows == sum(RESPONSE_LENS) == 27 and rows_all == len(RESPONSE_LENS) * R == 54
    live = mb.response_mask.bool()
    assert torch.allclose(lp[live], lp_all[live], atol=1e-6, rtol=0)
    assert torch.allclose(ent[live], ent_all[live], atol=1e-6, rtol=0)
    assert (lp[~live] == 0).all() and (ent[~live] == 0).all() and (lp_all[~live] != 0).any()
    for name, g in grads.items():
        assert torch.allclose(g, grads_all[name], atol=1e-6, rtol=1e-5), name
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_a_micro_batch_without_response_tokens_runs(setup):
    """Every response empty: one padding cell is scored (masked by the loss), so no kernel sees 0 rows."""
    model, args = setup
    done = [Completion(0, i, [5, 6, 7], [], [], "stop") for i in range(2)]
    mb = trim(build_batch(done, [None], 0, R, 0, torch.device("cpu")))
    lp, ent, grads, rows = _run(model, args, mb)
    assert rows == 1 and lp.shape == ent.shape == (2, 1)
    assert all(torch.isfinite(g).all() and not g.any() for g in grads.values())


def test_each_pass_releases_ropes_cached_tables(setup, monkeypatch):
    """run_micro_batches drops kernels.rope's cos / sin tables when its pass ends (not held through generation)."""
    from megatron_rl.kernels import rope

    model, args = setup
    monkeypatch.setattr(
        rope, "_TABLES", [((), (), torch.zeros(1), torch.zeros(1))]
    )  # a compiled RoPE's leftover
    _run(model, args, share(trim(_batch(args.vocab_size))))
    assert not rope._TABLES


def test_cells_are_the_response_tokens_of_each_row():
    class MB:
        response_lens = torch.tensor([2, 0, 3])
        score_pos = torch.zeros(3, 3, dtype=torch.long)

    assert pipeline.response_cells(MB()).tolist() == [0, 1, 6, 7, 8]
    MB.response_lens = torch.tensor([3, 3, 3])
    assert pipeline.response_cells(MB()) is None  # nothing to drop: the frame as it is
    MB.response_lens = torch.tensor([0, 0, 0])
    assert pipeline.response_cells(MB()).tolist() == [0]  # one padding cell: no kernel sees 0 rows
    logits = pipeline.ResponseLogits(torch.arange(5.0)[:, None], torch.tensor([0, 1, 6, 7, 8]), 3, 3)
    assert logits.frame(logits.values)[..., 0].tolist() == [[0, 1, 0], [0, 0, 0], [2, 3, 4]]
    assert logits.pick(torch.arange(9).view(3, 3)).tolist() == [0, 1, 6, 7, 8]
