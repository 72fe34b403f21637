"""SamplingParams validation and the Sampler (greedy, filters, penalties, seeds, logprobs)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from kvserve.engine.request import Request
from kvserve.layers.sampler import Sampler, _filtered_probs, _logits_processed, apply_penalties
from kvserve.sampling_params import SamplingParams

EOS = 2

# SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": None}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"seed": 1.0}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["7"]}, "stop_token_ids"),
    ],
)
def test_invalid_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("kwargs", "field"), [({"stop": 5}, "stop"), ({"stop_token_ids": 5}, "stop_token_ids")])
def test_non_list_stop_fields_raise_value_error(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_params_and_normalisation() -> None:
    sp = SamplingParams(top_k=-1, stop="###", stop_token_ids=None, max_tokens=None, min_tokens=100)
    assert sp.top_k == 0 and sp.stop_strings == ["###"] and sp.stop_token_ids == []
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert not SamplingParams().has_penalties and SamplingParams(presence_penalty=0.1).has_penalties
    # The bounds themselves are valid.
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, logprobs=20, seed=2**64 - 1)
    SamplingParams(logprobs=0, seed=-(2**63), max_tokens=3, min_tokens=3)


# Sampler helpers


def make_request(
    params: SamplingParams, prompt: list[int] | None = None, output: Sequence[int] = (), request_id: str = "r"
) -> Request:
    req = Request(request_id, prompt or [0], params, eos_token_ids=(EOS,))
    for t in output:
        req.append_output_token(t, None)
    return req


def sample(logits: torch.Tensor, params: SamplingParams, rows: int = 1, seed: int = 0) -> list[int]:
    """Draw `rows` tokens from the same logits (independent noise per row, one sampler seed)."""
    reqs = [make_request(params, request_id=f"r{i}") for i in range(rows)]
    return [t.token_id for t in Sampler(seed)(logits.expand(rows, -1), reqs)]


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


# greedy and filters


def test_greedy_is_argmax() -> None:
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    reqs = [make_request(SamplingParams(temperature=0), request_id=f"r{i}") for i in range(16)]
    got = [t.token_id for t in Sampler()(logits, reqs)]
    assert got == logits.argmax(dim=-1).tolist()


def test_greedy_takes_the_first_maximum_and_a_nan_as_torch_does() -> None:
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1, 3, 3, 0], [1, nan, 5, nan], [-inf] * 4, [2, 2, 2, 2], [0, 0, inf, inf]])
    reqs = [make_request(SamplingParams(temperature=0), request_id=f"r{i}") for i in range(len(logits))]
    got = [t.token_id for t in Sampler()(logits, reqs)]
    assert got == logits.max(dim=-1).indices.tolist() == [1, 1, 0, 0, 2]


def test_sampler_does_not_modify_logits() -> None:
    logits = torch.randn(2, 10)
    before = logits.clone()
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, top_k=3, min_tokens=2)
    Sampler()(logits, [make_request(params, [1, 2, 3], [4]), make_request(params, [EOS], [])])
    assert torch.equal(logits, before)


def test_top_k_1_is_greedy() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    reqs = [make_request(SamplingParams(temperature=1.0, top_k=1), request_id=f"r{i}") for i in range(64)]
    assert [t.token_id for t in Sampler()(logits, reqs)] == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = torch.tensor([1.0, 3.0, 2.9, 0.0])
    assert set(sample(logits, SamplingParams(top_p=1e-6), rows=500)) == {1}


def test_temperature_sampling_matches_softmax() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    tokens = sample(logits, SamplingParams(temperature=0.7), rows=20_000)
    expected = torch.softmax(logits.double() / 0.7, dim=-1)
    # Standard error is at most 0.0036 at this many draws: 0.015 is > 4 sigma.
    assert torch.allclose(frequencies(tokens, 5), expected, atol=0.015)


def test_top_k_renormalises_over_the_k_best() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    tokens = sample(logits, SamplingParams(top_k=2), rows=20_000)
    expected = torch.zeros(5, dtype=torch.double)
    expected[[2, 1]] = torch.softmax(torch.tensor([2.0, 1.0], dtype=torch.double), dim=-1)
    assert torch.allclose(frequencies(tokens, 5), expected, atol=0.015)


def test_top_k_past_the_vocabulary_keeps_every_token() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    for top_k in (5, 6, 2**80):  # a JSON integer past int64 included
        probs = _filtered_probs(logits.unsqueeze(0), [SamplingParams(top_k=top_k)])
        torch.testing.assert_close(probs[0], torch.softmax(logits, dim=-1))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tokens = sample(probs.log(), SamplingParams(top_p=0.7), rows=20_000)
    # 0.5 < 0.7 so token 1 is kept too; the mass before token 2 is 0.8 >= 0.7.
    expected = torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.double)
    assert torch.allclose(frequencies(tokens, 4), expected, atol=0.015)


def test_min_p_drops_tokens_below_fraction_of_the_top() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tokens = sample(probs.log(), SamplingParams(min_p=0.2), rows=20_000)  # threshold 0.1
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0], dtype=torch.double) / 0.95
    assert torch.allclose(frequencies(tokens, 4), expected, atol=0.015)


def test_unfiltered_row_is_unaffected_by_filtering_neighbours() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(0)) * 10
    alone = _filtered_probs(logits, [SamplingParams()])
    in_batch = _filtered_probs(torch.cat([logits, logits]), [SamplingParams(), SamplingParams(top_k=5)])
    assert torch.equal(in_batch[0], alone[0])


# seeds


def test_sampler_seed_makes_unseeded_draws_reproducible() -> None:
    logits = torch.zeros(1, 1000)
    assert sample(logits, SamplingParams(), rows=20, seed=3) == sample(logits, SamplingParams(), rows=20, seed=3)
    assert sample(logits, SamplingParams(), rows=20, seed=3) != sample(logits, SamplingParams(), rows=20, seed=4)


def seeded_tokens(seed: int, neighbours: list[SamplingParams], position: int, steps: int = 10) -> list[int]:
    """A seeded request's tokens over `steps` steps, sampled next to other rows."""
    own = torch.randn(1, 1000, generator=torch.Generator().manual_seed(99))
    theirs = torch.randn(len(neighbours), 1000, generator=torch.Generator().manual_seed(98))
    req = make_request(SamplingParams(seed=seed, temperature=1.5), request_id="seeded")
    others = [make_request(p, request_id=f"o{i}") for i, p in enumerate(neighbours)]
    batch = others[:position] + [req] + others[position:]
    sampler = Sampler(seed=position)  # the unseeded rows draw differently each time
    rows = torch.cat([theirs[:position], own, theirs[position:]])
    return [sampler(rows, batch)[position].token_id for _ in range(steps)]


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    alone = seeded_tokens(7, [], 0)
    neighbours = [SamplingParams(), SamplingParams(seed=8, top_p=0.5), SamplingParams(temperature=0)]
    assert seeded_tokens(7, neighbours, 0) == alone
    assert seeded_tokens(7, neighbours, 2) == alone
    assert len(set(alone)) > 1  # it really sampled


