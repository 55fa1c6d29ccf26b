"""The shared sampler: filters, penalties, seeds and parameter validation."""

import pytest
import torch

from edgellm.errors import InvalidParameterError
from edgellm.sampling.params import SamplingParams
from edgellm.sampling.sampler import filter_logits, make_generator, process_logits, sample_token

LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))


def kept(params: SamplingParams) -> list[int]:
    return torch.isfinite(filter_logits(LOGITS.clone(), params)).nonzero()[:, 0].tolist()


def test_top_k_top_p_min_p_keep_the_right_tokens():
    assert kept(SamplingParams(top_k=2)) == [0, 1]
    assert kept(SamplingParams(top_p=0.5)) == [0]  # 0.5 alone reaches 0.5
    assert kept(SamplingParams(top_p=0.6)) == [0, 1]
    assert kept(SamplingParams(top_p=0.86)) == [0, 1, 2, 3]
    assert kept(SamplingParams(min_p=0.3)) == [0, 1, 2]  # >= 0.15 = 0.3 * 0.5
    assert kept(SamplingParams()) == [0, 1, 2, 3, 4]


def test_temperature_sharpens():
    cold = filter_logits(LOGITS.clone(), SamplingParams(temperature=0.5)).softmax(-1)
    assert cold[0] > 0.5 and torch.isclose(cold.sum(), torch.tensor(1.0))


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = process_logits(logits, SamplingParams(temperature=0, repetition_penalty=2.0), [0], [1])
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]
    pres = process_logits(
        logits,
        SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5),
        [3],
        [2, 2],
    )
    assert pres.tolist() == [2.0, -2.0, -1.0, 0.5]  # 1 - 1.0 - 0.5 * 2; prompt tokens untouched


def test_sampling_follows_the_distribution_and_seeds_reproduce():
    params = SamplingParams(temperature=1.0)
    g = make_generator(0)
    draws = torch.tensor([sample_token(LOGITS, params, g) for _ in range(20000)])
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    torch.testing.assert_close(freq, LOGITS.exp(), atol=0.015, rtol=0)
    a = [sample_token(LOGITS, params, make_generator(5)) for _ in range(3)]
    b = [sample_token(LOGITS, params, make_generator(5)) for _ in range(3)]
    assert a == b
    assert sample_token(LOGITS, SamplingParams(temperature=0), None) == 0


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 2},
        {"max_tokens": 0},
        {"n": 0},
        {"repetition_penalty": 0},
        {"presence_penalty": 3},
        {"seed": -(2**63) - 1},
        {"logprobs": 50},
    ],
)
def test_invalid_parameters_raise(kw):
    with pytest.raises(InvalidParameterError, match="invalid sampling parameters"):
        SamplingParams(**kw)
