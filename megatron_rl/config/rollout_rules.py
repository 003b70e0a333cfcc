"""The rules a rollout setting must obey, defined once: the engine's own types (``SamplingParams``,
``EngineConfig``) check them when built, and start-up validation checks the configured values with the
same functions before any process group or weights exist. Messages name the ``rollout.*`` key."""

from __future__ import annotations


def check_sampling(*, temperature: float, top_p: float, top_k: int, n: int, max_new_tokens: int, key="rollout.temperature") -> None:  # fmt: skip
    """Raise ``ValueError`` naming the key of the first impossible sampling value. ``key``: the
    temperature's key (``rollout.temperature`` or ``rollout.val_temperature``)."""
    checks = [
        (temperature >= 0, f"{key}={temperature} must be >= 0 (0 = greedy)."),
        (0 < top_p <= 1, f"rollout.top_p={top_p} must be in (0, 1]; use 1.0 to disable."),
        (top_k == -1 or top_k >= 1, f"rollout.top_k={top_k} must be -1 (off) or >= 1."),
        (n >= 1, f"rollout.n={n} must be >= 1."),
        (max_new_tokens >= 1, f"rollout.max_new_tokens={max_new_tokens} must be >= 1."),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def check_engine(*, gpu_memory_utilization: float, max_num_seqs: int, max_prefill_tokens: int, kv_cache_tokens: int | None) -> None:  # fmt: skip
    """Raise ``ValueError`` naming the key of the first impossible engine setting."""
    checks = [
        (0 < gpu_memory_utilization <= 1, f"rollout.gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]."),
        (max_num_seqs >= 1, f"rollout.max_num_seqs={max_num_seqs} must be >= 1."),
        (max_prefill_tokens >= 1, f"rollout.max_prefill_tokens={max_prefill_tokens} must be >= 1."),
        (kv_cache_tokens is None or kv_cache_tokens >= 0,
         f"rollout.kv_cache_tokens={kv_cache_tokens} must be >= 0 (0 = sized from the batch)."),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
