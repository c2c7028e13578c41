"""The engine on the TRITON attention backend (minivllm_kernels/, in Triton's interpreter on CPU)
against the TORCH reference backend; backend selection; CUDA-graph helpers; dummy weights
and skip_tokenizer_init.

Tolerances: in float32 the two backends differ only in summation order, so per-token
log-probs agree to 1e-4 (measured ~1e-6) and greedy tokens are identical on these prompts.
"""

from __future__ import annotations

import json

import pytest
import torch

from minivllm import LLM, EngineArgs, SamplingParams
from minivllm.attention.backends import resolve_attention_backend
from minivllm.worker.cuda_graph import CUDAGraphRunner, capture_sizes

LOGPROB_TOL_F32 = 1e-4
# Quantized caches: the backends' tiny float differences upstream can move a K/V value
# across an int8/fp8 rounding boundary, one code step (measured on an H200: 1.4e-4).
LOGPROB_TOL_QUANT = 1e-3


def kernels_interpreted() -> bool:
    from minivllm_kernels._triton import INTERPRET
    return INTERPRET


# On a CUDA machine these tests run the engine there (compiled kernels, CUDA graphs).
DEVICE = "cpu" if kernels_interpreted() else "cuda"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def prompts(tiny_hf_model):
    g = torch.Generator().manual_seed(11)
    vocab = tiny_hf_model.config.vocab_size
    shared = torch.randint(3, vocab, (37,), generator=g).tolist()
    own = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (2, 9, 40, 17, 70)]
    # two prompts share a 37-token prefix (prefix-cache hits), the rest are ragged
    return [shared + own[0], shared + own[1]] + own[2:]


def _run(model_dir, prompts, backend, max_tokens=10, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 16)
    kw.setdefault("device", DEVICE)
    llm = LLM(model=str(model_dir), attention_backend=backend, **kw)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    # again: now the shared prefix (and whole prompts) come from the prefix cache, and
    # the prefill kernel starts after cached blocks
    outs += llm.generate(prompts[:2], sp, use_tqdm=False)
    st = llm.stats
    assert st.num_free_blocks == st.num_total_blocks, "KV blocks leaked"
    return outs, st


def _compare(ref, got, what, tol=LOGPROB_TOL_F32):
    for i, (a, b) in enumerate(zip(ref, got)):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert ta == tb, f"{what}: prompt {i} greedy tokens differ: {ta} vs {tb}"
        lp_a = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs]
        lp_b = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs]
        err = max(abs(x - y) for x, y in zip(lp_a, lp_b))
        assert err <= tol, f"{what}: prompt {i} log-probs differ by {err:.2e} (tol {tol})"


def _assert_same_bits(got, want, what):
    """Two completions with the same tokens and bit-identical top-k log-probs per step."""
    assert got.token_ids == want.token_ids, f"{what}: {got.token_ids} != {want.token_ids}"
    assert len(got.logprobs) == len(want.logprobs), what
    for step, (x, y) in enumerate(zip(got.logprobs, want.logprobs)):
        g = {t: lp.logprob for t, lp in x.items()}
        w = {t: lp.logprob for t, lp in y.items()}
        assert g == w, f"{what}, step {step}: {g} != {w}"


@pytest.mark.parametrize("scenario", ["plain", "chunked", "preempted", "fp8_e4m3",
                                      "int8_dynamic"])
def test_triton_backend_matches_torch(tiny_model_dir, prompts, scenario):
    kw = {
        "plain": dict(enable_chunked_prefill=False),
        # chunks of 16 tokens: later chunks attend to earlier ones through the cache
        "chunked": dict(max_num_batched_tokens=16, max_num_seqs=4),
        # 26 blocks of 4 slots cannot hold the batch as it grows: preemption, recompute
        "preempted": dict(num_gpu_blocks_override=26, block_size=4, max_model_len=104,
                          max_tokens=30),
        "fp8_e4m3": dict(kv_cache_dtype="fp8_e4m3"),
        "int8_dynamic": dict(kv_cache_dtype="int8", kv_scale_type="dynamic"),
    }[scenario]
    ref, st_ref = _run(tiny_model_dir, prompts, "TORCH", **kw)
    got, st = _run(tiny_model_dir, prompts, "TRITON", **kw)
    quantized = "kv_cache_dtype" in kw
    _compare(ref, got, scenario, LOGPROB_TOL_QUANT if quantized else LOGPROB_TOL_F32)
    assert st.num_preemptions == st_ref.num_preemptions
    if scenario == "preempted":
        assert st.num_preemptions > 0, "the scenario did not force a preemption"
    assert st.prefix_cache_hits > 0


