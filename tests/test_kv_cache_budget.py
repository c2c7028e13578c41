"""vLLM's KV-cache budget (``requested_memory - non_kv_cache_memory``), as chapter 2 and
lab 2 use it."""

import pytest

from minivllm.engine.arg_utils import kv_cache_budget_bytes

GiB = 1 << 30


def test_budget_is_the_rest_of_the_requested_share():
    # 80 GiB x 0.9 = 72 GiB; 16 GiB weights + 2 GiB activations leave 54 GiB
    assert kv_cache_budget_bytes(80 * GiB, 0.9, 18 * GiB) == 54 * GiB
    # lowering the utilization by 5 points takes 4 GiB from the pool, not from the weights
    assert kv_cache_budget_bytes(80 * GiB, 0.85, 18 * GiB) == 50 * GiB
    assert kv_cache_budget_bytes(80 * GiB, 1.0, 0) == 80 * GiB


def test_budget_rounds_the_share_up():
    # vLLM's request_memory takes math.ceil of total x utilization: 10 x 0.55 = 5.5 -> 6
    assert kv_cache_budget_bytes(10, 0.55, 0) == 6
    assert kv_cache_budget_bytes(3, 0.5, 1) == 1
    assert kv_cache_budget_bytes(10, 0.5, 4) == 1  # an exact share stays as it is


@pytest.mark.parametrize("total, util, non_kv", [
    (80 * GiB, 0.85, 68 * GiB),   # exactly nothing left
    (80 * GiB, 0.5, 41 * GiB),    # less than nothing
])
def test_no_room_left_is_an_error(total, util, non_kv):
    with pytest.raises(ValueError, match="No available memory for the cache blocks"):
        kv_cache_budget_bytes(total, util, non_kv)


@pytest.mark.parametrize("total, util, non_kv", [
    (0, 0.9, 0), (-1, 0.9, 0), (1.5, 0.9, 0), (True, 0.9, 0),
    (GiB, 0.0, 0), (GiB, 1.01, 0), (GiB, float("nan"), 0), (GiB, "0.9", 0),
    (GiB, 0.9, -1), (GiB, 0.9, 2.0),
])
def test_bad_arguments_are_refused(total, util, non_kv):
    with pytest.raises(ValueError):
        kv_cache_budget_bytes(total, util, non_kv)
