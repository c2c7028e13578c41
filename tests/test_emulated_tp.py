"""Tensor parallelism emulated in one process (minivllm/parallel/emulated_tp.py): vLLM's
tp checks, Megatron's shard layouts, the all-reduce's order, and the layout bug of
vllm #3775. Tiny random model: 4 query / 2 KV heads, intermediate 128."""

from __future__ import annotations

import pytest
import torch

from minivllm.parallel.emulated_tp import (EmulatedTensorParallel, all_reduce_rank_order,
                                           check_tensor_parallel_size, emulate_tensor_parallel,
                                           shard_contiguous, shard_merged_column, shard_qkv)

SMOLLM2 = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}


def test_vllm_checks_leave_smollm2_tp_1_or_3():
    for tp in (1, 3):
        check_tensor_parallel_size(SMOLLM2, tp)
    with pytest.raises(ValueError, match=r"heads \(9\) must be divisible.*\(2\); allowed "
                                         r"here: \[1, 3, 9\]"):
        check_tensor_parallel_size(SMOLLM2, 2)
    with pytest.raises(ValueError, match="intermediate_size"):
        check_tensor_parallel_size(SMOLLM2, 9)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="integer >= 1"):
            check_tensor_parallel_size(SMOLLM2, bad)


def test_qkv_shards_hold_each_ranks_heads():
    H, Hkv, D, tp = 8, 4, 3, 2
    w = torch.arange((H + 2 * Hkv) * D * 5, dtype=torch.float32).view(-1, 5)
    q, k, v = w.split([H * D, Hkv * D, Hkv * D])
    for r in range(tp):
        got = shard_qkv(w, r, tp, H, Hkv, D)
        want = torch.cat([q[r * 12:(r + 1) * 12], k[r * 6:(r + 1) * 6], v[r * 6:(r + 1) * 6]])
        assert torch.equal(got, want)
    # fewer KV heads than ranks: each KV head replicated on tp / H_kv ranks
    w2 = torch.randn((4 + 2 * 1) * D, 5)
    q, k, v = w2.split([4 * D, D, D])
    for r in range(4):
        got = shard_qkv(w2, r, 4, 4, 1, D)
        assert torch.equal(got, torch.cat([q[r * D:(r + 1) * D], k, v]))


def test_merged_column_pairs_gate_and_up_and_the_bug_does_not():
    inter, tp = 6, 3
    gate = torch.arange(inter)[:, None].float()
    up = 100 + torch.arange(inter)[:, None].float()
    w = torch.cat([gate, up])
    for r in range(tp):
        assert shard_merged_column(w, [inter, inter], r, tp)[:, 0].tolist() == \
            [2 * r, 2 * r + 1, 100 + 2 * r, 101 + 2 * r]
    assert shard_contiguous(w, [inter, inter], 1, tp)[:, 0].tolist() == [4, 5, 100, 101]


def test_all_reduce_in_rank_order_is_deterministic_and_order_matters_in_bf16():
    g = torch.Generator().manual_seed(0)
    parts = [(torch.randn(4096, generator=g) * 10 ** i).bfloat16() for i in range(3)]
    a = all_reduce_rank_order(parts)
    assert torch.equal(a, all_reduce_rank_order(parts))
    b = all_reduce_rank_order(parts[::-1])
    print("bf16 elements that change with the order:", int((a != b).sum()), "of", a.numel())
    assert (a != b).any()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from minivllm import LLM

    return LLM(model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64,
               max_model_len=128, enable_prefix_caching=False)


def _logits(llm, seqs):
    return torch.cat(llm.score(seqs, output="logits"))


@pytest.mark.parametrize("tp", [2, 4])  # tp=4: each of the 2 KV heads on 2 ranks
def test_emulated_tp_matches_the_unsharded_model_in_float32(tiny, tp):
    seqs = [[5, 9, 17, 3, 8, 12, 40], [7, 7, 2, 90, 33]]
    ref = _logits(tiny, seqs)
    with emulate_tensor_parallel(tiny, tp):
        got = _logits(tiny, seqs)
    err = (got - ref).abs().max().item()
    print(f"tp={tp} float32 max |logit diff| {err:.3g}")
    assert err <= 1e-4  # float32: only the order of the sums over input features changed
    assert torch.equal(_logits(tiny, seqs), ref)  # restored


def test_the_contiguous_shard_bug_garbles_the_mlp(tiny):
    seqs = [[5, 9, 17, 3, 8, 12, 40]]
    ref = torch.log_softmax(_logits(tiny, seqs), -1)
    with emulate_tensor_parallel(tiny, 2, shard_merged_column_fn=shard_contiguous):
        bad = torch.log_softmax(_logits(tiny, seqs), -1)
    with emulate_tensor_parallel(tiny, 2):
        good = torch.log_softmax(_logits(tiny, seqs), -1)
    kl = lambda a, b: float((a.exp() * (a - b)).sum(-1).mean())  # noqa: E731
    print("KL vs unsharded: merged layout", kl(ref, good), "contiguous (vllm #3775)",
          kl(ref, bad))
    assert kl(ref, good) < 1e-6 and kl(ref, bad) > 1e3 * max(kl(ref, good), 1e-12)


def test_refuses_what_it_cannot_shard(tiny):
    with pytest.raises(ValueError, match="must be divisible"):
        EmulatedTensorParallel(tiny.llm_engine.model_runner.model, 3)
