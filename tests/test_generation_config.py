"""vLLM's generation_config / override_generation_config (the defaults a request's unset
sampling fields take) and logprobs_mode (what ``logprobs`` hold). Tiny random model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import default_sampling_params
from minivllm.engine.arg_utils import EngineArgs
from minivllm.layers.sampler import Sampler, SamplingMetadata


def _gen_folder(tmp_path, **fields):
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    return str(tmp_path)


# --- reading the generation config ----------------------------------------------------

def test_fields_that_differ_from_transformers_defaults_become_sampling_defaults(tmp_path):
    folder = _gen_folder(tmp_path, bos_token_id=1, eos_token_id=2, do_sample=True,
                         temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1,
                         max_new_tokens=64)
    got = default_sampling_params(folder, "/nonexistent")
    assert got == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                   "max_tokens": 64}
    # fields outside the list (do_sample, token ids) never become sampling defaults
    assert default_sampling_params(_gen_folder(tmp_path, do_sample=True, num_beams=1,
                                               temperature=0.7), "/x") == {"temperature": 0.7}


def test_auto_reads_the_model_folder_vllm_reads_nothing_and_overrides_go_on_top(tmp_path):
    model = _gen_folder(tmp_path, do_sample=True, temperature=0.6, top_p=0.9)
    assert default_sampling_params("auto", model) == {"temperature": 0.6, "top_p": 0.9}
    assert default_sampling_params("vllm", model) == {}
    assert default_sampling_params("auto", model, {"temperature": 0.2, "min_p": 0.05}) == \
        {"temperature": 0.2, "top_p": 0.9, "min_p": 0.05}
    assert default_sampling_params("vllm", model, {"max_new_tokens": 8}) == {"max_tokens": 8}
    # "auto" on a folder without the file: no defaults (vLLM's behaviour)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert default_sampling_params("auto", str(empty)) == {}


def test_a_folder_without_generation_config_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no generation_config.json"):
        default_sampling_params(str(tmp_path), "/x")


@pytest.mark.parametrize("field, value, match", [
    ("generation_config", "", "generation_config must be"),
    ("generation_config", 3, "generation_config must be"),
    ("override_generation_config", ["temperature"], "override_generation_config must be"),
    ("logprobs_mode", "logits", "logprobs_mode must be one of"),
])
def test_bad_arguments_are_refused_with_a_message(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**{field: value}).validate()


# --- in the engine ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_kw(tiny_model_dir):
    return dict(model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64,
                max_model_len=128)


def test_generate_without_params_uses_the_generation_config(engine_kw, tmp_path):
    folder = _gen_folder(tmp_path, max_new_tokens=5)
    llm = LLM(**engine_kw, generation_config=folder,
              override_generation_config={"temperature": 0.0})
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens) == (0.0, 5)
    prompt = [5, 9, 17, 3]
    out = llm.generate(prompt)[0].outputs[0].token_ids
    want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5))[0] \
        .outputs[0].token_ids
    assert len(out) == 5 and out == want
    # without a generation config, the defaults are SamplingParams' own
    plain = LLM(**engine_kw, generation_config="vllm")
    assert plain.get_default_sampling_params().max_tokens == SamplingParams().max_tokens


def test_a_generation_config_value_samplingparams_refuses_fails_at_start(engine_kw):
    with pytest.raises(ValueError, match="SamplingParams refuses"):
        LLM(**engine_kw, generation_config="vllm",
            override_generation_config={"temperature": -1.0})


# --- logprobs_mode: the sampler ---------------------------------------------------------

def _meta(temperature, top_k=None):
    return SamplingMetadata(temperature=torch.tensor(temperature),
                            top_k=None if top_k is None else torch.tensor(top_k),
                            prompt_token_ids=[[], []], output_token_ids=[[], []],
                            max_num_logprobs=3)


def test_each_logprobs_mode_returns_its_values():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 11, generator=g) * 3
    meta = _meta([0.0, 0.5], top_k=[-1, 2])  # row 0 greedy, row 1 sampled, top-2, T=0.5
    outs = {}
    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"):
        outs[mode] = Sampler(torch.Generator().manual_seed(1), mode)(logits.clone(), meta)
    tok = outs["raw_logits"].sampled
    assert all(torch.equal(o.sampled, tok) for o in outs.values())  # same draws
    raw_lp = torch.log_softmax(logits, -1)
    processed = logits.clone()
    processed[1] = logits[1] / 0.5
    kth = processed[1].topk(2).values[-1]
    processed[1][processed[1] < kth] = -math.inf
    want = {"raw_logprobs": raw_lp, "raw_logits": logits,
            "processed_logprobs": torch.log_softmax(processed, -1),
            "processed_logits": processed}
    for mode, values in want.items():
        o = outs[mode]
        err = (o.sampled_logprobs - values.gather(1, tok[:, None]).squeeze(1)).abs().max()
        print(mode, "max error of the sampled token's value", float(err))
        assert err <= 1e-6  # float32, same ops
        assert torch.equal(o.topk_ids[0], values[0].topk(3).indices)
    # processed: the sampled row has only 2 finite candidates, the rest -inf
    assert torch.isinf(outs["processed_logprobs"].topk_logprobs[1, 2])
    assert not torch.isinf(outs["raw_logprobs"].topk_logprobs[1]).any()


def test_the_sampler_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        Sampler(None, "logits")


# --- logprobs_mode: end to end ----------------------------------------------------------

def test_raw_logits_differ_from_raw_logprobs_by_one_shift_per_position(engine_kw):
    prompt = [5, 9, 17, 3, 8]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    lp = LLM(**engine_kw).generate(prompt, params)[0]
    lg = LLM(**engine_kw, logprobs_mode="raw_logits").generate(prompt, params)[0]
    assert lp.outputs[0].token_ids == lg.outputs[0].token_ids
    worst = 0.0
    for a, b in zip(lp.outputs[0].logprobs + lp.prompt_logprobs[1:],
                    lg.outputs[0].logprobs + lg.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and [v.rank for v in a.values()] == \
            [v.rank for v in b.values()]
        shifts = [b[t].logprob - a[t].logprob for t in a]  # = logsumexp of the logits
        worst = max(worst, max(shifts) - min(shifts))
        assert min(shifts) > 0  # logits sit above log-probs by log(sum exp) > 0 here
    print("largest spread of the shift within a position (float32):", worst)
    assert worst <= 1e-4


# --- the OpenAI server's requests --------------------------------------------------------

def test_a_request_takes_the_model_defaults_only_for_fields_it_does_not_send():
    from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    defaults = {"temperature": 0.3, "top_p": 0.8, "max_tokens": 10}
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    p = chat.sampling_params(None, None, defaults)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.3, 0.8, -1, 10)
    sent = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 temperature=0.9, max_tokens=50)
    p = sent.sampling_params(None, None, defaults)
    assert (p.temperature, p.top_p, p.max_tokens) == (0.9, 0.8, 10)  # max_tokens capped
    # no generation config: vLLM's defaults, OpenAI's 16 tokens for completions
    p = CompletionRequest(model="m", prompt="hi").sampling_params(16, None, {})
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) \
        == (1.0, 1.0, -1, 0.0, 1.0, 16)
