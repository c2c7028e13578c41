"""Config bisection (minivllm.precision.bisect, ``minivllm bisect``) and the mystery
engines of chapter 27 (minivllm.precision.mystery)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from minivllm.entrypoints.cli import main
from minivllm.precision.bisect import bisect_config
from minivllm.precision.mystery import (GOOD_CONFIG, HARMLESS_CHANGES, MYSTERY_FAULTS,
                                        mystery)

# --- bisect_config on synthetic measures (no engine) ---------------------------------------


def _configs(n, seed):
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(n)]
    rng.shuffle(keys)
    return {k: 0 for k in keys}, {k: 1 for k in keys}


def _measure(rule, calls):
    def m(cfg):
        calls.append(dict(cfg))
        return 1.0 if rule(cfg) else 1e-12
    return m


@pytest.mark.parametrize("n", [1, 2, 7, 16])
def test_a_planted_single_culprit_is_found_exactly(n):
    good, bad = _configs(n, n)
    culprit = random.Random(n).choice(sorted(bad))
    calls = []
    res = bisect_config(good, bad, _measure(lambda c: c[culprit] == 1, calls), 1e-6)
    assert res.culprits == [culprit]
    assert res.groups == [[culprit]]
    assert res.good_value == 1e-12 and res.bad_value == 1.0 and res.fixed_value == 1e-12
    # logarithmic: good, bad, the binary search, culprit alone, bad with it reverted
    bound = 4 + math.ceil(math.log2(n)) if n > 1 else 3
    print(f"n={n}: {len(calls)} measurements (bound {bound}, a sweep takes {n + 2})")
    assert len(calls) <= bound
    assert len(calls) == len({tuple(sorted(c.items())) for c in calls})  # memoized


def test_two_keys_that_only_break_together_are_both_found():
    good, bad = _configs(9, 1)
    a, b = "k2", "k7"
    res = bisect_config(good, bad, _measure(lambda c: c[a] == 1 and c[b] == 1, []), 1e-6)
    assert sorted(res.culprits) == [a, b] and len(res.groups) == 1
    assert res.alone(a) is None or res.alone(a) < 1e-6  # neither breaks it alone


def test_two_keys_that_each_break_alone_are_both_found():
    good, bad = _configs(9, 2)
    res = bisect_config(good, bad, _measure(lambda c: c["k1"] == 1 or c["k5"] == 1, []), 1e-6)
    assert sorted(res.culprits) == ["k1", "k5"] and len(res.groups) == 2


def test_nan_is_bad_and_missing_keys_count_as_differences():
    good = {"dtype": "float32", "block_size": 16}
    bad = {"dtype": "float16"}  # block_size: absent, i.e. the default
    seen = []

    def m(cfg):
        seen.append(dict(cfg))
        return math.nan if cfg.get("dtype") == "float16" else 0.0

    res = bisect_config(good, bad, m, 1e-8)
    assert res.culprits == ["dtype"]
    assert {"dtype": "float32"} in seen  # block_size set "bad" = removed


@pytest.mark.parametrize("good,bad,value,msg", [
    ({"a": 1}, {"a": 1}, 0.0, "nothing to bisect"),
    ({"a": 1}, {"a": 2}, 1.0, "good configuration measures bad"),
    ({"a": 1}, {"a": 2}, 0.0, "bad configuration measures good"),
])
def test_bisect_config_refuses_what_it_cannot_bisect(good, bad, value, msg):
    with pytest.raises(ValueError, match=msg):
        bisect_config(good, bad, lambda c: value, 0.5)


@pytest.mark.parametrize("threshold", [0, -1.0, math.inf, math.nan, True, "1e-8"])
def test_bisect_config_refuses_a_bad_threshold(threshold):
    with pytest.raises(ValueError, match="threshold"):
        bisect_config({"a": 1}, {"a": 2}, lambda c: 0.0, threshold)


# --- the CLI: bad input refused before any engine is built ----------------------------------

@pytest.mark.parametrize("argv,msg", [
    (["bisect"], "give the bad configuration"),
    (["bisect", "--bad", "--kv-cache-dtype fp9"], "invalid choice: 'fp9'"),
    (["bisect", "--bad", "--block-size abc"], "invalid int value: 'abc'"),
    (["bisect", "--bad", "--no-such-key 3"], "unknown engine flag"),
    (["bisect", "--bad", "kv_cache_dtype=fp8"], "expected vLLM-style engine flags"),
    (["bisect", "--bad", "--block-size 0"], "--bad: block_size"),
    (["bisect", "--good", "hf", "--bad", "--dtype float16"], "--good must be engine flags"),
    (["bisect", "--bad", "--dtype float16", "--threshold", "0"], "--threshold must be"),
    (["bisect", "--bad", "--dtype float16", "--prompt-len", "1"], "--prompt-len >= 2"),
])
def test_cli_bisect_refuses_bad_input_with_a_message(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    print(err)
    assert msg in err


# --- engines (float32, a small pool) --------------------------------------------------------

def test_each_harmless_change_is_exact_in_float32_and_the_mystery_plants_only_when_triggered():
    """The premise of a mystery: every key it changes is harmless on its own (the same
    logits bit for bit in float32), so the only bad key is the trigger."""
    from minivllm import LLM
    from minivllm.precision import evalsets

    base = {"model": "smollm2-135m-instruct", "max_model_len": 128, "num_gpu_blocks_override": 16}
    ref = LLM(**base, **GOOD_CONFIG)
    seqs = evalsets.corpus_sequences(ref.get_tokenizer(), 24, 2)
    want = ref.score(seqs, output="logits")
    del ref
    bad_all = {**GOOD_CONFIG, **HARMLESS_CHANGES}
    llm = LLM(**base, **bad_all)
    got = llm.score(seqs, output="logits")
    assert all(torch.equal(a, b) for a, b in zip(got, want)), \
        f"harmless changes {HARMLESS_CHANGES} changed float32 logits"
    m = mystery(5)
    bad = m.build(bad_all)  # the trigger is among all changes: planted
    clean = m.build(GOOD_CONFIG)  # not triggered: clean
    assert all(torch.equal(a, b) for a, b in zip(clean.score(seqs, output="logits"), want))
    assert not all(torch.equal(a, b) for a, b in zip(bad.score(seqs, output="logits"), want))


@pytest.fixture(scope="module")
def pair():
    """Two float32 engines of one configuration (one gets the faults), freed after."""
    from minivllm import LLM

    base = {"model": "smollm2-135m-instruct", "dtype": "float32", "max_model_len": 64,
            "num_gpu_blocks_override": 8}
    engines = [LLM(**base), LLM(**base)]
    yield engines
    engines.clear()


@pytest.mark.parametrize("name", sorted(MYSTERY_FAULTS))
def test_layer_diff_names_each_mystery_fault_at_its_layer_and_block(name, pair):
    """Each fault in the first and the last layer and one drawn layer: ``layer_diff``
    against a clean engine of the same configuration names that layer and the fault's
    block (every layer of every fault: ``minivllm.precision.mystery.survey()``)."""
    from minivllm.precision import evalsets
    from minivllm.precision.layer_diff import layer_diff

    plant, block = MYSTERY_FAULTS[name]
    llm, ref = pair
    ids = evalsets.corpus_sequences(llm.get_tokenizer(), 24, 1)[0]
    for layer in (0, random.randrange(1, 29), 29):
        with plant(llm, layer):
            d = layer_diff(llm, ref, ids)
        print(f"{name} at layer {layer}: first jump {d.first_jump_layer} "
              f"{d.first_jump_block}, error there {d.error(f'layers.{layer}'):.2e}")
        assert (d.first_jump_layer, d.first_jump_block) == (layer, block)


def test_cli_bisect_finds_a_mystery_trigger_exactly(capsys):
    seed = random.randrange(10**6)
    m = mystery(seed)
    rc = main(["bisect", "--mystery", str(seed), "--reveal", "--json", "--num-prompts", "2",
               "--prompt-len", "24"])
    out = capsys.readouterr().out.strip().splitlines()[-1]
    res = json.loads(out)
    print(f"mystery {seed}: {m.reveal()}; bisect: culprits {res['culprits']}, "
          f"good {res['good_value']}, bad {res['bad_value']}, fixed {res['fixed_value']}, "
          f"{len(res['steps'])} configurations")
    assert rc == 0
    assert res["culprits"] == [m.reveal()["culprit"]]
    assert res["bad_value"] >= 1e-8 > res["fixed_value"]
    assert res["mystery"] == m.reveal()