def test_backend_selection_and_errors():
    assert resolve_attention_backend(None, "cpu") == "TORCH"
    assert resolve_attention_backend(None, "cuda") == "TRITON"
    assert resolve_attention_backend(None, "cuda:1") == "TRITON"
    assert resolve_attention_backend("triton", "cpu") == "TRITON"
    with pytest.raises(ValueError, match="TORCH, TRITON"):
        EngineArgs(attention_backend="FLASH_ATTN").validate()
    with pytest.raises(ValueError, match="load_format"):
        EngineArgs(load_format="pt").validate()
    with pytest.raises(ValueError, match="dummy"):
        EngineArgs(load_format="dummy", quantization="int8").validate()


@pytest.mark.parametrize("interpret", [True, False], ids=["interpreted", "compiled"])
def test_triton_backend_device_must_match_the_kernel_mode(monkeypatch, interpret):
    """The TRITON backend's kernels run on CPU tensors when interpreted and on CUDA tensors
    when compiled; the other device is refused when the arguments are checked, with the
    way out, not at the first kernel call (which is where a CPU engine on a GPU machine
    used to fail)."""
    from minivllm_kernels import _triton

    monkeypatch.setattr(_triton, "INTERPRET", interpret)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    ok, wrong = ("cpu", "cuda") if interpret else ("cuda", "cpu")
    EngineArgs(attention_backend="TRITON", device=ok).validate()
    EngineArgs(attention_backend="TORCH", device=wrong).validate()
    with pytest.raises(ValueError, match="TRITON_INTERPRET") as e:
        EngineArgs(attention_backend="TRITON", device=wrong).validate()
    assert f"device={wrong!r}" in str(e.value) and "attention_backend='TORCH'" in str(e.value)
    if interpret:  # the default on CUDA is TRITON: refused alike
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1 is set"):
            EngineArgs(device="cuda:1").validate()


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    sizes = capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))


def test_cuda_graph_inputs_and_padding():
    """The graph's static inputs (filled through the host mirrors; buffers only, no
    capture, so this runs on CPU): each row's newest token, its position, its slot
    ``table[pos // block_size] * block_size + pos % block_size``, its length pos + 1 and
    its block table; rows up to the capture size are padding (slot -1, length 0), also
    after a larger step left other values there."""
    from types import SimpleNamespace

    runner = CUDAGraphRunner.__new__(CUDAGraphRunner)
    runner._alloc_buffers(max_batch_size=8, max_model_len=64, block_size=4,
                          device=torch.device("cpu"))

    def req(rid, tokens, computed):
        return SimpleNamespace(request_id=rid, all_token_ids=tokens, num_computed_tokens=computed)

    tables = {"a": [7, 2, 9], "b": [4], "c": [1, 3, 5, 8, 6], "d": [11, 10]}
    reqs = [req("a", list(range(100, 111)), 10), req("b", [5, 6, 7], 2),
            req("c", list(range(200, 218)), 17), req("d", [1] * 8, 7), req("x", [1], 0)]
    tables["x"] = [12]
    assert runner._fill_inputs(reqs, tables) == 8  # 5 rows -> the size-8 graph
    assert runner.input_ids[:5].tolist() == [110, 7, 217, 1, 1]
    assert runner.positions[:5].tolist() == [10, 2, 17, 7, 0]
    # a: pos 10 -> block 2 (id 9), offset 2; b: block 0 (4), 2; c: pos 17 -> block 4 (6), 1
    assert runner.slot_mapping[:8].tolist() == [38, 18, 25, 43, 48, -1, -1, -1]
    assert runner.seq_lens[:8].tolist() == [11, 3, 18, 8, 1, 0, 0, 0]
    for i, r in enumerate(reqs):
        t = tables[r.request_id]
        assert runner.block_tables[i, :len(t)].tolist() == t
    # a smaller step afterwards: rows past its batch become padding again
    assert runner._fill_inputs([req("b", [5, 6, 7, 8], 3)], tables) == 1
    assert runner._fill_inputs([req("b", [5, 6, 7, 8], 3), reqs[0], reqs[2]], tables) == 4
    assert runner.slot_mapping[:4].tolist() == [19, 38, 25, -1]
    assert runner.seq_lens[:4].tolist() == [4, 11, 18, 0]
    assert runner.input_ids[:3].tolist() == [8, 110, 217]


