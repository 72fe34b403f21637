"""Llama-architecture decoder (also Mistral, Qwen2 with QKV bias, Qwen3 with q/k norm).

Inputs are one flat batch of tokens from many requests; attention reads and writes
the paged KV cache through `AttentionMetadata`. Q/K/V and gate/up projections are
fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.decoder import LayerWeights
from kvserve.layers.attention.backend import AttentionBackend, AttentionMetadata, TorchAttention
from kvserve.layers.attention.key_rotation import key_rotation, rotates_keys
from kvserve.layers.layer_ops import LayerOps, TorchLayerOps
from kvserve.layers.layernorm import RMSNorm
from kvserve.layers.linear import PackedLinear, pack_linears
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.config import ModelConfig

# (hidden states, cos_sin, KV caches, metadata) -> (last layer's MLP output, residual)
LayerLoop = Callable[
    [torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata], tuple[torch.Tensor, torch.Tensor]
]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend
        self.ops = ops
        # x -> x @ matrix for q and k, where int8 K/V store rotated keys (store_int8_keys_rotated)
        self.int8_rotation: tuple[Callable[[torch.Tensor], torch.Tensor], ...] | None = None

    def store_int8_keys_rotated(self) -> None:
        """For an int8 pool, after loading and packing: keys that passed a k_norm go into it rotated,
        and q with them (key_rotation.py). The two products are packed where this layer's projections
        are: a decode step's few rows then cost 7-9 µs a product, not 20-27 (bf16, [1-4, 256] x [256, 256])."""
        if not rotates_keys(self.q_norm is not None, self.head_dim):
            return
        matrices = key_rotation(self.q_norm.weight, self.k_norm.weight, self.q_norm.weight.dtype)
        packed = isinstance(self.o_proj, PackedLinear)
        self.int8_rotation = tuple(
            PackedLinear(m.t().contiguous(), None) if packed else partial(torch.matmul, other=m) for m in matrices
        )

    def rotate_int8_keys(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.int8_rotation is None:
            return q, k
        rotate_q, rotate_k = self.int8_rotation
        d = self.head_dim
        return rotate_q(q.reshape(-1, d)).view(q.shape), rotate_k(k.reshape(-1, d)).view(k.shape)

    def forward(
        self, cos_sin: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate_int8_keys(*self.ops.rotary(q, k, cos_sin))
        return self.o_proj(self.backend.forward(q, k, v, kv_cache, meta))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: LayerOps):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: LayerOps):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, backend, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ops)

    def forward(
        self,
        cos_sin: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's layout: the residual stream travels beside the hidden states, and each
        residual add happens inside the next norm. Returns (mlp output, residual)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(cos_sin, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint tensors fused into one of ours, in row order (see `models.loader.load_weights`)
    packed_modules_mapping = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None, ops: LayerOps | None = None):
        super().__init__()
        self.config = cfg
        backend = backend or TorchAttention()
        ops = ops or TorchLayerOps()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, ops) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.layer_loop: LayerLoop | None = None  # the platform's compiled loop over self.layers, where it has one

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states of every token in the flat batch: [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions)
        if self.layer_loop is not None:
            x, residual = self.layer_loop(x, cos_sin, kv_caches, meta)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(cos_sin, x, residual, kv_cache, meta)
        return self.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding is the head
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor | None:
        """argmax of compute_logits(hidden) per row outside its banned ids ([rows, B], -1 pads),
        where the packed head can fuse it; else None."""
        return self.lm_head.argmax(hidden, banned) if isinstance(self.lm_head, PackedLinear) else None

    def pack_linears(self) -> None:
        """CPU, after loading: pre-pack every projection and the head (tied or not) for oneDNN."""
        pack_linears(self)
        if self.lm_head is None:
            self.lm_head = PackedLinear(self.embed_tokens.weight, None)

    def decoder_layer_weights(self) -> list[LayerWeights] | None:
        """Each layer's weights for a compiled layer loop; None where it has no q/k norm (Qwen3)."""
        if self.config.qk_norm:
            return None
        return [
            LayerWeights(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
            for layer in self.layers
        ]
