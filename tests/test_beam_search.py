"""Beam selection (kvserve/engine/beam_search.py) against transformers' own beam search.

transformers' `generate(num_beams=...)` runs on a tiny random Llama with a small vocabulary
(so EOS ids are frequent); a logits processor records the log-probabilities it computed for
every running sequence. `BeamSearch` is then driven by exactly those log-probabilities: the
tokens and the scores must come out bit for bit the same, for every early_stopping and
length_penalty, with and without EOS hits.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

from kvserve.engine.beam_search import BeamSearch, row_candidates

VOCAB = 96


class Recorder(LogitsProcessor):
    """Remembers the log-probabilities transformers computed for each running sequence."""

    def __init__(self):
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for ids, row in zip(input_ids.tolist(), scores, strict=True):
            self.rows.setdefault(tuple(ids), row.clone())
        return scores


@pytest.fixture(scope="module")
def tiny_hf() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # sharper distributions than the init's, so that beams diverge and finish
        model.lm_head.weight.mul_(40.0)
    return model


def hf_beam_search(model, prompt, width, max_new, eos, lp, es):
    rec = Recorder()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_new,
            length_penalty=lp,
            early_stopping=es,
            eos_token_id=list(eos),
            pad_token_id=0,
            logits_processor=LogitsProcessorList([rec]),
            return_dict_in_generate=True,
            output_scores=True,
        )
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    seqs = [row[len(prompt) : len(prompt) + n] for row, n in zip(out.sequences.tolist(), lengths, strict=True)]
    return seqs, out.sequences_scores.tolist(), rec.rows


def our_beam_search(rows, prompt, width, max_new, eos, lp, es):
    search = BeamSearch(width, max_new, eos, length_penalty=lp, early_stopping=es)
    steps = 0
    while not search.done:
        logprobs = torch.stack([rows[tuple(prompt + beam)] for beam in search.running_tokens])
        search.step(*row_candidates(logprobs, search.beams_to_keep))
        steps += 1
    hyps = search.results()
    return [h.token_ids for h in hyps], [h.score for h in hyps], steps


@pytest.fixture(scope="module")
def common_tokens(tiny_hf) -> list[int]:
    """The model's most likely tokens on average: EOS ids that end beams often."""
    contexts = torch.randint(2, VOCAB, (64, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        mean = torch.log_softmax(tiny_hf(contexts).logits.float(), -1).mean((0, 1))
    return mean.argsort(descending=True).tolist()


# every value of each parameter, every pair of (width, early_stopping), (width, length_penalty)
# and (early_stopping, length_penalty): a Latin square, plus a negative length_penalty
CASES = [
    (w, es, [0.0, 1.0, 2.0][(i + j) % 3])
    for i, w in enumerate([2, 4, 8])
    for j, es in enumerate([False, True, "never"])
]
CASES.append((4, "never", -0.5))


@pytest.mark.parametrize("width,es,lp", CASES)
def test_selection_equals_transformers_bit_for_bit(tiny_hf, common_tokens, width, es, lp):
    gen = torch.Generator().manual_seed(width)
    for prompt_len, max_new in [(5, 20), (23, 9)]:
        prompt = torch.randint(2, VOCAB, (prompt_len,), generator=gen).tolist()
        # a rare EOS (beams run to max_new_tokens) and two frequent ones (beams finish early)
        for eos in [(1,), tuple(common_tokens[1:3])]:
            seqs, scores, rows = hf_beam_search(tiny_hf, prompt, width, max_new, eos, lp, es)
            ours, our_scores, _ = our_beam_search(rows, prompt, width, max_new, eos, lp, es)
            assert ours == seqs, (prompt_len, eos)
            assert our_scores == scores, (prompt_len, eos)


def test_finished_hypotheses_and_stopping_on_a_hand_made_example():
    """Two beams, EOS = 0, vocabulary of 8: an EOS candidate ranked below the beam width is
    not kept; early_stopping=True stops once two hypotheses are finished."""
    search = BeamSearch(2, max_new_tokens=10, eos_token_ids=[0], length_penalty=1.0, early_stopping=True)

    def lp(logits, dim):
        return row_candidates(torch.log_softmax(logits, dim), search.beams_to_keep)

    # step 1: best tokens 3, 0 (EOS, rank 2 < width: finished, score = logprob / 1), 5
    step = search.step(*lp(torch.tensor([[3.0, -9, -9, 4.0, -9, 2.0, -9, -9]]), -1))
    assert (step.parents, step.tokens) == ([0, 0], [3, 5])
    assert [h.token_ids for h in search.finished if h] == [[0]]
    # step 2: beam [3] ends with EOS (rank 1): the second finished hypothesis; stop
    step = search.step(*lp(torch.tensor([[5.0, -9, -9, -9, -9, -9, 1, -9], [-9, -9, -9, -9, 2.0, -9, -9, 0]]), -1))
    assert step.done and search.done and search.num_live == 0
    hyps = search.results()
    assert sorted(h.token_ids for h in hyps) == [[0], [3, 0]]
    assert all(h.eos for h in hyps)
    for h in hyps:
        assert h.score == pytest.approx(h.cumulative_logprob / len(h.token_ids))


def test_the_last_allowed_token_finishes_every_candidate():
    search = BeamSearch(3, max_new_tokens=2, eos_token_ids=[], length_penalty=0.0)
    gen = torch.Generator().manual_seed(0)
    while not search.done:
        rows = torch.log_softmax(torch.randn(search.num_live, 50, generator=gen), -1)
        search.step(*row_candidates(rows, search.beams_to_keep))
    hyps = search.results()
    assert len(hyps) == 3 and all(len(h.token_ids) == 2 and not h.eos for h in hyps)
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    assert all(h.score == pytest.approx(h.cumulative_logprob) for h in hyps)  # length_penalty 0


def test_too_small_a_vocabulary_is_an_error():
    with pytest.raises(ValueError, match="more than the vocabulary"):
        row_candidates(torch.zeros(1, 10), BeamSearch(4, 5, [1, 2]).beams_to_keep)


@pytest.mark.parametrize("rows,vocab,k", [(4, 49152, 8), (3, 2 * 49152 + 17, 6), (2, 16 * 4096, 32), (5, 100, 5)])
def test_row_candidates_equal_torch_topk(rows, vocab, k):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=gen) * 3 - 10
    assert [t.tolist() for t in row_candidates(x, k)] == [t.tolist() for t in torch.topk(x, k, dim=-1)]
    # a row's top k all in one column of the [64, vocab / 64] view, another's at the padded end
    cols = -(-vocab // 64)
    x[0, torch.arange(k) * cols + 3] = torch.arange(k, dtype=torch.float32)
    x[-1, -1] = 100.0
    assert [t.tolist() for t in row_candidates(x, k)] == [t.tolist() for t in torch.topk(x, k, dim=-1)]
