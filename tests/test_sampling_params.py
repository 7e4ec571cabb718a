from __future__ import annotations

from typing import Any

import pytest

from kernel.sampling_params import SamplingParams, SamplingParamsError


def test_defaults_from_none_and_empty() -> None:
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_full_dict_round_trips() -> None:
    p = SamplingParams.from_dict({
        "max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.2,
        "seed": 3, "stop": ["a", "bc"], "stop_token_ids": [1, 2], "ignore_eos": True,
        "return_logprob": True, "top_logprobs_num": 5, "skip_special_tokens": False,
    })
    assert p == SamplingParams(7, 0.5, 0.9, 40, 0.05, 0.5, -0.5, 1.2, 3, ("a", "bc"), (1, 2),
                               True, True, 5, False)


def test_aliases_and_shapes() -> None:
    p = SamplingParams.from_dict({"max_tokens": 5, "stop": "END", "temperature": 1, "top_p": 1})
    assert p.max_new_tokens == 5 and p.stop == ("END",)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams.from_dict({"temperature": None}).temperature == 1.0


def test_max_tokens_twice_rejected() -> None:
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams.from_dict({"max_tokens": 5, "max_new_tokens": 5})


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.7, top_k=2).greedy


@pytest.mark.parametrize("key,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", -0.1), ("min_p", 1.1),
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.1), ("presence_penalty", 3),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1), ("max_new_tokens", -1),
    ("max_new_tokens", 1_000_001), ("top_logprobs_num", 21), ("top_logprobs_num", -1),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", 5), ("stop", [1]), ("stop_token_ids", 3),
    ("stop_token_ids", [1, "a"]), ("stop_token_ids", [True]), ("stop_token_ids", [-1]),
    ("seed", 1.5), ("seed", "7"), ("seed", True), ("top_k", True), ("top_k", 2.0),
    ("max_tokens", 1.0), ("temperature", "hot"), ("temperature", True),
    ("ignore_eos", 1), ("return_logprob", "yes"), ("skip_special_tokens", 0),
])
def test_bad_value_names_the_key(key: str, value: Any) -> None:
    with pytest.raises(SamplingParamsError, match=key):
        SamplingParams.from_dict({key: value})


def test_unknown_key_named() -> None:
    with pytest.raises(SamplingParamsError, match="top_q"):
        SamplingParams.from_dict({"top_q": 0.5})


def test_not_a_mapping() -> None:
    with pytest.raises(SamplingParamsError):
        SamplingParams.from_dict([("top_p", 0.5)])  # type: ignore[arg-type]


def test_direct_construction_validates() -> None:
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=2.0)


def test_error_is_value_error() -> None:
    assert issubclass(SamplingParamsError, ValueError)
