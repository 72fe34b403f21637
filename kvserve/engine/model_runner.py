"""Turn a scheduler step into one flat batch, run the model once, sample.

The KV cache is one preallocated tensor per layer, [2, num_blocks, block_size,
kv_heads, head_dim] (int8: uint8 rows of head_dim + 8, each row's scale and minimum after its
codes); slot = block_id * block_size + offset. Decode tokens go first
in the batch (they are attended to in one batched call), prefill chunks after.

With several KV groups (`kv_cache/kv_groups.py`), layers of different groups share a
tensor (a block holds its group's layers), and each group gets its own metadata: slot
mapping, block tables and window; the model gets one metadata per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.engine.beam_search import row_candidates
from kvserve.engine.kv_transfer import KVTransfer
from kvserve.engine.ranges import named_range
from kvserve.engine.request import Request
from kvserve.engine.scheduler import SampledToken, ScheduledRequest, SchedulerOutput
from kvserve.kv_cache.kv_cache_manager import KVCacheManager
from kvserve.kv_cache.kv_groups import KVCacheConfig
from kvserve.layers.attention.backend import AttentionMetadata, LayerMetadata, PrefillSeq
from kvserve.layers.attention.kv_quant import stored_head_dim
from kvserve.layers.sampler import Sampler, logprob_entries
from kvserve.models.config import ModelConfig
from kvserve.models.interface import CausalLM
from kvserve.platforms.interface import HostBlockCopy

_PROMPT_LOGPROB_ROWS = 256  # positions per LM head call: [rows, vocab] fp32 logits stay small


def kv_cache_config(model: CausalLM, sliding_window_release: bool = True) -> KVCacheConfig:
    """One group for a model of one layer kind; with windows, vLLM's hybrid groups, unless
    the release is off (a benchmark's baseline: every layer keeps its whole history)."""
    cfg = model.config
    if not cfg.has_sliding_window or not sliding_window_release:
        return KVCacheConfig.single(cfg.num_hidden_layers)
    return KVCacheConfig.from_layer_windows(cfg.layer_windows)


def allocate_kv_caches(
    model: CausalLM,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_config: KVCacheConfig | None = None,
) -> list[torch.Tensor]:
    """One tensor per layer; with KV groups, one per slot, each shared by a layer of every group."""
    cfg = model.config
    kv_config = kv_config or KVCacheConfig.single(cfg.num_hidden_layers)
    shape = (2, num_blocks, block_size, cfg.num_key_value_heads, kv_row_dim(cfg.head_dim, dtype))
    slots = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(kv_config.num_slots)]
    return [slots[slot] for _, slot in kv_config.layer_slots()]


def kv_row_dim(head_dim: int, kv_dtype: torch.dtype) -> int:
    """The pool's last dimension: int8 (a uint8 pool) keeps each row's scale and minimum after its codes."""
    return stored_head_dim(head_dim) if kv_dtype == torch.uint8 else head_dim


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: torch.dtype) -> int:
    """K and V of every layer for one token, as stored (int8: scales included)."""
    row = kv_row_dim(cfg.head_dim, kv_dtype) * kv_dtype.itemsize
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * row


