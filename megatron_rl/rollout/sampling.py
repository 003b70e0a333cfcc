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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] (fp32) -> sampled tokens [B] int64 (argmax when greedy).

    Exponential race in the log domain: with E ~ Exp(1) per token, ``argmax(p / E)`` samples from p, and
    ``argmax(log p - log E) = argmax(scaled - log E)`` needs no softmax (the normaliser is a per-row
    constant). Without top-k / top-p nothing is sorted or masked.
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    kept = truncate_logits(_scaled(logits, params.temperature), params.top_k, params.top_p)
    log_noise = torch.empty_like(kept).exponential_(generator=generator).log_()  # [B, V]
    return torch.sub(kept, log_noise, out=log_noise).argmax(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [B, V], tokens [B] -> log-probs [B] under the temperature-scaled full softmax
    (``temperature == 0`` scores with T = 1; see the module docstring)."""
    # the fused log_softmax kernel beats logsumexp's several passes over [B, V] on GPU
    return torch.log_softmax(_scaled(logits, temperature), dim=-1).gather(-1, tokens[:, None])[:, 0]
