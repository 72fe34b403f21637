"""Beam search selection, exactly as Hugging Face transformers does it, over each step's logprobs.

The engine gives `BeamSearch.step` each live beam's best candidates: `row_candidates` of the
log_softmax (float32, over the whole vocabulary) of the LM head's logits at its last token
(only a row's best `beams_to_keep` tokens can be among the step's best `beams_to_keep`, since
a beam's running score is the same for all its tokens); the step says which beam each new
live beam extends and with which token, and keeps the finished hypotheses. Nothing here
knows about requests or KV blocks (`beam_group.py` maps the steps onto forks and frees).

It follows transformers 5.24.0, `generation/utils.py`, `GenerationMixin._beam_search` (l. 3578)
for one prompt (batch size 1), op for op, so that scores and -1e9 masks come out as there
(its topk over every beam's whole row is a topk over the rows' candidates here):
- `beams_to_keep = max(2, 1 + n_eos_tokens) * num_beams` candidates per step (l. 3647);
- the first step has one live beam: transformers' copies 1.. of the prompt start at -1e9
  (l. 3694), so none of their candidates can reach the top k;
- candidates: topk over every beam's logprobs + its running score (`_get_top_k_continuations`,
  l. 3444, greedy branch l. 3482);
- a candidate finishes on an EOS id or at the last allowed token (`EosTokenCriteria`,
  `MaxLengthCriteria`: `cur_len + 1 >= max_length`);
- live beams: the best `num_beams` unfinished candidates, scored without length penalty
  (`_get_running_beams_for_next_iteration`, l. 3501);
- finished set: a finished candidate ranked below `num_beams` enters it scored
  `sum_logprobs / generated_len ** length_penalty`, unless the set is full under
  `early_stopping=True` or no improvement is possible (`_update_finished_beams`, l. 3523);
- stop: `_check_early_stop_heuristic` (l. 3375) and `_beam_search_has_unfinished_sequences`
  (l. 3422); output: the first `num_return_sequences` of the finished set (l. 3872).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch

NEG = -1.0e9  # transformers' mask for "not a candidate here"
EarlyStopping = bool | Literal["never"]


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its generated tokens (EOS included), sum of their logprobs, and score."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    eos: bool  # ended by an EOS (or stop) id, not by the length limit


@dataclass(frozen=True)
class BeamStep:
    """The live beams after a step: new beam i extends old beam `parents[i]` with `tokens[i]`.

    Old beams no new beam extends are dropped. `done`: the search is over (no live beams)."""

    parents: list[int]
    tokens: list[int]
    done: bool


def row_candidates(logprobs: torch.Tensor, k: int, lanes: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `k` best (logprobs, token ids), best first: `torch.topk(logprobs, k)`, faster
    on a long row (on the CPU torch.topk took ~0.2 ms per row of 49,152). Seen as
    [lanes, vocab / lanes], each column's max is one vectorised reduction; a row's top k lie in
    its k columns with the largest maxima, so topk runs only over those `lanes * k` values.
    Among equal values the token chosen may differ from torch.topk's (which specifies none)."""
    rows, vocab = logprobs.shape
    if vocab < k:
        raise ValueError(f"beam search keeps {k} candidates, more than the vocabulary ({vocab})")
    if vocab < 16 * lanes * k:
        return torch.topk(logprobs, k, dim=-1)
    pad = -vocab % lanes
    x = torch.nn.functional.pad(logprobs, (0, pad), value=float("-inf")) if pad else logprobs
    grid = x.view(rows, lanes, -1)
    cols = torch.topk(grid.amax(dim=1), k, dim=-1).indices  # [rows, k]
    values, at = torch.topk(grid.gather(2, cols[:, None, :].expand(rows, lanes, k)).reshape(rows, -1), k, dim=-1)
    return values, (at // k) * grid.shape[2] + cols.gather(1, at % k)


class BeamSearch:
    def __init__(
        self,
        beam_width: int,
        max_new_tokens: int,
        eos_token_ids: Iterable[int] = (),
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = False,
        num_return_sequences: int | None = None,
    ):
        self.width = beam_width
        self.max_new_tokens = max_new_tokens
        self.eos_ids = frozenset(eos_token_ids)
        self.eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_return = num_return_sequences or beam_width
        self.beams_to_keep = max(2, 1 + len(self.eos)) * beam_width
        self.running_scores = torch.zeros(1)  # cumulative logprob of each live beam, best first
        self.running_tokens: list[list[int]] = [[]]
        self.finished_scores = torch.full((beam_width,), NEG)
        self.finished_done = torch.zeros(beam_width, dtype=torch.bool)  # is_sent_finished
        self.finished: list[Hypothesis | None] = [None] * beam_width  # None: a placeholder slot
        self.improvable = True  # is_early_stop_heuristic_unsatisfied
        self.num_generated = 0
        self.done = False
        self._last_running: tuple[list[int], float] | None = None

    @property
    def num_live(self) -> int:
        return 0 if self.done else len(self.running_tokens)

    def step(self, values: torch.Tensor, tokens: torch.Tensor) -> BeamStep:
        """Row i for live beam i (in this object's order): its best candidates, best first, at
        least `beams_to_keep` of them (`row_candidates`): logprobs [num_live, k] fp32, token ids."""
        assert not self.done and values.shape[0] == len(self.running_tokens), "one row per live beam"
        assert values.shape[1] >= self.beams_to_keep, "a row's best beams_to_keep candidates"
        values, tokens = values[:, : self.beams_to_keep], tokens[:, : self.beams_to_keep]
        accumulated = (values + self.running_scores[:, None]).reshape(-1)
        top_scores, top = torch.topk(accumulated, k=self.beams_to_keep)
        parents, tokens = top // self.beams_to_keep, tokens.reshape(-1)[top]
        last_step = self.num_generated + 1 >= self.max_new_tokens
        hits = torch.isin(tokens, self.eos) | last_step  # next_token_hits_stopping_criteria
        # live beams: the best unfinished candidates (finished ones pushed down by -1e9)
        running = top_scores + hits.to(torch.float32) * NEG
        next_indices = torch.topk(running, k=self.width)[1]
        self._update_finished(top_scores, hits, parents.tolist(), tokens.tolist())
        self.num_generated += 1
        self.running_scores = running[next_indices]
        parent_list, token_list = parents[next_indices].tolist(), tokens[next_indices].tolist()
        self.running_tokens = [self.running_tokens[p] + [t] for p, t in zip(parent_list, token_list, strict=True)]
        self._check_early_stop_heuristic()
        full = bool(self.finished_done.all()) and self.early_stopping is True
        self.done = not self.improvable or full or bool(hits.all())
        if self.done:
            self._last_running = (self.running_tokens[0], self.running_scores[0].item())
            self.running_tokens = []
            return BeamStep([], [], True)
        return BeamStep(parent_list, token_list, False)

    def _update_finished(self, top_scores: torch.Tensor, hits: torch.Tensor, parents: list[int], tokens: list[int]):
        """transformers' `_update_finished_beams`, the same additions in the same order."""
        top_num_beam_mask = torch.arange(self.beams_to_keep) < self.width
        did_finish = hits & top_num_beam_mask
        gen_len = self.num_generated + 1  # generated tokens, the new one (EOS) included
        scores = top_scores / (gen_len**self.length_penalty)
        beams_full = bool(self.finished_done.all()) and self.early_stopping is True
        scores += float(beams_full) * NEG
        scores += float(not self.improvable) * NEG
        scores += (~did_finish) * NEG
        merged_scores = torch.cat((self.finished_scores, scores))
        merged_done = torch.cat((self.finished_done, did_finish))
        keep = torch.topk(merged_scores, k=self.width)[1]
        finished = []
        for i in keep.tolist():
            if i < self.width:
                finished.append(self.finished[i])
            elif did_finish[i - self.width]:
                k = i - self.width
                seq = self.running_tokens[parents[k]] + [tokens[k]]
                eos = tokens[k] in self.eos_ids
                finished.append(Hypothesis(seq, top_scores[k].item(), merged_scores[i].item(), eos))
            else:
                finished.append(None)  # a running candidate filling an empty slot at about -1e9
        self.finished = finished
        self.finished_scores = merged_scores[keep]
        self.finished_done = merged_done[keep]

    def _check_early_stop_heuristic(self) -> None:
        """Can a live beam still beat the worst finished hypothesis? (`_check_early_stop_heuristic`)"""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_new_tokens  # a longer beam scores better: assume the longest
        else:
            best_len = self.num_generated
        best_possible = self.running_scores[:1] / (best_len**self.length_penalty)
        worst_finished = torch.where(self.finished_done, self.finished_scores.min(), NEG)
        self.improvable = self.improvable and bool((best_possible > worst_finished).any())

    def results(self) -> list[Hypothesis]:
        """The best `num_return_sequences` finished hypotheses, best first (once `done`)."""
        hyps = [h for h in self.finished[: self.num_return] if h is not None]
        if not hyps and self._last_running is not None:
            # only a negative length_penalty can stop the search with no hypothesis (scores
            # below -1e9 look like placeholders); transformers returns a placeholder there
            tokens, cumulative = self._last_running
            hyps = [Hypothesis(tokens, cumulative, cumulative / len(tokens) ** self.length_penalty, False)]
        return hyps
