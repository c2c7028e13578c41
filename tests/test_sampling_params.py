"""SamplingParams validation: every invalid value raises ValueError naming what is allowed.

Each case gives the field, a bad value and a regular expression the message must match;
the expression names the field and the allowed range/values, so a message that only
says "invalid" fails. Valid edge values must be accepted unchanged (nothing is clamped).
"""

from __future__ import annotations

import re

import pytest

from minivllm.sampling_params import SamplingParams

NAN = float("nan")
INF = float("inf")

# (kwargs, regex the ValueError message must match)
INVALID = [
    # temperature: >= 0 (0 = greedy)
    ({"temperature": -0.5}, r"temperature.*non-negative"),
    ({"temperature": -1e-9}, r"temperature.*non-negative"),
    ({"temperature": NAN}, r"temperature.*finite"),
    ({"temperature": INF}, r"temperature.*finite"),
    # top_p in (0, 1]
    ({"top_p": 0.0}, r"top_p.*\(0, 1\]"),
    ({"top_p": -0.1}, r"top_p.*\(0, 1\]"),
    ({"top_p": 1.5}, r"top_p.*\(0, 1\]"),
    ({"top_p": 1.0000001}, r"top_p.*\(0, 1\]"),
    ({"top_p": NAN}, r"top_p.*(finite|\(0, 1\])"),
    # top_k: integer >= -1
    ({"top_k": -2}, r"top_k.*integer.*>= -1"),
    ({"top_k": -100}, r"top_k.*integer.*>= -1"),
    ({"top_k": 2.5}, r"top_k.*integer.*>= -1"),
    ({"top_k": 3.0}, r"top_k.*integer.*>= -1"),
    ({"top_k": "5"}, r"top_k.*integer.*>= -1"),
    ({"top_k": True}, r"top_k.*integer.*>= -1"),
    # min_p in [0, 1]
    ({"min_p": -0.01}, r"min_p.*\[0, 1\]"),
    ({"min_p": 1.01}, r"min_p.*\[0, 1\]"),
    ({"min_p": NAN}, r"min_p.*(finite|\[0, 1\])"),
    # max_tokens: integer >= 1
    ({"max_tokens": 0}, r"max_tokens.*>= 1"),
    ({"max_tokens": -3}, r"max_tokens.*>= 1"),
    ({"max_tokens": 2.0}, r"max_tokens.*integer"),
    # penalties
    ({"presence_penalty": 2.01}, r"presence_penalty.*\[-2, 2\]"),
    ({"presence_penalty": -2.5}, r"presence_penalty.*\[-2, 2\]"),
    ({"frequency_penalty": 3.0}, r"frequency_penalty.*\[-2, 2\]"),
    ({"frequency_penalty": -2.0001}, r"frequency_penalty.*\[-2, 2\]"),
    ({"frequency_penalty": NAN}, r"frequency_penalty.*finite"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty.*> 0"),
    ({"repetition_penalty": -1.0}, r"repetition_penalty.*> 0"),
    ({"repetition_penalty": INF}, r"repetition_penalty.*finite"),
    # n: only 1
    ({"n": 2}, r"n must be 1"),
    ({"n": 0}, r"n must be 1"),
    # stop strings must be non-empty
    ({"stop": ""}, r"stop.*non-empty"),
    ({"stop": ["ok", ""]}, r"stop.*non-empty"),
    ({"stop": ["ok", 3]}, r"stop.*strings"),
    # min_tokens
    ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens \(5\).*<= max_tokens \(4\)"),
    ({"min_tokens": -1}, r"min_tokens.*>= 0"),
    # logprobs / prompt_logprobs
    ({"logprobs": -1}, r"logprobs.*integer >= 0"),
    ({"prompt_logprobs": -2}, r"prompt_logprobs.*integer >= 0"),
    ({"logprobs": 1.5}, r"logprobs.*integer >= 0"),
    # seed, stop_token_ids
    ({"seed": 1.5}, r"seed.*integer"),
    ({"stop_token_ids": [3, -1]}, r"stop_token_ids.*non-negative integers"),
]


@pytest.mark.parametrize("kwargs,pattern", INVALID, ids=[repr(k) for k, _ in INVALID])
def test_invalid_values_raise_with_allowed_range(kwargs, pattern):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    msg = str(exc.value)
    assert re.search(pattern, msg), f"message {msg!r} does not match {pattern!r}"
    # the message also shows the offending value (so the user sees what they passed)
    key, value = next(iter(kwargs.items()))
    if key == "min_tokens" and "max_tokens" in kwargs:
        return
    shown = {repr(value), str(value)}
    if isinstance(value, list):
        shown |= {repr(v) for v in value}
    assert any(s in msg for s in shown), f"message {msg!r} does not show the value {value!r}"


VALID = [
    {"temperature": 0.0},
    {"temperature": 1e-6},
    {"temperature": 100.0},
    {"top_p": 1.0},
    {"top_p": 1e-6},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"top_k": 10_000},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"presence_penalty": -2.0},
    {"presence_penalty": 2.0},
    {"frequency_penalty": -2.0},
    {"frequency_penalty": 2.0},
    {"repetition_penalty": 1e-3},
    {"repetition_penalty": 5.0},
    {"max_tokens": 1},
    {"max_tokens": None},
    {"max_tokens": None, "min_tokens": 1000},
    {"min_tokens": 16, "max_tokens": 16},
    {"logprobs": 0},
    {"logprobs": 20},
    {"prompt_logprobs": 0},
    {"seed": 0},
    {"seed": -7},
    {"seed": 2**40},
    {"stop": "x"},
    {"stop": ["a", "bc"]},
    {"stop_token_ids": [0, 5]},
    {"n": 1},
    {"temperature": 1, "top_p": 1, "min_p": 0},  # ints for float fields
]


@pytest.mark.parametrize("kwargs", VALID, ids=[repr(k) for k in VALID])
def test_valid_edge_values_are_accepted_unchanged(kwargs):
    p = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        if key == "stop_token_ids":
            assert p.stop_token_ids == list(value)
        else:
            assert getattr(p, key) == value, key  # not clamped or rewritten


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.logprobs is None and p.prompt_logprobs is None and p.seed is None
    assert p.stop_strings == [] and p.stop_token_ids == []
    assert not p.ignore_eos and p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.is_greedy


def test_stop_normalisation_and_greedy_flag():
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(stop=("a", "b")).stop_strings == ["a", "b"]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy  # below vLLM's 1e-5 epsilon
    assert not SamplingParams(temperature=1e-4).is_greedy