def seeded_draws(seed: int, steps: int = 20) -> list[int]:
    req, sampler, logits = make_request(SamplingParams(seed=seed)), Sampler(), torch.zeros(1, 1000)
    return [sampler(logits, [req])[0].token_id for _ in range(steps)]


def test_different_seeds_differ_on_a_flat_distribution() -> None:
    assert seeded_draws(1) == seeded_draws(1)
    assert seeded_draws(1) != seeded_draws(2)


def test_forked_samples_get_their_own_seeds() -> None:
    parent = make_request(SamplingParams(seed=5, n=3))
    children = [parent.fork(i) for i in (1, 2)]
    logits = torch.zeros(3, 1000)
    tokens = [t.token_id for t in Sampler()(logits, [parent, *children])]
    assert len(set(tokens)) == 3
    again = make_request(SamplingParams(seed=5, n=3))
    assert Sampler()(logits[:1], [again])[0].token_id == tokens[0]


def test_every_valid_seed_works_for_every_sample() -> None:
    parent = make_request(SamplingParams(seed=2**64 - 1, n=2))
    child = parent.fork(1)
    assert child.generator is not None


# penalties and min_tokens


ROW = [2.0, -2.0, 1.0, -1.0, 0.5, 3.0]


def penalised(params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    row = torch.tensor(ROW)
    apply_penalties(row, make_request(params, prompt, output))
    return row.tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    got = penalised(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[2, 3, 3])
    assert got == [1.0, -4.0, 0.5, -2.0, 0.5, 3.0]


def test_presence_and_frequency_penalise_output_tokens_only() -> None:
    prompt, output = [0, 4], [2, 3, 3]
    assert penalised(SamplingParams(presence_penalty=0.5), prompt, output) == [2.0, -2.0, 0.5, -1.5, 0.5, 3.0]
    assert penalised(SamplingParams(frequency_penalty=0.25), prompt, output) == [2.0, -2.0, 0.75, -1.5, 0.5, 3.0]
    both = penalised(SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25), prompt, output)
    assert both == [2.0, -2.0, 0.75, -1.0, 0.5, 3.0]


