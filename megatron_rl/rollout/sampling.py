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

from megatron_rl.config.rollout_rules import check_sampling
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.kernels import batch_invariant
from megatron_rl.kernels import sampler as sampler_kernel
from megatron_rl.kernels.compile import compile_enabled, compile_rows_dynamic, probe, trial_once

_ROLLOUT = RolloutConfig()  # the defaults below are the rollout.* keys' own (defined once, in the schema)


def logprob_temperature(temperature: float) -> float:
    """The temperature log-probs are scored at, in the engine and in training: the sampling temperature,
    or 1.0 for greedy decoding (``temperature == 0``: there is no distribution to divide by zero)."""
    return temperature if temperature > 0 else 1.0


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings; field names and defaults are the ``rollout.*`` config keys'. The trainer
    and ``megatron-rl generate`` build them with ``from_config``."""

    temperature: float = _ROLLOUT.temperature  # 0 = greedy
    top_p: float = _ROLLOUT.top_p  # nucleus mass in (0, 1]; 1 = off
    top_k: int = _ROLLOUT.top_k  # keep the k most likely tokens; -1 = off
    n: int = _ROLLOUT.n  # samples per prompt
    max_new_tokens: int = _ROLLOUT.max_new_tokens
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # EOS plus any configured stop ids
    seed: int = 0
    # noise from (seed, prompt key, sample index, step): samples independent of layout and batching
    layout_invariant_sampling: bool = _ROLLOUT.layout_invariant_sampling

    def __post_init__(self):
        check_sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, n=self.n,
                       max_new_tokens=self.max_new_tokens)  # fmt: skip
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @classmethod
    def from_config(
        cls, rollout: RolloutConfig, *, temperature: float, n: int, seed: int, eos_token_id: int | None
    ) -> SamplingParams:
        """The one place a ``rollout`` config section becomes sampling settings: the call's temperature
        (training or validation), group size and seed; stops are the tokenizer's EOS plus
        ``rollout.stop_token_ids``."""
        stops = [eos_token_id, *rollout.stop_token_ids]
        return cls(
            temperature=temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            n=n,
            max_new_tokens=rollout.max_new_tokens,
            stop_token_ids=tuple(s for s in stops if s is not None),
            seed=seed,
            layout_invariant_sampling=rollout.layout_invariant_sampling,
        )

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
    t = logprob_temperature(temperature)
    return logits if t == 1.0 else logits / t


_MASK = {30: (1 << 34) - 1, 27: (1 << 37) - 1, 31: (1 << 33) - 1}  # logical >> on int64
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps), a counter-based hash."""
    x = x ^ ((x >> 30) & _MASK[30])
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = x ^ ((x >> 27) & _MASK[27])
    x = x * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & _MASK[31])


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply) on int64 tensors holding values < 2^32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def counter_log_exponential(
    row_keys: torch.Tensor, vocab: int, ids: torch.Tensor | None = None
) -> torch.Tensor:
    """log of Exp(1) noise [B, V] that is a pure function of (row key, token id): row_keys [B] int64.

    32-bit arithmetic per element (the row keys are mixed once with 64 bits) keeps it cheap enough to
    be recomputed inside the fused sampling kernel instead of being stored. ``ids`` ([1, V] int64, the
    token ids) may be passed in: compiled code then multiplies loaded int64 values, where an ``arange``
    would become a 32-bit index that Triton cannot multiply by a 32-bit constant."""
    if ids is None:
        ids = torch.arange(vocab, device=row_keys.device)[None]  # [1, V]
    key = mix64(row_keys) & _M32  # [B]
    bits = _hash32((key[:, None] + ids * 0x9E3779B9) & _M32) >> 9  # [B, V] 23 uniform bits
    # (bits + 0.5) / 2^23 is exact in fp32 and strictly inside (0, 1). With 24 bits, 2^24 - 0.5 rounded to 2^24:
    # u = 1, noise -inf, and that token won whatever its logit (about 0.9% of rows at a 151,936 vocab).
    u = (bits.float() + 0.5) * (1.0 / (1 << 23))
    return torch.log(-torch.log(u))