def test_cuda_graphs_step_aside_for_hooks_and_suspension(caplog):
    """A graph replay calls no Python, so a forward hook registered after capture would
    miss every graph step: while any forward or pre hook is on the model (or a global
    module hook), decode steps must run eagerly, with one warning; once the hooks are
    removed, graphs run again. Likewise inside ``suspended()`` (nested too). (Buffers and
    a stand-in model only: runs on CPU.)"""
    from types import SimpleNamespace

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.ReLU()))
    runner = CUDAGraphRunner.__new__(CUDAGraphRunner)
    runner.model = model
    runner._alloc_buffers(max_batch_size=8, max_model_len=64, block_size=4,
                          device=torch.device("cpu"))
    runner._watch_model()
    decode = [(SimpleNamespace(score=None), 1)] * 3
    assert runner.can_run(decode)
    assert not runner.can_run([(SimpleNamespace(score=None), 2)])  # a prefill chunk
    assert not runner.can_run(decode * 3)  # 9 rows > the largest graph (8)

    def hook(*args):
        return None

    registrations = [
        lambda: model[1][0].register_forward_hook(hook),  # a nested module
        lambda: model[0].register_forward_pre_hook(hook),
        lambda: model.register_forward_hook(hook, with_kwargs=True),
        lambda: torch.nn.modules.module.register_module_forward_hook(hook),
        lambda: torch.nn.modules.module.register_module_forward_pre_hook(hook),
    ]
    for i, register in enumerate(registrations):
        handle = register()
        try:
            with caplog.at_level("WARNING", logger="minivllm"):
                caplog.clear()
                assert not runner.can_run(decode), f"registration {i}: graphs still used"
                assert not runner.can_run(decode)
            warnings = [r for r in caplog.records if "hooks" in r.getMessage()]
            assert len(warnings) == 1, f"registration {i}: {len(warnings)} warnings"
        finally:
            handle.remove()
        assert runner.can_run(decode), f"registration {i}: graphs not back after removal"
    with runner.suspended():
        assert not runner.can_run(decode)
        with runner.suspended():
            assert not runner.can_run(decode)
        assert not runner.can_run(decode), "the outer suspension must still hold"
    assert runner.can_run(decode)
    with pytest.raises(RuntimeError), runner.suspended():
        raise RuntimeError("a failed step")
    assert runner.can_run(decode), "an exception must not leave graphs suspended"


@pytest.mark.skipif(DEVICE == "cpu", reason="CUDA graphs need CUDA")
def test_hooks_and_faults_reach_every_step_under_cuda_graphs(tiny_model_dir):
    """On CUDA, with graphs captured: a hook registered afterwards sees the prefill and
    every decode step, and a planted fault changes the decode steps exactly as it does
    in an engine without graphs (bit-identical log-probs: both run those steps eagerly)."""
    from minivllm.precision.faults import fp16_rmsnorm, wrong_rope_theta

    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    prompt = [[5, 9, 13, 21, 34, 55, 89]]
    kw = dict(model=str(tiny_model_dir), dtype="float32", attention_backend="TRITON",
              device=DEVICE)
    graphs, eager = LLM(**kw), LLM(**kw, enforce_eager=True)
    assert graphs.llm_engine.model_runner.cuda_graphs is not None
    assert eager.llm_engine.model_runner.cuda_graphs is None
    calls = []
    handle = graphs.llm_engine.model_runner.model.layers[0].register_forward_hook(
        lambda m, a, out: calls.append(1))
    try:
        graphs.generate(prompt, sp, use_tqdm=False)
    finally:
        handle.remove()
    assert len(calls) == 6, f"the hook ran {len(calls)} times for 1 prefill + 5 decode steps"
    for fault, args in ((fp16_rmsnorm, (0,)), (wrong_rope_theta, (1, 100.0))):
        with fault(graphs, *args), fault(eager, *args):
            a = graphs.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
            b = eager.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
        _assert_same_bits(a, b, fault.__name__)