def test_penalties_without_output_change_only_repetition() -> None:
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)
    assert penalised(params, prompt=[0, 5], output=[]) == ROW


def test_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0]])
    fresh = make_request(SamplingParams(temperature=0, frequency_penalty=2.0))
    repeated = make_request(SamplingParams(temperature=0, frequency_penalty=2.0), output=[1])
    assert Sampler()(logits, [fresh])[0].token_id == 1
    assert Sampler()(logits, [repeated])[0].token_id == 2


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0]])  # EOS = 2 is the favourite, then 3
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    assert Sampler()(logits, [make_request(params, output=[0])])[0].token_id == 4
    assert Sampler()(logits, [make_request(params, output=[0, 0])])[0].token_id == EOS
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert Sampler()(logits, [make_request(ignoring)])[0].token_id == EOS
    tokens = sample(logits, SamplingParams(min_tokens=1, stop_token_ids=[3]), rows=500)
    assert EOS not in tokens and 3 not in tokens


def test_only_greedy_batches_without_penalties_or_logprobs_may_take_the_fused_argmax() -> None:
    def batch(**kwargs) -> list[Request]:
        return [make_request(SamplingParams(temperature=0)), make_request(SamplingParams(**kwargs), output=[0])]

    assert Sampler.argmax_only(batch(temperature=0, max_tokens=4, ignore_eos=True))
    assert Sampler.argmax_only(batch(temperature=0, min_tokens=2))  # masking goes to the head as banned ids
    for kwargs in ({}, {"temperature": 0, "logprobs": 0}, {"temperature": 0, "repetition_penalty": 1.1}):
        assert not Sampler.argmax_only(batch(**kwargs)), kwargs


def test_masked_tokens_name_each_rows_stop_tokens_until_min_tokens() -> None:
    rows = [
        make_request(SamplingParams(temperature=0)),  # no min_tokens
        make_request(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]), output=[0]),
        make_request(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]), output=[0, 0]),  # reached
        make_request(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True), output=[0]),  # nothing to mask
    ]
    assert Sampler.masked_tokens(rows, 10).tolist() == [[-1, -1], [3, EOS], [-1, -1], [-1, -1]]
    assert Sampler.masked_tokens([rows[0], rows[3]], 10) is None
    huge = make_request(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2**70, 3]), output=[0])
    assert Sampler.masked_tokens([huge], 10).tolist() == [[3, EOS]]  # ids past the vocab: no logit to mask
    # ignore_eos with min_tokens (the peers' load client sends both) changes no logits
    assert Sampler.argmax_only([rows[3]]) and not _logits_processed(rows[3], 10)


# logprobs


def check_logprobs(logits: torch.Tensor, params: SamplingParams, output: Sequence[int] = ()) -> None:
    (tok,) = Sampler()(logits.unsqueeze(0), [make_request(params, [0], output)])
    raw = torch.log_softmax(logits, dim=-1)
    k = params.logprobs
    assert tok.logprobs is not None and tok.token_id in tok.logprobs
    assert len(tok.logprobs) <= k + 1
    top = raw.topk(k).indices.tolist() if k else []
    assert set(tok.logprobs) == set(top) | {tok.token_id}
    for token_id, lp in tok.logprobs.items():
        assert lp.logprob == pytest.approx(raw[token_id].item(), abs=1e-6)
        assert lp.rank == int((raw > raw[token_id]).sum()) + 1


@pytest.mark.parametrize("k", [0, 1, 3, 20])
def test_logprobs_are_raw_top_k_plus_chosen(k: int) -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(k))
    check_logprobs(logits, SamplingParams(logprobs=k))
    check_logprobs(logits, SamplingParams(logprobs=k, temperature=0.3, top_k=5))


def test_logprobs_ignore_penalties_and_report_chosen_outside_top_k() -> None:
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    params = SamplingParams(logprobs=2, temperature=0, repetition_penalty=100.0)
    (tok,) = Sampler()(logits.unsqueeze(0), [make_request(params, [0, 1, 2, 3])])
    assert tok.token_id == 4
    assert len(tok.logprobs) == 3 and tok.logprobs[4].rank == 5
    assert tok.logprobs[4].logprob == pytest.approx(1.0 - torch.logsumexp(logits, 0).item(), abs=1e-6)


def test_logprobs_only_for_requests_that_ask() -> None:
    logits = torch.randn(2, 10)
    a, b = make_request(SamplingParams(logprobs=2), request_id="a"), make_request(SamplingParams(), request_id="b")
    got = Sampler()(logits, [a, b])
    assert got[0].logprobs is not None and got[1].logprobs is None
    assert all(t.logprobs is None for t in Sampler()(logits, [b, b]))