# The noisy draw in two levels (``block_race``): blocks of SAMPLE_BLOCK token ids, each block's noise counted
# at 2^31 + its index (token ids stay below 2^31, so the two counters never meet)
SAMPLE_BLOCK = sampler_kernel.SAMPLE_BLOCK  # 1024
_BLOCK_COUNTER = 1 << 31


def _blocks(z: torch.Tensor, block: int, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """z [B, V] padded with -inf to nb x ``block`` ids and viewed as [B, nb, block], and ``ids`` (``block_race``'s;
    made here when None)."""
    rows, vocab = z.shape
    nb = -(-vocab // block)
    if ids is None:
        ids = torch.arange(max(block, nb), device=z.device)[None]
    return torch.nn.functional.pad(z, (0, nb * block - vocab), value=float("-inf")).view(rows, nb, block), ids


def _scores(zb: torch.Tensor, row_keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``block_scores`` of the padded blocks zb [B, nb, block]."""
    top = zb.amax(dim=-1, keepdim=True)  # [B, nb, 1]
    top = torch.where(top == float("-inf"), 0.0, top)  # all -inf: a sum of 0, log -inf
    lse = top[..., 0].double() + torch.exp(zb - top).sum(dim=-1, dtype=torch.float64).log()
    lse = torch.where(top[..., 0] == float("inf"), float("inf"), lse)  # inf - inf made its sum NaN
    nb = zb.shape[1]
    return lse - counter_log_exponential(row_keys, nb, _BLOCK_COUNTER + ids[:, :nb]).double()


def _inside(zb: torch.Tensor, row_keys: torch.Tensor, k: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``race_inside`` on the padded blocks zb [B, nb, block]."""
    rows, _, block = zb.shape
    inside = zb.gather(1, k[:, None, None].expand(rows, 1, block))[:, 0]  # [B, block]
    ids = k[:, None] * block + ids[:, :block]  # [B, block] the block's token ids
    return k * block + (inside - counter_log_exponential(row_keys, block, ids)).argmax(dim=-1)


def block_scores(
    z: torch.Tensor, row_keys: torch.Tensor, block: int = SAMPLE_BLOCK, ids=None
) -> torch.Tensor:
    """``block_race``'s first level: each block's score [B, nb] (float64): the log-sum-exp of its ``block`` ids'
    z (padded with -inf to nb x block) minus log E_k, the counter noise at 2^31 + k. Each block's max is taken
    in fp32 and its sum of exp(z - max) accumulated in fp64, so a block's score depends on the order the sum
    runs in (a batch's size may change that order on a GPU) only at ~1e-15: ``rollout.layout_invariant_sampling``
    rows draw alike in any batch on every path. A block holding +inf scores +inf. ``ids``: ``block_race``'s."""
    zb, ids = _blocks(z, block, ids)
    return _scores(zb, row_keys, ids)


def block_race(
    z: torch.Tensor, row_keys: torch.Tensor, block: int = SAMPLE_BLOCK, ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Tokens [B] drawn from ``softmax(z)`` (z [B, V] fp32, -inf allowed) with the counter noise of
    ``row_keys`` [B] in two levels: the block k of ``block`` token ids with the best ``block_scores`` (its
    log-sum-exp minus log E_k, E_k ~ Exp(1) at counter 2^31 + k), then inside it the id with the largest
    ``z - log E`` (the token's own noise, counter = its id). Exact: block k wins with probability mass_k /
    mass (an exponential race over the blocks' masses), and inside it the race picks i with probability
    exp(z_i) / mass_k. A draw hashes about V / block + block counters instead of V, so the Triton sampler's
    pass over the logits is a log-sum-exp pass. Ties go to the lowest block, then the lowest id
    (``argmax``); all -inf: token 0. ``ids`` ([1, n] int64 0..n-1, n >= block and >= the block count;
    ``_token_ids``): as in ``counter_log_exponential``, loaded values for compiled code instead of
    ``arange`` s."""
    zb, ids = _blocks(z, block, ids)  # padded once for both levels
    return _inside(zb, row_keys, _scores(zb, row_keys, ids).argmax(dim=-1), ids)


def race_inside(z: torch.Tensor, row_keys: torch.Tensor, k: torch.Tensor, block: int = SAMPLE_BLOCK,
                ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``block_race``'s second level: in block k [B] of each row, the token with the largest z - log E."""
    zb, ids = _blocks(z, block, ids)
    return _inside(zb, row_keys, k, ids)


def sample_row_keys(seq_keys: torch.Tensor, steps: torch.Tensor, seed: int) -> torch.Tensor:
    """Key [B] of one sampling step: (seed, sequence key, index of the token in the response)."""
    seeded = mix64(torch.full_like(seq_keys, seed)) ^ seq_keys
    return step_row_keys(mix64(seeded), steps)


def step_row_keys(seeded: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``sample_row_keys`` from the sequences' ``seeded_key`` s [B] (int64): the per-step half."""
    return mix64(seeded + steps)


def _mix64_int(x: int) -> int:
    """``mix64`` of one Python int, modulo 2^64 (unsigned)."""
    x &= _M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def seeded_key(seq_key: int, seed: int) -> int:
    """The per-sequence half of ``sample_row_keys``, ``mix64(mix64(seed) ^ seq_key)``, on the host (an int64);
    ``seq_key`` and ``seed`` are int64 values (as the tensors ``sample_row_keys`` takes hold)."""
    seq_key, seed = int(seq_key), int(seed)
    for name, v in (("sequence key", seq_key), ("seed", seed)):
        if not -(1 << 63) <= v < 1 << 63:
            raise ValueError(f"sampling {name} {v} is not an int64")
    x = _mix64_int(_mix64_int(seed) ^ (seq_key & _M64))
    return x - (1 << 64) if x >= 1 << 63 else x


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    row_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] (fp32) -> sampled tokens [B] int64 (argmax when greedy).

    Exponential race in the log domain: with E ~ Exp(1) per token, ``argmax(p / E)`` samples from p, and
    ``argmax(log p - log E) = argmax(scaled - log E)`` needs no softmax (the normaliser is a per-row
    constant). Without top-k / top-p nothing is sorted or masked. With ``row_keys`` [B] the draw is
    ``block_race`` (the same distribution in two levels: a block by its log-sum-exp, then the token inside
    it, the noise a hash of (key, counter) instead of ``generator`` draws), so a sequence's samples do not
    depend on the rows it shares a batch with (layout- and batching-invariant sampling; slower).
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    kept = truncate_logits(_scaled(logits, params.temperature), params.top_k, params.top_p)
    if row_keys is not None:
        return block_race(kept, row_keys)
    log_noise = torch.empty_like(kept).exponential_(generator=generator).log_()  # [B, V]
    return torch.sub(kept, log_noise, out=log_noise).argmax(dim=-1)


def _draw(logits: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor, inv_temp: float, noisy: bool):
    """logits [B, V], keys [B] int64, ids [1, max(V, SAMPLE_BLOCK)] (``_token_ids``) -> tokens [B]
    (``block_race``, or the argmax when not ``noisy``), log-sum-exp [B] of the scaled logits (fp32).
    Compiled: fused reductions over the logits with the noise computed in registers."""
    z = logits.float() * inv_temp
    lse = torch.logsumexp(z, dim=-1)
    return (block_race(z, keys, ids=ids) if noisy else z.argmax(dim=-1)), lse


_FUSED_DRAW = compile_rows_dynamic(_draw)


def _kernel_draw(logits: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor, inv_temp: float, noisy: bool):
    """``_draw`` by the Triton sampler (``kernels.sampler``; ``ids`` unused), the row keys mixed in the
    kernel -> tokens, log-sum-exp and the tokens' log-probs (the eager ops' bits)."""
    return sampler_kernel.draw(logits, keys, inv_temp, noisy, block=SAMPLE_BLOCK, mix=True, logprobs=True)


_KERNEL = "the Triton sampler"
_KERNEL_FALLBACK = "The Triton sampler failed its trial; the compiled (or eager) sampler serves instead."


def _drawer(logits: torch.Tensor, layout_invariant: bool = False):
    """The fastest draw that serves ``logits``: the Triton kernel, the compiled ``_draw``, or None (eager
    ``sample`` then ``token_logprobs``). ``layout_invariant`` (per-row keys given): the Triton kernel at
    every batch size where it serves, so the path does not change with the decode bucket (on CUDA it serves
    every batch size anyway since session 22, ``kernels.sampler.CUDA_MIN_ROWS``; this keeps it so if that
    threshold rises again)."""
    if sampler_kernel.usable(logits, any_rows=layout_invariant) and trial_once(
        _KERNEL, lambda: _kernel_trial(logits), _KERNEL_FALLBACK
    ):
        return _kernel_draw
    return _FUSED_DRAW if _fused_ok(logits) else None


def _kernel_trial(logits: torch.Tensor) -> None:
    """The Triton sampler once on (up to) four rows of the real logits against eager ``_draw``, noisy and
    greedy: raises when it fails or its tokens differ (host syncs, at the first call only)."""
    rows = logits[:4]
    keys = _TRIAL_KEY * torch.arange(rows.shape[0], device=logits.device)
    for noisy in (True, False):
        drawn = _kernel_draw(rows, keys, _token_ids(logits), 0.7, noisy)
        _check_draw(rows, keys, noisy, *drawn, lp_atol=0.0)


_TRIAL_KEY = 0x5DEECE66D  # the trials' row keys: multiples of it


def _check_draw(logits, keys, noisy: bool, tokens, lse, lp, lp_atol: float) -> None:
    """A kernel's draw at inv_temp 0.7 (tokens, log-sum-exp, log-probs) against eager ``_draw`` on ``logits``:
    raises unless the tokens are equal (or differ only where two blocks' scores nearly tie:
    ``_near_tied_blocks``), the log-sum-exp within 1e-5 and the log-probs the eager ``picked - lse`` (exactly
    with ``lp_atol`` 0)."""
    if not bool(((tokens >= 0) & (tokens < logits.shape[-1])).all()):  # before any gather at those ids
        raise RuntimeError(f"tokens {tokens.tolist()} outside the vocab of {logits.shape[-1]}")
    want, want_lse = _draw(logits, keys, _token_ids(logits), 0.7, noisy)
    if not torch.equal(tokens, want) and not (
        noisy and _near_tied_blocks(logits.float() * 0.7, keys, tokens)
    ):
        raise RuntimeError(f"tokens {tokens.tolist()} != the reference's {want.tolist()} (noisy={noisy})")
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    picked = logits.gather(-1, tokens[:, None])[:, 0].float() * 0.7  # inv_temp 0.7, as drawn
    if not torch.allclose(lp, picked - lse, rtol=0, atol=lp_atol):
        raise RuntimeError(f"log-probs {lp.tolist()} != the eager ops' {(picked - lse).tolist()}")


def _near_tied_blocks(z: torch.Tensor, keys: torch.Tensor, tokens: torch.Tensor, atol: float = 1e-4) -> bool:
    """Whether each token is ``block_race``'s inside its own block and that block's score is within ``atol``
    plus 8 fp32 roundings of the row's best score: a kernel that sums a block's log-sum-exp in fp32 (a few 1e-6
    off at scores of ~30) may pick another block where two blocks' scores lie that close, and only there."""
    k = tokens // SAMPLE_BLOCK
    zb, ids = _blocks(z, SAMPLE_BLOCK, None)
    scores = _scores(zb, keys, ids)
    best = scores.amax(dim=-1)
    near = scores.gather(1, k[:, None])[:, 0] >= best - (atol + 8 * 2**-23 * best.abs())
    return bool(near.all()) and torch.equal(tokens, _inside(zb, keys, k, ids))


def _fused_ok(logits: torch.Tensor) -> bool:
    if not compile_enabled(logits.device):
        return False
    return probe("the fused sampler", logits.device, lambda: _trial(logits))


def _trial(logits: torch.Tensor) -> None:
    """The compiled sampler once on two rows (compile errors surface here, not mid-generation)."""
    keys = torch.zeros(2, dtype=torch.long, device=logits.device)
    _FUSED_DRAW(logits[:2], keys, _token_ids(logits), 1.0, True)


_IDS: dict = {}


def _token_ids(logits: torch.Tensor) -> torch.Tensor:
    """[1, max(V, SAMPLE_BLOCK)] int64 ids 0, 1, ... on the logits' device (kept: one per vocab size and
    device): ``block_race``'s ``ids``."""
    key = (logits.shape[-1], logits.device)
    if key not in _IDS:
        _IDS[key] = torch.arange(max(logits.shape[-1], SAMPLE_BLOCK), device=logits.device)[None]
    return _IDS[key]


def _draw_keys(x: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
               row_keys: torch.Tensor | None) -> tuple[torch.Tensor, float]:  # fmt: skip
    """The noise keys [B] of a one-pass draw over the B rows of ``x`` and its inverse temperature: ``row_keys``,
    else one int64 per row from ``generator`` (zeros when greedy: no noise)."""
    if row_keys is None and not params.greedy:
        row_keys = torch.randint(-(2**62), 2**62, x.shape[:1], device=x.device, generator=generator)
    keys = row_keys if row_keys is not None else torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    return keys, 1.0 / logprob_temperature(params.temperature)


def sample_with_logprobs(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    row_keys: torch.Tensor | None = None,
    share_tokens=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype) -> sampled tokens [B] int64 and their log-probs [B] (fp32; see the
    module docstring for the convention). ``share_tokens(tokens)``, when given, makes every rank use one
    rank's tokens (generation TP) before the log-probs are read.

    Without top-k / top-p, one pass samples and computes the log-sum-exp: the Triton sampler
    (``kernels.sampler``) where it serves, else the compiled ``_draw`` where ``kernels.compile`` allows;
    its noise is ``counter_log_exponential`` of ``row_keys``, or of keys drawn from ``generator`` (one
    int64 per row and step). Otherwise ``sample`` then ``token_logprobs``."""
    temperature = params.temperature
    draw = None if params.top_k > 0 or params.top_p < 1.0 else _drawer(logits, row_keys is not None)
    if draw is None:
        logits = logits.float()
        tokens = sample(logits, params, generator, row_keys)
        if share_tokens is not None:
            tokens = share_tokens(tokens)
        return tokens, token_logprobs(logits, tokens, temperature)
    keys, inv_temp = _draw_keys(logits, params, generator, row_keys)
    drawn = draw(logits, keys, _token_ids(logits), inv_temp, not params.greedy)
    tokens, lse = drawn[0], drawn[1]
    if share_tokens is None and len(drawn) == 3:  # the Triton draw read its tokens' log-probs
        return tokens, drawn[2]
    if share_tokens is not None:
        tokens = share_tokens(tokens)
    picked = logits.gather(-1, tokens[:, None])[:, 0].float() * inv_temp
    return tokens, picked - lse


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [B, V], tokens [B] -> log-probs [B] under the temperature-scaled full softmax
    (``temperature == 0`` scores with T = 1; see the module docstring)."""
    # the fused log_softmax kernel beats logsumexp's several passes over [B, V] on GPU
    return torch.log_softmax(_scaled(logits, temperature), dim=-1).gather(-1, tokens[:, None])[:, 0]


def truncated_token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    exact: bool = False,
) -> torch.Tensor:
    """logits [B, V], tokens [B] -> log-probs [B] under the distribution the sampler draws from: the
    temperature-scaled logits truncated by ``truncate_logits`` (top-k, then top-p) and renormalised over
    what is kept. The engine and the trainer both call this (``rollout/truncated_logprob_*`` metrics);
    ``exact``: the renormalising log-softmax is ``batch_invariant.token_logprobs``."""
    kept = truncate_logits(_scaled(logits.float(), temperature), top_k, top_p)  # [B, V], -inf outside
    if exact:
        return batch_invariant.token_logprobs(kept, tokens, 1.0)
    return torch.log_softmax(kept, dim=-1).gather(-1, tokens[:, None])[:, 0]
