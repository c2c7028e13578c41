"""The CPU emulation of CUDA-graph replay (``EngineArgs.emulate_cuda_graphs``, not a vLLM
option; ``minivllm/worker/cuda_graph.py``: ``EmulatedCUDAGraph``,
``EmulatedCUDAGraphRunner``), course chapter 24.

Tolerances: a replay re-runs the ops captured at the padded shape, so its real rows equal
an eager forward at that shape bit for bit (``torch.equal``). Against an ordinary eager
step (no padding rows, keys padded only to the step's longest sequence), float32 greedy
tokens are identical and per-token log-probs agree within 1e-4: float32 SDPA on CPU
depends on the padded key length (a few 1e-8 in the attention output), and a packed
float32 linear may depend on the row count on some CPUs (course chapter 24, section 6).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from minivllm import LLM, EngineArgs, SamplingParams
from minivllm.precision.faults import stale_cuda_graph_capture, wrong_rope_theta
from minivllm.worker.cuda_graph import (EmulatedCUDAGraph, EmulatedCUDAGraphRunner,
                                        capture_sizes, on_default_stream)

LOGPROB_TOL_F32 = 1e-4
PROMPTS = [[5, 9, 13, 21, 34, 55, 89], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2]]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    kw = dict(model=str(tiny_model_dir), dtype="float32", max_num_seqs=8, max_model_len=64,
              num_gpu_blocks_override=32, skip_tokenizer_init=True)
    return LLM(**kw, emulate_cuda_graphs=True), LLM(**kw)


def test_emulated_graph_replays_the_capture_not_the_python():
    """capture/replay: a replay reads the static input's current contents, writes the
    captured output in place, and runs neither a function patched nor a hook registered
    after capture."""
    lin = torch.nn.Linear(6, 5)
    x = torch.randn(4, 6)
    act = {"fn": torch.relu}

    def step():
        return act["fn"](lin(x)).sum(-1), lin(x) * 2

    with torch.inference_mode():
        graph = EmulatedCUDAGraph()
        out, twice = graph.capture(step)
        x.copy_(torch.randn(4, 6))
        want, want2 = step()
        act["fn"] = torch.tanh  # patched after capture
        calls = []
        handle = lin.register_forward_hook(lambda m, a, o: calls.append(1))
        graph.replay()
        handle.remove()
    assert torch.equal(out, want) and torch.equal(twice, want2), \
        f"replay vs eager max |diff| {(out - want).abs().max().item():.3g}"
    assert calls == [], "a replay must not call a hook registered after capture"
    assert not torch.equal(out, torch.tanh(lin(x)).sum(-1).detach())


def test_ops_on_the_default_stream_are_not_replayed():
    """on_default_stream() (vllm #2147): the enclosed ops run during capture but are not
    recorded. A replay after the input changed then reads what they left, both a static
    workspace they wrote in place and a tensor they made, as the capture left them (stale),
    while the recorded ops around them are recomputed; the same step without the block
    (PR #2318's fix: launch on the capturing stream) replays equal to eager. Outside a
    capture the block changes nothing."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 5)
    first, second = torch.randn(4, 6), torch.randn(4, 6)
    x = first.clone()
    workspace = torch.zeros(4, 5)  # allocated before capture, like a kernel's buffer

    def make_step(off: bool):
        def step():
            h = torch.relu(x)  # recorded
            with on_default_stream() if off else contextlib.nullcontext():
                workspace.copy_(lin(h))  # in place into a static tensor
                made = lin(h) + 1  # a tensor made by the uncaptured ops
            return workspace * 2, made * 3, h.sum(-1)
        return step

    with torch.inference_mode():
        with on_default_stream():  # eager: nothing to skip
            assert torch.equal(lin(x), lin(x))
        for off in (True, False):
            x.copy_(first)
            workspace.zero_()
            graph = EmulatedCUDAGraph()
            outs = graph.capture(make_step(off))
            at_capture = [t.clone() for t in outs]
            x.copy_(second)
            graph.replay()
            want = make_step(False)()
            if off:
                assert torch.equal(outs[0], at_capture[0]), "the workspace was recomputed"
                assert torch.equal(outs[1], at_capture[1]), "the made tensor was recomputed"
                assert not torch.equal(outs[0], want[0]) and not torch.equal(outs[1], want[1])
                assert torch.equal(outs[2], want[2]), "a recorded op must be replayed"
            else:
                for got, w in zip(outs, want):
                    assert torch.equal(got, w), f"max |diff| {(got - w).abs().max().item():.3g}"


def test_capture_sizes_and_padding_rows(engines):
    graphs = engines[0].llm_engine.model_runner.cuda_graphs
    assert isinstance(graphs, EmulatedCUDAGraphRunner)
    assert graphs.sizes == capture_sizes(8) == [1, 2, 4, 8]
    assert engines[1].llm_engine.model_runner.cuda_graphs is None
    # the spare slot that padding rows' slot -1 writes; no block covers it
    cache = engines[0].llm_engine.model_runner.kv_caches[0].key
    assert cache.shape[0] == 32 * 16 + 1


def test_real_rows_equal_eager_and_padding_rows_finite(engines):
    """A batch of 3 runs in the size-4 graph: its 3 real rows equal an eager forward at
    the padded shape bit for bit; the padding row (slot -1, length 0) is finite and writes
    only the spare slot."""
    from types import SimpleNamespace

    llm = engines[0]
    runner = llm.llm_engine.model_runner
    graphs = runner.cuda_graphs
    bs_ = runner.block_size
    reqs, tables = [], {}
    for i, p in enumerate(PROMPTS):  # pretend each prompt is cached in blocks 2i, 2i + 1
        tables[f"r{i}"] = [2 * i + 1, 2 * i + 2]
        reqs.append(SimpleNamespace(request_id=f"r{i}", num_computed_tokens=len(p) - 1,
                                    all_token_ids=p))
    caches = [(kv.key.clone(), kv.value.clone()) for kv in runner.kv_caches]
    try:
        with torch.inference_mode():
            logits, finite = graphs.run(reqs, tables)
            logits, finite = logits.clone(), finite.clone()
            full = graphs.graphs[4][1][0].clone()
            assert graphs.slot_mapping[:4].tolist() == [
                tables[f"r{i}"][(len(p) - 1) // bs_] * bs_ + (len(p) - 1) % bs_
                for i, p in enumerate(PROMPTS)] + [-1]
            assert graphs.seq_lens[:4].tolist() == [len(p) for p in PROMPTS] + [0]
            eager_logits, eager_finite = graphs._forward(4)  # the same buffers, eagerly
        assert logits.shape[0] == 3 and bool(finite.all())
        assert torch.isfinite(full).all(), "the padding row holds NaN/inf"
        diff = (logits - eager_logits[:3]).abs().max().item()
        assert torch.equal(logits, eager_logits[:3]), f"max |diff| {diff:.3g}"
        spare = [kv.key[-1].clone() for kv in runner.kv_caches]
        assert any(bool(s.ne(0).any()) for s in spare), "the padding row wrote nothing"
    finally:
        for kv, (k, v) in zip(runner.kv_caches, caches):
            kv.key.copy_(k)
            kv.value.copy_(v)


def _gen(llm, n=6):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
    return [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def _max_logprob_diff(a, b):
    d = 0.0
    for x, y in zip(a, b):
        for s1, s2 in zip(x.logprobs, y.logprobs):
            d = max([d] + [abs(s1[t].logprob - s2[t].logprob) for t in s1 if t in s2])
    return d


class _Steps:
    def __init__(self, logprobs):
        self.logprobs = logprobs


def test_greedy_tokens_and_logprobs_match_eager(engines):
    graph_out, eager_out = _gen(engines[0]), _gen(engines[1])
    assert [o.token_ids for o in graph_out] == [o.token_ids for o in eager_out]
    d = _max_logprob_diff(graph_out, eager_out)
    print(f"float32, graph vs eager, max |d logprob| = {d:.3g}")
    assert d <= LOGPROB_TOL_F32


def test_hooks_and_faults_reach_every_step_and_the_stale_capture_misses_them(engines):
    """The runner steps aside while a forward hook is registered (6 of 6 steps reach it)
    and while a planted fault (wrong_rope_theta) is active (log-probs equal the eager engine's under the
    same fault, bit for bit). The runner before b4220d8 (``stale_cuda_graph_capture``)
    replays anyway: the hook sees only the prefill (1 of 6) and the fault is missed on
    the decode steps."""
    graphs_llm, eager = engines
    layer0 = graphs_llm.llm_engine.model_runner.model.layers[0]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for stale, want in ((False, 6), (True, 1)):
        calls = []
        handle = layer0.register_forward_hook(lambda m, a, o: calls.append(1))
        try:
            if stale:
                with stale_cuda_graph_capture(graphs_llm):
                    graphs_llm.generate(PROMPTS[:1], sp, use_tqdm=False)
            else:
                graphs_llm.generate(PROMPTS[:1], sp, use_tqdm=False)
        finally:
            handle.remove()
        assert len(calls) == want, f"stale={stale}: the hook ran {len(calls)} times"
    with wrong_rope_theta(graphs_llm, 1, 100.0), wrong_rope_theta(eager, 1, 100.0):
        a, b = _gen(graphs_llm), _gen(eager)
        with stale_cuda_graph_capture(graphs_llm):
            c = _gen(graphs_llm)
    assert _max_logprob_diff(a, b) == 0.0, "graph steps must run eagerly under a fault"
    # stale: the prefill (eager) has the fault; the decode steps replay the clean capture
    assert [x.logprobs[0] for x in c] == [y.logprobs[0] for y in b]
    missed = _max_logprob_diff([_Steps(x.logprobs[1:]) for x in c],
                               [_Steps(y.logprobs[1:]) for y in b])
    print(f"stale capture under wrong_rope_theta: decode steps differ by up to {missed:.3g}")
    assert missed > 10 * LOGPROB_TOL_F32, "the stale capture applied the fault"
    with pytest.raises(ValueError, match="needs an LLM with CUDA graphs"):
        with stale_cuda_graph_capture(eager):
            pass


def test_emulate_cuda_graphs_validation():
    with pytest.raises(ValueError, match="device='cpu' and enforce_eager=False"):
        EngineArgs(emulate_cuda_graphs=True, enforce_eager=True).validate()
    with pytest.raises(ValueError, match="device='cpu'"):
        EngineArgs(emulate_cuda_graphs=True, device="cuda").validate()
    with pytest.raises(ValueError, match="True or False"):
        EngineArgs(emulate_cuda_graphs=1).validate()
