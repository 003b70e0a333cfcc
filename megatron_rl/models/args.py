"""Model hyper-parameters read from an HF ``config.json`` and turned into a megatron-core TransformerConfig.

Supported: the Llama family (Llama 2/3, Mistral-style GQA, untied head), Qwen2/Qwen2.5 (qkv bias, often
tied embeddings) and Qwen3 (qk-norm, head_dim independent of hidden/heads). Anything else fails here,
before a model is built, with a message that names the file and the supported list.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# model_type -> arch key; the CausalLM / SequenceClassification architectures of each are accepted.
SUPPORTED_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SUPPORTED_ARCHITECTURES = tuple(
    f"{name}For{head}"
    for name in ("Llama", "Mistral", "Qwen2", "Qwen3")
    for head in ("CausalLM", "SequenceClassification")
)
VOCAB_PAD_MULTIPLE = 128


class UnsupportedModelError(ValueError):
    """The HF config names an architecture or option this package cannot build exactly."""


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Round ``vocab_size`` up to a multiple of 128 * tp (Megatron-LM's make-vocab-size-divisible-by rule)."""
    multiple = VOCAB_PAD_MULTIPLE * tp
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class ModelArgs:
    """Everything needed to build the megatron-core GPTModel of one HF checkpoint.

    ``arch`` is one of "llama", "qwen2", "qwen3" (the weight-name family); ``model_type`` and
    ``architectures`` keep the HF names so an export writes the same config back.
    """

    arch: str
    model_type: str
    vocab_size: int
    padded_vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    rope_theta: float
    norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    architectures: tuple[str, ...] = ()
    rope_scaling_factor: float | None = None  # llama3-style rope scaling, None when unscaled
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, path_or_dict: str | Path | dict, tp: int = 1) -> ModelArgs:
        """Parse an HF config (a dict, a ``config.json`` path or a model directory).

        ``tp`` only decides ``padded_vocab_size`` (a multiple of 128 * tp).
        """
        cfg, source = read_hf_config(path_or_dict)
        model_type = cfg.get("model_type")
        archs = tuple(cfg.get("architectures") or ())
        if model_type not in SUPPORTED_MODEL_TYPES or any(a not in SUPPORTED_ARCHITECTURES for a in archs):
            raise UnsupportedModelError(
                f"{source}: model_type={model_type!r}, architectures={list(archs)} is not supported. "
                f"Supported model_type values: {sorted(SUPPORTED_MODEL_TYPES)}; supported architectures: "
                f"{list(SUPPORTED_ARCHITECTURES)}. Convert a checkpoint of one of these families."
            )
        arch = SUPPORTED_MODEL_TYPES[model_type]
        _check_unsupported_options(cfg, source)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope_theta, rope_factor = _rope(cfg, source)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            arch=arch,
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            padded_vocab_size=padded_vocab(cfg["vocab_size"], tp),
            hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_query_groups=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            architectures=archs,
            rope_scaling_factor=rope_factor,
            sliding_window=window,
        )

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one transformer layer held by one TP rank: qkv (+ bias), proj, SwiGLU fc1 + fc2
        split over TP; the two RMSNorm weights (and qk-norm weights) replicated."""
        qkv_rows = (self.num_attention_heads + 2 * self.num_query_groups) * self.head_dim
        split = qkv_rows * self.hidden_size + qkv_rows * self.qkv_bias
        split += self.num_attention_heads * self.head_dim * self.hidden_size  # proj
        split += 3 * self.ffn_hidden_size * self.hidden_size  # fc1 = gate + up, fc2
        return split // tp + 2 * self.hidden_size + 2 * self.head_dim * self.qk_norm

    def stage_params(self, tp: int = 1, pp: int = 1, head: str = "lm") -> dict[str, int]:
        """Parameters one rank holds on the first and on the last pipeline stage (the larger stages: the
        layers split evenly, plus the padded embedding / LM head / final norm). ``head``: "lm" (actor,
        ref: the LM head, tied to the embedding at PP=1) or "value" (critic, reward: a [1, h] head)."""
        if head not in ("lm", "value"):
            raise ValueError(f"head={head!r}; use 'lm' or 'value'")
        body = self.layer_params(tp) * self.num_layers // pp
        emb = self.with_tp(tp).padded_vocab_size // tp * self.hidden_size
        if head == "value":
            out = self.hidden_size
        else:  # tied: one tensor at PP=1; a copy on the last stage at PP>1
            out = emb if not self.tie_word_embeddings or pp > 1 else 0
        tail = out + self.hidden_size  # + the final norm
        return {"first": body + emb + (tail if pp == 1 else 0), "last": body + (tail if pp > 1 else 0)}

    def num_params(self) -> int:
        """All parameters of the model as HF counts them (unpadded vocab; a tied head counted once)."""
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return (
            self.num_layers * self.layer_params()
            + self.vocab_size * self.hidden_size
            + head
            + self.hidden_size
        )

    def matmul_params(self) -> int:
        """N of the 6N-FLOPs-per-trained-token (2N per forward token) rule: every weight matrix a token
        passes through, the LM head once whether tied or not; norms, biases and attention's T^2 term are
        left out (the usual MFU convention, as Megatron-LM and PaLM count)."""
        qkv_rows = (self.num_attention_heads + 2 * self.num_query_groups) * self.head_dim
        attn = qkv_rows * self.hidden_size + self.num_attention_heads * self.head_dim * self.hidden_size
        return self.num_layers * (attn + 3 * self.hidden_size * self.ffn_hidden_size) + (
            self.vocab_size * self.hidden_size
        )

    def kv_bytes_per_token(self, tp: int = 1, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token takes on one generation-TP rank (K and V of every layer)."""
        return self.num_layers * 2 * max(1, self.num_query_groups // tp) * self.head_dim * dtype_bytes

    def with_tp(self, tp: int) -> ModelArgs:
        """The same model with the vocab padding of another TP size (keeps a padding that already fits)."""
        if self.padded_vocab_size % tp == 0:
            return self
        return dataclasses.replace(self, padded_vocab_size=padded_vocab(self.vocab_size, tp))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["architectures"] = list(self.architectures)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelArgs:
        return cls(**{**d, "architectures": tuple(d.get("architectures", ()))})

    def transformer_config(
        self,
        dtype: torch.dtype = torch.float32,
        use_cpu_init: bool | None = None,
        sequence_parallel: bool = False,
        fusions: dict[str, bool] | None = None,
    ):
        """megatron-core TransformerConfig matching HF numerics (no dropout, 1/sqrt(head_dim) scale).

        ``fusions``: fusion flags to turn on (``kernels.mcore.fusion_flags``); all are off otherwise.

        ``sequence_parallel`` (``parallel.sequence_parallel``, GPU only): activations outside the TP regions
        are split along the sequence across TP ranks; sequence lengths must be multiples of TP."""
        from megatron.core import parallel_state
        from megatron.core.transformer import TransformerConfig

        if use_cpu_init is None:
            use_cpu_init = not torch.cuda.is_available()
        window = None
        if self.sliding_window is not None and self.sliding_window < self.max_position_embeddings:
            window = (self.sliding_window - 1, 0)  # HF: a query sees itself and sliding_window-1 earlier
        return TransformerConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.head_dim,
            layernorm_epsilon=self.norm_eps,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            softmax_scale=self.head_dim**-0.5,
            window_size=window,
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            sequence_parallel=sequence_parallel,
            use_cpu_initialization=use_cpu_init,
            **{
                "bias_dropout_fusion": False,
                "apply_rope_fusion": False,
                "bias_activation_fusion": False,
                "masked_softmax_fusion": False,
                "gradient_accumulation_fusion": False,
                "persist_layer_norm": False,
                **(fusions or {}),
            },
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
        )

    def hf_config_dict(self) -> dict:
        """A minimal HF config for this model (used when no original ``config.json`` travels along)."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        d = {
            "architectures": list(self.architectures) or [arch[self.arch]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
        }
        if self.arch == "llama":
            d["attention_bias"] = self.qkv_bias
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
        return d


def find_hf_config(model_dir: str | Path) -> Path | None:
    """Where the HF ``config.json`` of a model directory lives: ``<dir>/config.json`` (an HF directory)
    or ``<dir>/hf_config/config.json`` (a megatron_rl checkpoint or converted directory); None if neither."""
    for cand in (Path(model_dir) / "config.json", Path(model_dir) / "hf_config" / "config.json"):
        if cand.is_file():
            return cand
    return None


def read_hf_config(path_or_dict: str | Path | dict) -> tuple[dict, str]:
    """(config dict, where it came from) for a dict, a ``config.json`` path or a model directory."""
    if isinstance(path_or_dict, dict):
        return path_or_dict, "<config dict>"
    path = Path(path_or_dict)
    if path.is_dir():
        path = find_hf_config(path) or path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"HF config not found: {path}. Pass a model directory that contains config.json "
            f"(as written by transformers' save_pretrained) or hf_config/config.json, or the file itself."
        )
    return json.loads(path.read_text()), str(path)


def _check_unsupported_options(cfg: dict, source: str) -> None:
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r} (only 'silu' is built)")
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias=true (MLP biases are not mapped)")
    if any(t != "full_attention" for t in cfg.get("layer_types") or ()) and cfg.get("use_sliding_window"):
        problems.append("per-layer sliding-window attention (layer_types)")
    if problems:
        raise UnsupportedModelError(
            f"{source}: unsupported option(s): {'; '.join(problems)}. These models cannot be built exactly "
            f"on megatron-core by megatron_rl; use a checkpoint without them."
        )


def _rope(cfg: dict, source: str) -> tuple[float, float | None]:
    """(rope theta, llama3 scaling factor or None) from either the transformers 4 or 5 config layout."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    llama3_defaults = {
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if rope_type == "llama3" and all(scaling.get(k) == v for k, v in llama3_defaults.items()):
        return theta, float(scaling["factor"])
    raise UnsupportedModelError(
        f"{source}: rope scaling {scaling} is not supported; megatron-core builds only unscaled rope and "
        f"llama3 scaling with {llama3_defaults}. Remove rope_scaling or use a supported checkpoint."
    )