def kv_slots(kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each KV tensor once, in layer order: with KV groups, layers of different groups share one
    (a block id in it is one group's block), so copying a block copies each tensor once."""
    return list({id(c): c for c in kv_caches}.values())


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        kv_cache_manager: KVCacheManager,
        sampler: Sampler,
        transfer: KVTransfer | None = None,
        copier: HostBlockCopy | None = None,
    ):
        self.model = model
        self.transfer = transfer  # to and from the KV tiers
        self.copier = copier  # copy-on-write copies in a CPU pool
        self.kv_caches = kv_caches
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.sampler = sampler
        self.device = kv_caches[0].device
        # one metadata per (KV group, window) the layers use: with the hybrid KV cache off, window
        # layers share the full layers' tables but still attend through their window
        cfg = model.config
        config = kv_cache_manager.kv_config or KVCacheConfig.single(cfg.num_hidden_layers)
        layer_keys = [(g, cfg.sliding_window(layer)) for layer, (g, _) in enumerate(config.layer_slots())]
        self.meta_keys = sorted(set(layer_keys), key=lambda k: (k[0], k[1] or 0))
        self.layer_metas = [self.meta_keys.index(k) for k in layer_keys] if len(self.meta_keys) > 1 else None
        self.kv_tensors = kv_slots(kv_caches)
        # a bench's hook (`kvserve bench kv-accuracy`): sees each prompt-logprob chunk's full
        # [rows, vocab] fp32 log_softmax as (request, first position, rows) before top k is taken
        self.prompt_logprob_rows: Callable[[Request, int, torch.Tensor], None] | None = None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[int, SampledToken]:
        with named_range("prepare_inputs"):
            self._move_blocks(out)
            batch = sorted(out.scheduled, key=lambda s: s.num_new_tokens > 1)  # decodes first, stable
            input_ids, positions, meta, sample_rows = self._prepare(batch)
        with named_range("model_forward"):
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        self._prompt_logprobs(batch, hidden, sample_rows)
        requests = [s.request for s in batch if s.samples]
        rows = [sample_rows[r.seq_id] for r in requests]
        for parent, child in out.forks:  # siblings draw from their parent's last-token logits
            requests.append(child)
            rows.append(sample_rows[parent.seq_id])
        if not requests:
            return {}
        beams = [i for i, r in enumerate(requests) if r.beam is not None]
        if not beams:
            tokens = self._sample(hidden[rows], requests)
            return {r.seq_id: t for r, t in zip(requests, tokens, strict=True)}
        return self._sample_with_beams(hidden, requests, rows, beams)

    def _sample_with_beams(
        self, hidden: torch.Tensor, requests: list[Request], rows: list[int], beams: list[int]
    ) -> dict[int, SampledToken]:
        """Beams get their best candidates of the log_softmax over the whole vocabulary in fp32
        (as transformers' beam search computes it), from the LM head at their last token; the
        other requests are sampled."""
        out = {}
        others = [i for i in range(len(requests)) if requests[i].beam is None]
        if others:
            sampled = self._sample(hidden[[rows[i] for i in others]], [requests[i] for i in others])
            out = {requests[i].seq_id: t for i, t in zip(others, sampled, strict=True)}
        with named_range("beam_logprobs"):
            logits = self.model.compute_logits(hidden[[rows[i] for i in beams]])
            logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
            k = max(requests[i].beam.search.beams_to_keep for i in beams)
            values, tokens = row_candidates(logprobs, k)
        for j, i in enumerate(beams):
            out[requests[i].seq_id] = SampledToken(-1, beam_candidates=(values[j], tokens[j]))
        return out

    def _prompt_logprobs(self, batch: list[ScheduledRequest], hidden: torch.Tensor, last_rows: dict[int, int]) -> None:
        """For requests that ask: the fp32 log_softmax at each prompt position of this chunk,
        scored on the next prompt token, appended to `request.prompt_logprobs` (chunks arrive in
        order; positions it already holds, recomputed after a preemption, are skipped)."""
        for s in batch:
            req, k = s.request, s.request.sampling_params.prompt_logprobs
            if k is None or req.beam is not None:
                continue
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)  # the first token has no context to be scored on
            start = req.num_computed_tokens  # before this step's update
            first = max(start, len(req.prompt_logprobs) - 1)  # position p scores token p + 1
            end = min(start + s.num_new_tokens, req.num_prompt_tokens - 1)
            row0 = last_rows[req.seq_id] - s.num_new_tokens + 1 - start  # the row of position 0
            for lo in range(first, end, _PROMPT_LOGPROB_ROWS):
                hi = min(lo + _PROMPT_LOGPROB_ROWS, end)
                logits = self.model.compute_logits(hidden[row0 + lo : row0 + hi])
                logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
                if self.prompt_logprob_rows is not None:
                    self.prompt_logprob_rows(req, lo, logprobs)
                targets = torch.tensor(req.prompt_token_ids[lo + 1 : hi + 1])
                req.prompt_logprobs.extend(logprob_entries(logprobs, targets, k))

    def _sample(self, hidden: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        with named_range("logits"):
            greedy = None
            if Sampler.argmax_only(requests):
                masked = Sampler.masked_tokens(requests, self.model.config.vocab_size)
                greedy = self.model.greedy_tokens(hidden, masked)
            if greedy is not None:  # the LM head's own argmax: no logits written
                return [SampledToken(t) for t in greedy.tolist()]
            logits = self.model.compute_logits(hidden)
        with named_range("sample"):
            return self.sampler(logits, requests)

    def _move_blocks(self, out: SchedulerOutput) -> None:
        """Before the forward: evicted blocks out to the tiers first (copies and loads may
        land in them), then copy-on-write copies, then blocks loaded from the tiers."""
        if self.transfer is not None:
            self.transfer.save(out.block_saves)
        self._copy_blocks(out)
        if self.transfer is not None:
            self.transfer.load(out.block_loads)

    def _copy_blocks(self, out: SchedulerOutput) -> None:
        if not out.block_copies:
            return
        if self.copier is not None:
            self.copier.copy(self.kv_tensors, [c.src for c in out.block_copies], [c.dst for c in out.block_copies])
            return
        if self.device.type == "cpu":  # a copy_ per block: indexing dim 1 of the cache is ~40x slower there
            for cache in self.kv_tensors:
                for c in out.block_copies:
                    cache[:, c.dst].copy_(cache[:, c.src])
            return
        src = torch.tensor([c.src for c in out.block_copies], device=self.device)
        dst = torch.tensor([c.dst for c in out.block_copies], device=self.device)
        for cache in self.kv_tensors:
            cache[:, dst] = cache[:, src]

    def _prepare(
        self, batch: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, LayerMetadata, dict[str, int]]:
        input_ids, positions, meta, sample_rows = self._prepare_group(batch, *self.meta_keys[0])
        if self.layer_metas is None:
            return input_ids, positions, meta, sample_rows
        metas = [meta] + [self._prepare_group(batch, *key)[2] for key in self.meta_keys[1:]]
        return input_ids, positions, [metas[i] for i in self.layer_metas], sample_rows

    def _prepare_group(
        self, batch: list[ScheduledRequest], group: int, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, dict[str, int]]:
        """The batch, with KV group `group`'s slots and block tables, attending through `window`."""
        bs = self.block_size
        ids: list[int] = []
        # decodes (first in the batch) in plain Python: per-request tensor ops would cost
        # ~6 ms per step at batch 128; prefill chunks as tensors
        pos: list[int] = []
        slots: list[int] = []
        chunk_pos: list[torch.Tensor] = []
        chunk_slots: list[torch.Tensor] = []
        sample_rows: dict[str, int] = {}
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        for s in batch:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            table = self.kv.block_ids(req, group)
            if n > 1:
                p = torch.arange(start, start + n)
                block_table = torch.tensor(table)
                prefills.append(_prefill_seq(len(ids), start, n, block_table, bs, window))
                chunk_pos.append(p)
                chunk_slots.append(block_table[p // bs] * bs + p % bs)
            else:
                decode_tables.append(table)
                decode_lens.append(start + 1)
                pos.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            ids.extend(req.all_token_ids[start : start + n])
            sample_rows[req.seq_id] = len(ids) - 1
        meta = AttentionMetadata(
            slot_mapping=torch.cat([torch.tensor(slots, dtype=torch.long), *chunk_slots]).to(self.device),
            num_decode_tokens=len(decode_tables),
            prefills=prefills,
            sliding_window=window,
            **_decode_tensors(decode_tables, decode_lens),
        )
        if self.device.type != "cpu":
            meta = _to_device(meta, self.device)
        input_ids = torch.tensor(ids, device=self.device)
        positions = torch.cat([torch.tensor(pos, dtype=torch.long), *chunk_pos]).to(self.device)
        return input_ids, positions, meta, sample_rows


def _prefill_seq(
    query_start: int, start: int, n: int, block_table: torch.Tensor, bs: int, window: int | None = None
) -> PrefillSeq:
    end = start + n
    return PrefillSeq(query_start, n, end, block_table[: -(-end // bs)], window)


def _decode_tensors(tables: list[list[int]], lens: list[int]) -> dict[str, torch.Tensor]:
    width = max((len(t) for t in tables), default=0)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long).view(len(tables), width)
    return {"decode_block_tables": padded, "decode_context_lens": torch.tensor(lens, dtype=torch.int32)}


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    meta.decode_block_tables = meta.decode_block_tables.to(device)
    meta.decode_context_lens = meta.decode_context_lens.to(device)
    for seq in meta.prefills:
        seq.block_table = seq.block_table.to(device)
    return meta
