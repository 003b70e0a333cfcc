"""Sampling: temperature, top-k, top-p, greedy; and the log-prob the trainer recomputes.

Log-prob convention: the returned log-prob of a sampled token is ``log_softmax(logits / T)[token]`` over
the *full* vocabulary, i.e. the temperature-scaled distribution the trainer recomputes from its own
forward pass. Top-k / top-p truncation is *not* folded in (the truncated distribution's log-prob would
be higher by ``-log(kept mass)``); this matches verl/OpenRLHF practice and keeps rollout and training
log-probs comparable. Greedy decoding (``temperature == 0``) reports ``log_softmax(logits)`` (T = 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings; field names match the ``rollout.*`` / ``generate.*`` config keys."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = -1  # keep the k most likely tokens; -1 = off
    n: int = 1  # samples per prompt
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # EOS plus any configured stop ids
    seed: int = 0
    # noise from (seed, prompt key, sample index, step): samples independent of layout and batching
    layout_invariant: bool = False

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, f"rollout.temperature={self.temperature} must be >= 0 (0 = greedy)."),
            (0 < self.top_p <= 1, f"rollout.top_p={self.top_p} must be in (0, 1]; use 1.0 to disable."),
            (self.top_k == -1 or self.top_k >= 1, f"rollout.top_k={self.top_k} must be -1 (off) or >= 1."),
            (self.n >= 1, f"rollout.n={self.n} must be >= 1."),
            (self.max_new_tokens >= 1, f"rollout.max_new_tokens={self.max_new_tokens} must be >= 1."),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def truncate_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """scaled [B, V] temperature-scaled logits -> same with tokens outside top-k / top-p set to -inf.

    Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (the token that
    crosses the threshold is kept, so at least one token always survives).
    """
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # [B, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)  # [B, V]
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T, without a pass over [B, V] when T is 1 or 0 (greedy scores with T = 1)."""
    return logits if temperature in (0.0, 1.0) else logits / temperature


_MASK = {30: (1 << 34) - 1, 27: (1 << 37) - 1, 31: (1 << 33) - 1}  # logical >> on int64


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps), a counter-based hash."""
    x = x ^ ((x >> 30) & _MASK[30])
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = x ^ ((x >> 27) & _MASK[27])
    x = x * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & _MASK[31])


def counter_log_exponential(row_keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """log of Exp(1) noise [B, V] that is a pure function of (row key, token id): row_keys [B] int64."""
    ids = torch.arange(vocab, device=row_keys.device)
    golden = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
    bits = (mix64(row_keys[:, None] * golden + ids) >> 40) & 0xFFFFFF  # [B, V] 24 uniform bits
    u = (bits.float() + 0.5) * (1.0 / (1 << 24))  # (0, 1)
    return torch.log(-torch.log(u))


def sample_row_keys(seq_keys: torch.Tensor, steps: torch.Tensor, seed: int) -> torch.Tensor:
    """Key [B] of one sampling step: (seed, sequence key, index of the token in the response)."""
    seeded = mix64(torch.full_like(seq_keys, seed)) ^ seq_keys
    return mix64(mix64(seeded) + steps)


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    row_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] (fp32) -> sampled tokens [B] int64 (argmax when greedy).

    Exponential race in the log domain: with E ~ Exp(1) per token, ``argmax(p / E)`` samples from p, and
    ``argmax(log p - log E) = argmax(scaled - log E)`` needs no softmax (the normaliser is a per-row
    constant). Without top-k / top-p nothing is sorted or masked. With ``row_keys`` [B] the noise is a
    hash of (key, token id) instead of ``generator`` draws, so a sequence's samples do not depend on the
    rows it shares a batch with (layout- and batching-invariant sampling; slower).
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    kept = truncate_logits(_scaled(logits, params.temperature), params.top_k, params.top_p)
    if row_keys is not None:
        return (kept - counter_log_exponential(row_keys, kept.shape[-1])).argmax(dim=-1)
    log_noise = torch.empty_like(kept).exponential_(generator=generator).log_()  # [B, V]
    return torch.sub(kept, log_noise, out=log_noise).argmax(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [B, V], tokens [B] -> log-probs [B] under the temperature-scaled full softmax
    (``temperature == 0`` scores with T = 1; see the module docstring)."""
    # the fused log_softmax kernel beats logsumexp's several passes over [B, V] on GPU
    return torch.log_softmax(_scaled(logits, temperature), dim=-1).gather(-1, tokens[:, None])[:, 0]
