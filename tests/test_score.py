"""``LLM.score``: teacher-forced full-vocabulary rows, prefill and decode paths.

Tolerances (float32 everywhere): against transformers 1e-5 absolute on log-probs; decode
mode against prefill mode 1e-4 (different kernels and reduction order, same math).
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM
from minivllm.precision.reference import ReferenceModel

pytestmark = pytest.mark.usefixtures("one_thread")

TOL_HF = 1e-5
TOL_MODE = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return ReferenceModel(str(tiny_model_dir))


def _ids(n, seed=0, vocab=380):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _free_is_full(llm):
    s = llm.stats
    assert s.num_free_blocks == s.num_total_blocks, s


def test_prefill_scores_equal_transformers(llm, ref):
    ids = _ids(100)
    got = llm.score(ids)
    want = ref.score(ids)
    assert got.shape == (100, llm.llm_engine.model_config.vocab_size)
    assert got.dtype == torch.float32
    err = (got - want).abs().max().item()
    assert err <= TOL_HF, f"max |logprob diff| vs HF = {err:.3e} > {TOL_HF}"
    # rows are normalized distributions
    assert torch.allclose(got.exp().sum(-1), torch.ones(100), atol=1e-5)
    _free_is_full(llm)


def test_decode_mode_equals_prefill_mode(llm):
    ids = _ids(90, seed=1)
    a = llm.score(ids, mode="prefill")
    b = llm.score(ids, mode="decode")
    err = (a - b).abs().max().item()
    assert err <= TOL_MODE, f"decode vs prefill max |diff| = {err:.3e} > {TOL_MODE}"
    _free_is_full(llm)


def test_logits_output_normalizes_to_logprobs(llm):
    ids = _ids(20, seed=2)
    logits = llm.score(ids, output="logits")
    lp = llm.score(ids)
    assert not torch.allclose(logits.exp().sum(-1), torch.ones(20), atol=1e-2)
    assert (torch.log_softmax(logits, -1) - lp).abs().max().item() < 1e-5


def test_batch_of_sequences_in_order_and_equal_to_single(llm):
    seqs = [_ids(n, seed=10 + n) for n in (5, 40, 17)]
    outs = llm.score(seqs, mode="decode")
    assert [o.shape[0] for o in outs] == [5, 40, 17]
    for s, o in zip(seqs, outs):
        single = llm.score(s, mode="decode")
        err = (o - single).abs().max().item()
        assert err <= TOL_MODE, err
    _free_is_full(llm)


def test_single_token_sequence(llm, ref):
    got = llm.score([7], mode="decode")
    assert got.shape[0] == 1
    assert (got - ref.score([7])).abs().max().item() <= TOL_HF


def test_chunked_prefill_and_prefix_cache_do_not_skip_rows(tiny_model_dir, ref):
    ids = _ids(120, seed=3)
    want = ref.score(ids)
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256,
              max_num_batched_tokens=32, enable_chunked_prefill=True, enable_prefix_caching=True)
    llm.generate([ids[:100]])  # fills the prefix cache with the first blocks of ids
    got = llm.score(ids)
    assert got.shape[0] == 120
    err = (got - want).abs().max().item()
    assert err <= TOL_HF, err
    _free_is_full(llm)


def test_preemption_while_scoring_keeps_rows_exact(tiny_model_dir, ref):
    # 8 blocks of 16 tokens = 128 slots for four sequences of 60: decode mode must preempt.
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128,
              num_gpu_blocks_override=8, block_size=16)
    seqs = [_ids(60, seed=20 + i) for i in range(4)]
    outs = llm.score(seqs, mode="decode")
    assert llm.stats.num_preemptions > 0
    for s, o in zip(seqs, outs):
        err = (o - ref.score(s)).abs().max().item()
        assert err <= TOL_MODE, err
    _free_is_full(llm)


def test_kv_cache_dtype_changes_scores(tiny_model_dir):
    ids = _ids(80, seed=4)
    base = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128).score(ids)
    fp8 = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="fp8_e5m2",
              max_model_len=128).score(ids)
    # position 0 attends only to itself (softmax of one key = 1): V rounding still shows,
    # so every row moves; a scorer that ignored the cache would give identical rows.
    assert (base - fp8).abs().max().item() > 1e-3


@pytest.mark.parametrize("bad, match", [
    (dict(token_ids=[]), "empty"),
    (dict(token_ids=[1, 2, 10_000]), "token ids must be integers"),
    (dict(token_ids=[1, -1]), "token ids must be integers"),
    (dict(token_ids=[1, 2], mode="beam"), "mode must be"),
    (dict(token_ids=[1, 2], output="probs"), "output must be"),
])
def test_bad_inputs(llm, bad, match):
    with pytest.raises(ValueError, match=match):
        llm.score(**bad)
    _free_is_full(llm)


@pytest.mark.parametrize("bad", [{5, 3, 100}, {5: "a"}, bytearray(b"abc"), "hello", 7])
def test_non_sequences_are_type_errors(llm, bad):
    with pytest.raises(TypeError):
        llm.score(bad)
    _free_is_full(llm)


def test_tensor_and_array_inputs(llm):
    import numpy as np
    ids = _ids(12, seed=5)
    want = llm.score(ids)
    assert torch.equal(llm.score(torch.tensor(ids)), want)
    assert torch.equal(llm.score(np.array([ids, ids]))[1], want)
    with pytest.raises(ValueError, match="token ids must be integers"):
        llm.score([1.0, 2.0])


def test_too_long_names_both_lengths(llm):
    with pytest.raises(ValueError, match=r"257 tokens.*max_model_len is 256"):
        llm.score(_ids(257))
    assert llm.score(_ids(256)).shape[0] == 256  # exactly max_model_len is fine
    _free_is_full(llm)


def test_a_bad_sequence_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError):
        llm.score([_ids(10), [1, 99_999]])
    assert not llm.llm_engine.has_unfinished_requests()
    _free_is_full(llm)
