"""Layer diff finds planted faults at the right layer; the noise floor is tiny but real."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM
from minivllm.precision import faults
from minivllm.precision.layer_diff import capture_hidden_states, find_first_jump, layer_diff
from minivllm.precision.noise import permuted_mlp_reduction
from minivllm.precision.reference import ReferenceModel
from tests.tiny_model import make_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")
NUM_LAYERS = 6


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny6"), num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def llm(deep_dir):
    return LLM(str(deep_dir), dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def ref(deep_dir):
    return ReferenceModel(str(deep_dir))


IDS = torch.randint(0, 380, (96,), generator=torch.Generator().manual_seed(0)).tolist()


def test_capture_points_and_shapes_match(llm, ref):
    a = capture_hidden_states(llm, IDS)
    b = capture_hidden_states(ref, IDS)
    assert set(a) == set(b)
    assert len(a) == 2 + 3 * NUM_LAYERS
    for k in a:
        assert a[k].shape == b[k].shape == (len(IDS), 64), k


def test_no_fault_no_jump(llm, ref):
    d = layer_diff(llm, ref, IDS)
    assert d.first_jump_layer is None, d.to_markdown()
    assert max(d.errors) < 1e-5, d.to_markdown()


@pytest.mark.parametrize("layer", [0, 3, NUM_LAYERS - 1])
def test_fp16_input_rmsnorm_found_at_its_layer(llm, ref, layer):
    with faults.fp16_rmsnorm(llm, layer):
        d = layer_diff(llm, ref, IDS)
    assert (d.first_jump_layer, d.first_jump_block) == (layer, "self_attn"), d.to_markdown()
    # and the engine is restored afterwards
    assert layer_diff(llm, ref, IDS).first_jump_layer is None


def test_fp16_post_attention_rmsnorm_points_at_the_mlp(llm, ref):
    with faults.fp16_rmsnorm(llm, 2, which="post_attention_layernorm"):
        d = layer_diff(llm, ref, IDS)
    assert (d.first_jump_layer, d.first_jump_block) == (2, "mlp"), d.to_markdown()


def test_wrong_rope_theta_found_in_decode_mode_too(llm, ref):
    with faults.wrong_rope_theta(llm, 4, theta=500.0):
        d = layer_diff(llm, ref, IDS, mode="decode")
    assert (d.first_jump_layer, d.first_jump_block) == (4, "self_attn"), d.to_markdown()
    assert "first jump" in d.to_markdown()


def test_engine_config_against_engine_config(deep_dir, llm):
    fp8 = LLM(str(deep_dir), dtype="float32", kv_cache_dtype="fp8_e4m3", max_model_len=256)
    d = layer_diff(fp8, llm, IDS)
    # the KV cache is quantized in every layer, so the error starts in layer 0's attention
    assert (d.first_jump_layer, d.first_jump_block) == (0, "self_attn"), d.to_markdown()


def test_find_first_jump_rule():
    errs = {"embed_tokens": 0.0}
    for i, e in enumerate([1e-7, 2e-7, 3e-6, 4e-6]):
        errs[f"layers.{i}"] = e
        errs[f"layers.{i}.self_attn"] = e
        errs[f"layers.{i}.mlp"] = e
    assert find_first_jump(errs, 4) == (None, None)  # 3e-6 is under min_error 1e-5
    assert find_first_jump(errs, 4, min_error=1e-6) == (2, "self_attn")
    errs["layers.2.self_attn"] = 1e-7  # only the MLP jumped in layer 2
    assert find_first_jump(errs, 4, min_error=1e-6) == (2, "mlp")
    errs["layers.1.mlp"] = errs["layers.1"] = float("nan")  # NaN is where it broke
    assert find_first_jump(errs, 4) == (1, "mlp")


def test_fault_arguments_are_checked(llm):
    with pytest.raises(ValueError, match="layer must be in"):
        with faults.fp16_rmsnorm(llm, NUM_LAYERS):
            pass
    with pytest.raises(ValueError, match="which must be"):
        with faults.fp16_rmsnorm(llm, 0, which="norm"):
            pass
    with pytest.raises(ValueError, match="theta"):
        with faults.wrong_rope_theta(llm, 0, theta=0.0):
            pass


def test_faults_suspend_cuda_graphs_while_active(llm):
    """A CUDA graph captured before a fault would replay the unpatched layer, so each
    fault makes the engine's decode steps eager while it is active, and only then
    (a graph runner holding no graphs stands in for CUDA's: runs on CPU)."""
    from types import SimpleNamespace

    from minivllm.worker.cuda_graph import CUDAGraphRunner

    mr = llm.llm_engine.model_runner
    assert mr.cuda_graphs is None  # CPU
    runner = CUDAGraphRunner.__new__(CUDAGraphRunner)
    runner.model = mr.model
    runner._alloc_buffers(max_batch_size=4, max_model_len=64, block_size=16,
                          device=torch.device("cpu"))
    runner._watch_model()
    decode = [(SimpleNamespace(score=None), 1)] * 2
    mr.cuda_graphs = runner
    try:
        for fault, args in ((faults.fp16_rmsnorm, (0,)), (faults.wrong_rope_theta, (1, 100.0))):
            assert runner.can_run(decode)
            with fault(llm, *args):
                assert not runner.can_run(decode), f"{fault.__name__}: graphs still on"
            assert runner.can_run(decode), f"{fault.__name__}: graphs not back after"
    finally:
        mr.cuda_graphs = None


def test_noise_floor_is_tiny_nonzero_and_weights_are_restored(llm):
    ids = IDS[:64]
    before = {k: v.clone() for k, v in llm.llm_engine.model_runner.model.state_dict().items()}
    base = llm.score(ids)
    with permuted_mlp_reduction(llm, seed=3):
        permuted = llm.score(ids)
    diff = (base - permuted).abs().max().item()
    # a pure reordering of a float32 sum: rounding-level change, but a change
    assert 0.0 < diff < 1e-4, diff
    after = llm.llm_engine.model_runner.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(llm.score(ids), base)
