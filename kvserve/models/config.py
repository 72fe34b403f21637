"""Architecture hyperparameters of a decoder-only model, read from HF config.json or GGUF."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.models.registry import check_supported


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm on each head of q and k
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Gemma 3: each layer's sliding window (None: full attention), the local layers' RoPE
    # base, the attention scale's denominator, and soft-capping (refused: not implemented)
    layer_windows: tuple[int | None, ...] = ()  # empty: every layer full
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        check_supported(self.architecture)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.layer_windows and len(self.layer_windows) != self.num_hidden_layers:
            raise ValueError("layer_windows must have one entry per layer")
        if self.final_logit_softcapping:
            raise ValueError("final_logit_softcapping is not supported yet")

    def sliding_window(self, layer: int) -> int | None:
        """The layer's window (a key is visible when query_pos - key_pos < window), None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict."""
        model_type = cfg.get("model_type", "llama")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_params = cfg.get("rope_parameters") or {}  # transformers >= 5 nests theta here
        rope_scaling = cfg.get("rope_scaling") or (
            rope_params if rope_params.get("rope_type", "default") != "default" else None
        )
        fields = dict(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta") or rope_params.get("rope_theta", 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        if model_type in ("gemma3_text", "gemma3"):
            fields |= _gemma3_fields(cfg)
        return cls(**fields)

    @property
    def has_sliding_window(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    def matmul_params_per_token(self) -> int:
        """Weights every token multiplies: each layer's projections and the LM head (2 FLOPs each)."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_hidden_layers * (attention + mlp) + self.vocab_size * self.hidden_size


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 text: per-layer windows from `layer_types` (older configs: every 6th layer is
    global), one RoPE base per layer kind (transformers >= 5 nests them in rope_parameters)."""
    layers = cfg["num_hidden_layers"]
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    ]
    window = cfg.get("sliding_window") or 512
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", {})
    local = rope.get("sliding_attention", {})
    return {
        "qk_norm": True,
        "layer_windows": tuple(window if t == "sliding_attention" else None for t in types),
        "rope_theta": full.get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0,
        "rope_scaling": cfg.get("rope_scaling") or _non_default(full),
        "rope_local_theta": local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0,
        "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256,
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        "max_position_embeddings": cfg.get("max_position_embeddings", 32768),
        "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
    }


def _non_default(rope: dict[str, Any]) -> dict[str, Any] | None:
    return rope if rope.get("rope_type", "default") != "default" else None