def test_dummy_weights_and_no_tokenizer(tiny_model_dir, tmp_path):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # config only, no weights
    llm = LLM(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True,
              dtype="float32", max_model_len=64, device=DEVICE)
    params = list(llm.llm_engine.model_runner.model.parameters())
    assert all(float(p.detach().abs().max()) <= 1e-3 for p in params)
    assert len({float(p.detach().flatten()[0]) for p in params}) > 1, "weights are not random"
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(["text needs a tokenizer"], use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings"):
        llm.generate([[1, 2]], SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="chat"):
        llm.chat([{"role": "user", "content": "hi"}])
    assert llm.stats.num_free_blocks == llm.stats.num_total_blocks


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU behaviour")
def test_enforce_eager_is_harmless_on_cpu(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", enforce_eager=False,
              attention_backend="TRITON", max_model_len=64)
    assert llm.llm_engine.model_runner.cuda_graphs is None  # CUDA only


@pytest.mark.embedded
def test_triton_equals_torch_on_embedded_model(embedded_model_dir):
    """Greedy output of the TRITON backend equals the TORCH backend on SmolLM2 (float32),
    prompts of different lengths batched together (prefill and decode kernels both)."""
    msgs = [[{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "Write one sentence about the sea and the wind."}]]
    sp = SamplingParams(temperature=0, max_tokens=12)
    outs = {}
    for backend in ("TORCH", "TRITON"):
        llm = LLM(model=str(embedded_model_dir), attention_backend=backend, dtype="float32",
                  device=DEVICE, max_model_len=256)
        outs[backend] = [o.outputs[0].token_ids for o in llm.chat(msgs, sp, use_tqdm=False)]
        assert llm.stats.num_free_blocks == llm.stats.num_total_blocks
    assert outs["TRITON"] == outs["TORCH"], outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rotary_kernel_matches_reference(dtype):
    """In the interpreter: bit for bit in 16-bit dtypes (each product is rounded as the
    reference rounds it). Compiled for a GPU, within 1 ulp of the dtype: the compiler may
    keep a product in float32 across the rounding and fuse it into an FMA (measured on an
    H200 with Triton 3.6: 1 ulp in float16 and bfloat16). float32: within 2 ulp."""
    from minivllm_kernels.rotary import rotary_embedding, rotary_embedding_ref
    from minivllm.layers.rotary_embedding import RotaryEmbedding

    torch.manual_seed(3)
    rope = RotaryEmbedding(64, 300, 10000.0)
    dev = "cpu" if kernels_interpreted() else "cuda"
    cos, sin = rope.cos_cached.to(dev), rope.sin_cached.to(dev)
    qkv = torch.randn(9, 8 * 64, device=dev).to(dtype)  # q, k as views of a fused tensor
    q, k = qkv[:, :320].view(9, 5, 64), qkv[:, 320:448].view(9, 2, 64)
    pos = torch.randint(0, 300, (9,), device=dev)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(pos, q_ref, k_ref, cos, sin)
    rotary_embedding(pos, q, k, cos, sin)
    if dtype == torch.float32:
        tol = 2 * torch.finfo(dtype).eps
    else:
        tol = 0.0 if kernels_interpreted() else torch.finfo(dtype).eps
    for got, want in ((q, q_ref), (k, k_ref)):
        err = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1)).max()
        assert err <= tol, f"{dtype}: rotary differs from the reference by {err:.3g}"



def test_deferred_residual_adds_keep_the_bits(tiny_model_dir):
    """With the kernels in use, each layer hands its residual to the next fused
    add+RMSNorm instead of adding it itself (one kernel per layer fewer). The log-probs are
    bit for bit those of the plain layer order, which a forward hook on a decoder layer
    brings back, so that the hook sees the residual stream."""
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=5)
    prompt = [[5, 9, 13, 21, 34, 55, 89]]
    llm = LLM(model=str(tiny_model_dir), dtype="float32", attention_backend="TRITON",
              device=DEVICE, enforce_eager=True)  # eager: a hook added later must run
    model = llm.llm_engine.model_runner.model
    model.use_triton_kernels()  # on CUDA the engine already did
    assert model._defer_residual_adds()
    deferred = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    seen = []
    handle = model.layers[1].register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        assert not model._defer_residual_adds()
        plain = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    finally:
        handle.remove()
    assert seen and isinstance(seen[0], torch.Tensor), "the hook must see the stream"
    _assert_same_bits(deferred, plain, "deferred against plain")
    assert model._defer_residual_adds()  # the hook is gone


def test_model_with_triton_kernels_matches_plain_model(tiny_model_dir):
    """use_triton_kernels (fused add+RMSNorm, rotary kernel; what the engine does with
    TRITON on CUDA) gives the same logits; a planted fault still takes effect."""
    from minivllm.precision.faults import fp16_rmsnorm

    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompt = [[5, 9, 13, 21, 34, 55, 89]]
    base = LLM(model=str(tiny_model_dir), dtype="float32", attention_backend="TRITON",
               device=DEVICE)
    ref = base.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    fast = LLM(model=str(tiny_model_dir), dtype="float32", attention_backend="TRITON",
               device=DEVICE)
    model = fast.llm_engine.model_runner.model
    model.use_triton_kernels()  # on CUDA the engine already did
    got = fast.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == ref.token_ids
    assert abs(got.cumulative_logprob - ref.cumulative_logprob) <= LOGPROB_TOL_F32
    norm = model.layers[0].post_attention_layernorm
    with fp16_rmsnorm(fast, 0, "post_attention_layernorm"):
        assert norm.impl is not norm._kernel_impl  # the fused kernel must step aside
        faulty = fast.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert faulty.cumulative_logprob != got.cumulative_logprob
