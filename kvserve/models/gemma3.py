"""Gemma 3 (text) decoder: sliding-window attention on most layers, global on every sixth.

What differs from Llama: q and k RMSNorm per head before RoPE; one RoPE base for the
local (window) layers and another for the global ones; the attention scale is
1/sqrt(query_pre_attn_scalar); four norms per layer (input, post-attention,
pre-feedforward, post-feedforward); GeGLU with tanh GELU; embeddings multiplied by
sqrt(hidden size); the LM head tied to the embeddings. Gemma's RMSNorm multiplies by
(1 + w): checkpoints store w, and `process_weights_after_loading` adds the 1 once, so the
norms run as plain RMSNorms.

Each layer reads its KV group's metadata (`layer_metadata`): window layers attend only
to the last `sliding_window` keys, and their KV blocks leave the pool as the window moves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.decoder import LayerWeights
from kvserve.layers.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    LayerMetadata,
    TorchAttention,
    layer_metadata,
)
from kvserve.layers.layer_ops import LayerOps, TorchLayerOps
from kvserve.layers.layernorm import RMSNorm
from kvserve.layers.linear import PackedLinear, pack_linears
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.config import ModelConfig
from kvserve.models.llama import Attention


class Gemma3Attention(Attention):
    """Llama's (q and k RMSNorm per head: `qk_norm`), with q scaled by query_pre_attn_scalar."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: LayerOps):
        super().__init__(cfg, backend, ops)
        # the backends scale by 1/sqrt(head_dim); q absorbs the difference (1.0 for the real models)
        self.q_scale = (self.head_dim / (cfg.query_pre_attn_scalar or self.head_dim)) ** 0.5

    def forward(
        self, cos_sin: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotary(q, k, cos_sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q, k = self.rotate_int8_keys(q, k)
        return self.o_proj(self.backend.forward(q, k, v, kv_cache, meta))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        self.sliding_window = cfg.sliding_window(layer)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, ops)
        self.self_attn = Gemma3Attention(cfg, backend, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, ops)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, ops)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, ops)

    def forward(
        self, cos_sin: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        h = self.post_attention_layernorm(self.self_attn(cos_sin, self.input_layernorm(x), kv_cache, meta))
        h, x = self.pre_feedforward_layernorm.add_and_norm(h, x)  # the residual add fused into the norm
        return x + self.post_feedforward_layernorm(self.mlp(h))


class Gemma3ForCausalLM(nn.Module):
    packed_modules_mapping = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None, ops: LayerOps | None = None):
        super().__init__()
        self.config = cfg
        backend = backend or TorchAttention()
        ops = ops or TorchLayerOps()
        max_pos = cfg.max_position_embeddings
        self.rotary = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_local_theta or cfg.rope_theta, None)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, backend, ops) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.layer_loop = None  # no compiled loop: its layers have four norms and GeGLU

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: LayerMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)  # rounded to the dtype, as in transformers
        cos_sin = self.rotary.lookup(positions)
        cos_sin_local = self.rotary_local.lookup(positions)
        metas = layer_metadata(meta, len(self.layers))
        for layer, kv_cache, m in zip(self.layers, kv_caches, metas, strict=True):
            x = layer(cos_sin if layer.sliding_window is None else cos_sin_local, x, kv_cache, m)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.lm_head.argmax(hidden, banned) if isinstance(self.lm_head, PackedLinear) else None

    def process_weights_after_loading(self) -> None:
        """Gemma's norms multiply by (1 + w): add the 1 once, so they run as plain RMSNorms."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(1.0)

    def pack_linears(self) -> None:
        pack_linears(self)
        if self.lm_head is None:
            self.lm_head = PackedLinear(self.embed_tokens.weight, None)

    def decoder_layer_weights(self) -> list[LayerWeights] | None:
        return None  # the C++ layer loop runs Llama layers only
