"""Hostile-but-realistic inputs: each gets a ValueError/TypeError that names what was wrong
and what is allowed (never an IndexError/KeyError/RuntimeError from deep inside torch,
transformers or jinja), nothing is silently ignored, and the engine holds no blocks or
requests afterwards and keeps working. Tiny random model only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.cli import main as cli_main


pytestmark = pytest.mark.usefixtures("one_thread")


def make_llm(model_dir, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 64)
    kw.setdefault("num_gpu_blocks_override", 32)
    return LLM(model=str(model_dir), **kw)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return make_llm(tiny_model_dir)


def greedy(max_tokens=3, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_clean(llm: LLM) -> None:
    """No blocks held, no requests left, and the engine still generates."""
    engine = llm.llm_engine
    st = llm.stats
    assert st.num_free_blocks == st.num_total_blocks
    assert not engine.scheduler.requests
    assert not engine.finished_outputs
    out = llm.generate([[5, 6, 7]], greedy())[0]
    assert len(out.outputs[0].token_ids) == 3


# --- engine arguments --------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,pattern", [
    ({"seed": 1.5}, r"seed must be an integer"),
    ({"seed": None}, r"seed must be an integer"),
    ({"seed": 2**70}, r"seed must be an integer in \[-2\*\*63"),
    ({"enable_prefix_caching": "no"}, r"enable_prefix_caching must be True or False"),
    ({"enable_chunked_prefill": None}, r"enable_chunked_prefill must be True or False"),
    ({"calculate_kv_scales": True}, r"apply to a quantized KV cache, but kv_cache_dtype='auto'"),
    ({"calculate_kv_scales": "yes", "kv_cache_dtype": "fp8"},
     r"calculate_kv_scales must be True or False"),
    ({"kv_cache_dtype": "int8"}, r"kv_cache_dtype='int8' needs scales"),
    ({"kv_cache_dtype": "fp8", "kv_scale_type": "per-token"}, r"kv_scale_type must be"),
    ({"kv_cache_dtype": "fp8", "kv_scale_granularity": "head"},
     r"kv_scale_granularity='head' needs calculate_kv_scales=True"),
    ({"kv_cache_dtype": "fp8", "kv_scale_granularity": "channel"},
     r"kv_scale_granularity='channel' needs calculate_kv_scales=True"),
    ({"kv_cache_dtype": "fp8", "kv_scale_granularity": "token"},
     r"kv_scale_granularity must be 'tensor', 'head' or 'channel'"),
    ({"kv_cache_dtype": "fp8", "kv_scale_type": "dynamic", "calculate_kv_scales": True},
     r"pick one"),
    ({"kv_cache_dtype": "fp8", "kv_scale": (1.0, 1.0), "calculate_kv_scales": True},
     r"cannot be combined"),
    ({"quantization": "int3"}, r"Unknown quantization 'int3'; allowed: int8, int4, awq"),
    # the draft model's method, checked by EngineArgs.validate (config.py cannot see the
    # registry)
    ({"speculative_config": {"model": "x", "num_speculative_tokens": 1,
                             "quantization": "int3"}},
     r"Unknown quantization 'int3'; allowed: int8, int4, awq"),
    ({"quantization_config": {"group_size": 64}}, r"without quantization"),
    ({"quantization": "int4", "quantization_config": {"group_size": 48}},
     r"group_size.*must be the integer 32, 64 or 128, got 48"),
    ({"quantization": "int4", "quantization_config": {"groupsize": 64}},
     r"Unknown quantization_config option\(s\) \['groupsize'\]"),
    ({"quantization": "int8", "quantization_config": "channel"},
     r"quantization_config must be a dict"),
    ({"quantization": "fp8", "quantization_config": {"activation_scheme": "token"}},
     r"activation_scheme.*'dynamic' or 'static'"),
    ({"quantization": "gptq", "quantization_config": {"percdamp": 0}}, r"percdamp"),
    ({"quantization": "int4", "quantization_config": {"group_size": 64.0}},
     r"group_size.*must be the integer 32, 64 or 128, got 64.0"),
    ({"quantization": "awq", "quantization_config": {"n_grid": 10**9}}, r"n_grid.*\[2, 1000\]"),
    ({"quantization": "fp8", "quantization_config": {"calibration": "corpus"}},
     r"only apply to fp8 with activation_scheme='static'"),
    ({"quantization": ["int8"]}, r"Unknown quantization \['int8'\]"),
    ({"kv_cache_dtype": "int8", "kv_scale": (1e-50, 1.0)}, r"float32's normal range"),
    ({"kv_cache_dtype": "int8", "kv_scale": (1e39, 1.0)}, r"float32's normal range"),
    ({"float32_matmul_precision": "medium"}, r"float32_matmul_precision must be 'highest' or 'high'"),
    ({"kv_scale": (float("inf"), 1.0), "kv_cache_dtype": "fp8"}, r"kv_scale must be two finite"),
    ({"kv_scale": 2.0, "kv_cache_dtype": "fp8"}, r"kv_scale must be two finite"),
    ({"kv_scale": (2.0, 2.0)}, r"apply to a quantized KV cache"),
    ({"gpu_memory_utilization": "0.5"}, r"gpu_memory_utilization must be a number"),
    ({"dtype": ["float16"]}, r"Unknown dtype"),
    ({"kv_cache_dtype": []}, r"Unsupported kv_cache_dtype"),
    ({"device": "cuda:x"}, r"Unknown device 'cuda:x'; allowed: cpu, cuda, cuda:N"),
    ({"tokenizer": ""}, r"tokenizer must be None or a non-empty string"),
])
def test_engine_arg_types(tiny_model_dir, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_llm(tiny_model_dir, **kwargs)


@pytest.mark.parametrize("model", [5, None, ""])
def test_model_must_be_a_string(model):
    with pytest.raises(ValueError, match=r"model must be a non-empty string"):
        LLM(model=model)


def test_model_as_path_object(tiny_model_dir):
    llm = make_llm(Path(tiny_model_dir))
    assert llm.generate([[5, 6]], greedy())[0].outputs[0].finish_reason == "length"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_is_a_value_error(tiny_model_dir):
    # without num_gpu_blocks_override the cache size used to query torch.cuda first
    # (AssertionError "Torch not compiled with CUDA enabled")
    with pytest.raises(ValueError, match=r"device='cuda' was requested"):
        LLM(model=str(tiny_model_dir), device="cuda")


def test_kv_cache_larger_than_memory_is_refused(tiny_model_dir):
    # 10**9 blocks: used to try to allocate terabytes (MemoryError / OOM / a hang)
    with pytest.raises(ValueError, match=r"The KV cache would take .* GiB, but only"):
        make_llm(tiny_model_dir, num_gpu_blocks_override=10**9)


# --- model folders -------------------------------------------------------------------------

def _variant(src, dst: Path, edit=None, text=None) -> str:
    shutil.copytree(src, dst)
    if text is not None:
        (dst / "config.json").write_text(text)
    elif edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("name,edit,text,pattern", [
    ("longrope", lambda c: c.update(rope_scaling={"rope_type": "longrope", "factor": 4.0}),
     None, r"rope_scaling type 'longrope' is not supported \(supported: default, linear"),
    ("llama3", lambda c: c.update(rope_scaling={"type": "llama3", "factor": 8.0}), None,
     r"rope_scaling type 'llama3' needs the field\(s\) \['low_freq_factor'"),
    ("gelu", lambda c: c.update(hidden_act="gelu"), None, r"hidden_act 'gelu' .* not supported"),
    ("noheads", lambda c: c.pop("num_attention_heads"), None,
     r"'num_attention_heads' must be a positive integer"),
    ("mpe", lambda c: c.update(max_position_embeddings="512"), None,
     r"'max_position_embeddings' must be a positive integer"),
    ("badjson", None, "{not json", r"Could not read .*config.json"),
    ("list", None, "[1, 2]", r"config.json must hold a JSON object"),
])
def test_bad_config_json(tiny_model_dir, tmp_path, name, edit, text, pattern):
    path = _variant(tiny_model_dir, tmp_path / name, edit, text)
    with pytest.raises(ValueError, match=pattern):
        make_llm(path)


# --- generate: prompts and sampling_params ------------------------------------------------

@pytest.mark.parametrize("prompts", [None, 5, 1.5, b"hello", {"a", "b"}])
def test_generate_rejects_non_prompt_types(llm, prompts):
    # bytes used to become ints. A dict is vLLM's prompt dict now ({"prompt": ...} or
    # {"prompt_token_ids": ...}, with "cache_salt"); bad ones: tests/test_prefix_cache.py
    with pytest.raises(TypeError, match=r"prompts must be a string, a list of token ids"):
        llm.generate(prompts, greedy())
    assert_clean(llm)


@pytest.mark.parametrize("params", [{"temperature": 0}, "greedy", 3])
def test_generate_rejects_non_sampling_params(llm, params):
    # "greedy" used to be "6 sampling_params for 1 prompts"
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams"):
        llm.generate(["a"], params)
    assert_clean(llm)


def test_tuple_and_numpy_token_ids(llm):
    a = llm.generate((5, 6, 7), greedy())
    b = llm.generate([np.array([5, 6, 7])[i] for i in range(3)], greedy())
    assert len(a) == len(b) == 1
    assert a[0].prompt_token_ids == b[0].prompt_token_ids == [5, 6, 7]
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert_clean(llm)


def test_prompt_with_lone_surrogate(llm):
    with pytest.raises(ValueError, match=r"prompt is not valid Unicode"):
        llm.generate(["fine", "bad \ud800 x"], greedy())
    assert_clean(llm)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_above_vocab(llm, field):
    vocab = llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"{field}={vocab + 1} is more than the vocabulary"):
        llm.generate([[5, 6], [7, 8]], [greedy(), greedy(**{field: vocab + 1})])
    assert_clean(llm)
    out = llm.generate([[5, 6]], greedy(logprobs=vocab))[0]  # the whole vocabulary is fine
    assert len(out.outputs[0].logprobs[0]) == vocab


def test_stop_token_ids_outside_vocab(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError, match=r"stop_token_ids must be token ids in \[0, "):
        llm.generate([[5, 6]], greedy(stop_token_ids=[vocab], min_tokens=1))
    assert_clean(llm)


def test_sampling_params_changed_after_construction(llm):
    sp = greedy()
    sp.max_tokens = 0
    with pytest.raises(ValueError, match=r"max_tokens must be an integer >= 1"):
        llm.generate(["a"], sp)
    sp = greedy(max_tokens=8)
    sp.temperature = "hot"
    with pytest.raises(ValueError, match=r"temperature must be a finite number"):
        llm.generate(["a"], sp)
    assert_clean(llm)
    # a stop string set after construction takes effect (it used to be ignored)
    ref = llm.generate([[5, 6, 7]], greedy(max_tokens=8))[0].outputs[0]
    assert len(ref.text) >= 3
    sp = greedy(max_tokens=8)
    sp.stop = [ref.text[1:3]]
    out = llm.generate([[5, 6, 7]], sp)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == ref.text[1:3]


# --- SamplingParams ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,pattern", [
    ({"stop": 5}, r"stop must be a string, a list of strings or None"),
    ({"stop": b"ab"}, r"stop must be a string, a list of strings or None"),
    ({"stop": {"a": 1}}, r"stop must be a string, a list of strings or None"),
    ({"stop": ["ok", "\ud800"]}, r"stop string .* is not valid Unicode"),
    ({"stop_token_ids": 5}, r"stop_token_ids must be a list of non-negative integers"),
    ({"ignore_eos": "no"}, r"ignore_eos must be True or False"),
    ({"skip_special_tokens": None}, r"skip_special_tokens must be True or False"),
    ({"include_stop_str_in_output": "false"}, r"include_stop_str_in_output must be True or False"),
    ({"seed": 2**64}, r"seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"),
    ({"seed": -(2**63) - 1}, r"seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"),
])
def test_sampling_params_types(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


# --- chat ----------------------------------------------------------------------------------

@pytest.mark.parametrize("messages,exc,pattern", [
    (None, TypeError, r"messages must be a list of"),
    ({"role": "user", "content": "hi"}, TypeError, r"messages must be a list of"),  # KeyError 0
    ("hi", TypeError, r"messages must be a list of"),
    (["hi"], TypeError, r"each conversation must be a list of"),
    ([{"role": "user", "content": "hi"}, "oops"], TypeError, r"message 1 must be a dict"),
    ([{"content": "hi"}], ValueError, r"message 0 needs a string 'role'"),
    ([{"role": "user"}], ValueError, r"message 0 needs a string 'content'"),
    ([{"role": "user", "content": None}], ValueError, r"message 0 needs a string 'content'"),
    ([{"role": "user", "content": 5}], ValueError, r"message 0 needs a string 'content'"),
    ([{"role": "user", "content": "\ud800"}], ValueError, r"not valid Unicode"),
])
def test_chat_malformed_messages(llm, messages, exc, pattern):
    with pytest.raises(exc, match=pattern):
        llm.chat(messages, greedy())
    assert_clean(llm)


@pytest.mark.parametrize("template", ["{% for %}", "{{ raise_exception('no system role') }}"])
def test_chat_template_errors_are_value_errors(llm, template):
    with pytest.raises(ValueError, match=r"the chat template failed"):
        llm.chat([{"role": "user", "content": "hi"}], greedy(), chat_template=template)
    assert_clean(llm)


# --- engine API ------------------------------------------------------------------------------

def test_request_ids(llm):
    engine = llm.llm_engine
    with pytest.raises(TypeError, match=r"request_id must be a string or None"):
        engine.add_request([5, 6], greedy(), request_id=5)
    # a caller-chosen id that equals the next automatic id: generate must not collide
    nxt = str(next(engine._counter) + 1)
    engine.add_request([5, 6], greedy(max_tokens=2), request_id=nxt)
    outs = llm.generate([[7, 8]], greedy())
    assert len(outs) == 1 and outs[0].request_id != nxt
    # the other request finished during generate: its output is kept for its owner
    assert engine.finished_outputs.pop(nxt).outputs[0].finish_reason == "length"
    assert_clean(llm)


def test_abort_request_list_and_bad_ids(llm):
    engine = llm.llm_engine
    a = engine.add_request([5, 6], greedy())
    b = engine.add_request([7, 8], greedy())
    engine.step()
    engine.abort_request([a, b, "unknown"])  # vLLM accepts an iterable of ids
    assert sorted(engine.finished_outputs) == sorted([a, b])
    engine.finished_outputs.clear()
    for bad in (None, 5, [a, 5]):
        with pytest.raises(TypeError, match=r"request ids are strings"):
            engine.abort_request(bad)
    assert_clean(llm)


# --- CLI ---------------------------------------------------------------------------------------

def test_cli_unreadable_prompt_file(tiny_model_dir, tmp_path, capsys):
    rc = cli_main(["generate", "--model", str(tiny_model_dir), "--prompt-file",
                   str(tmp_path / "missing.txt")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: cannot read --prompt-file") and "\n" not in err


def test_cli_bad_values_one_line(tiny_model_dir, capsys):
    vocab = 10**5
    rc = cli_main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi",
                   "--max-model-len", "64", "--logprobs", str(vocab)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "logprobs=100000 is more than the vocabulary size" in err
    assert "\n" not in err
