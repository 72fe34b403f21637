"""Llama-architecture decoder (also Mistral, Qwen2 with QKV bias, Qwen3 with q/k norm).

Inputs are one flat batch of tokens from many requests; attention reads and writes
the paged KV cache through `AttentionMetadata`. Q/K/V and gate/up projections are
fused into one matmul each.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.attention import AttentionBackend, AttentionMetadata, TorchAttention
from kvserve.model.config import ModelConfig
from kvserve.model.fused_layers import FusedDecoderLayers
from kvserve.model.layer_ops import TorchLayerOps
from kvserve.model.packed_linear import PackedLinear, pack_linears
from kvserve.model.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: TorchLayerOps | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops or TorchLayerOps()  # q/k norms keep it: their rows are strided views

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: TorchLayerOps):
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

    def forward(
        self, cos_sin: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rotary(q, k, cos_sin)
        return self.o_proj(self.backend.forward(q, k, v, kv_cache, meta))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchLayerOps):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: TorchLayerOps):
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
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None, ops: TorchLayerOps | None = None):
        super().__init__()
        self.config = cfg
        backend = backend or TorchAttention()
        ops = ops or TorchLayerOps()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, ops) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.fused_layers: FusedDecoderLayers | None = None  # set by pack_linears where it can run

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
        if self.fused_layers is not None:
            x, residual = self.fused_layers(x, cos_sin, kv_caches, meta)
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
        self.fused_layers = FusedDecoderLayers.create(self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            target, offset = _fused_target(name, self.config)
            if target not in params:
                raise KeyError(f"unexpected weight {hf_name!r}")
            param = params[target]
            param.data[offset : offset + tensor.shape[0]].copy_(tensor)
            loaded.add(name)
        missing = {n for n in _expected_names(params)} - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")


_FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def _fused_target(name: str, cfg: ModelConfig) -> tuple[str, int]:
    """Map a HF tensor name to (our parameter, row offset inside it)."""
    parts = name.split(".")
    if len(parts) < 3 or parts[-2] not in _FUSED:
        return name, 0
    proj = parts[-2]
    q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    offsets = {"q_proj": 0, "k_proj": q_rows, "v_proj": q_rows + kv_rows}
    offsets |= {"gate_proj": 0, "up_proj": cfg.intermediate_size}
    return ".".join(parts[:-2] + [_FUSED[proj], parts[-1]]), offsets[proj]


def _expected_names(params: dict[str, nn.Parameter]) -> Iterable[str]:
    """The HF names a complete checkpoint must provide for our fused parameters."""
    for name in params:
        parts = name.split(".")
        fused = [k for k, v in _FUSED.items() if len(parts) >= 3 and parts[-2] == v]
        if fused:
            yield from (".".join(parts[:-2] + [f, parts[-1]]) for f in fused)
        else:
            yield name
