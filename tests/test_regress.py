"""The precision regression gate (minivllm/precision/regress.py, `minivllm regress`): a
planted regression fails it, a benign change passes it, bad inputs give clear errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from minivllm.precision import regress as R
from minivllm.precision.metrics import bootstrap_ci


# --- the KL rule -------------------------------------------------------------------------

def test_is_regression_needs_the_whole_interval_above_the_threshold_and_the_noise():
    noise = [1e-11, 2e-11, 3e-11, 1.5e-11]
    clear = [5e-3, 6e-3, 7e-3, 8e-3]
    assert R.is_regression(clear, noise, 1e-3)
    assert not R.is_regression(clear, noise, 1e-2)         # tolerated: below max_kl
    # mean 2.5e-3 > max_kl, but one sequence carries it all: the interval reaches down to 0
    one_bad = [0.0] * 7 + [2e-2]
    assert sum(one_bad) / 8 > 1e-3 and bootstrap_ci(one_bad)[0] <= 1e-3
    assert not R.is_regression(one_bad, noise, 1e-3)
    # a noisy floor (bf16) covers a candidate that a float32 floor would not
    bf16_floor = [1e-3, 3e-3, 2e-3, 4e-3]
    mid = [2e-3, 2.2e-3, 2.4e-3, 2.1e-3]
    assert R.is_regression(mid, noise, 1e-3) and not R.is_regression(mid, bf16_floor, 1e-3)
    assert R.is_regression([1e-4, float("nan")], noise, 1.0)  # broken is never tolerated
    assert R.is_regression([1e-4, math.inf], None, 1.0)


@pytest.mark.parametrize("args, match", [
    (([], [0.0], 1e-3), "cand_kl is empty"),
    (([0.1], ["x"], 1e-3), "noise_kl must be a list of numbers"),
    (([0.1], None, -1.0), "max_kl must be a finite number >= 0"),
])
def test_is_regression_refuses_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        R.is_regression(*args)


# --- golden snapshots -------------------------------------------------------------------

def _snapshot(dtype="float32", seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 50, (9,), generator=g).tolist() for _ in range(3)]
    logits = [torch.randn(9, 50, generator=g) * 3 for _ in ids]
    lps = [torch.log_softmax(x.double(), -1) for x in logits]
    gold = [lp[:-1].gather(1, torch.tensor(s[1:])[:, None]).squeeze(1).tolist()
            for lp, s in zip(lps, ids)]
    return {"format": R.GOLDEN_FORMAT, "dtype": dtype, "token_ids": ids, "logprobs": gold}, logits


def test_golden_check_uses_the_snapshot_dtype_tolerance():
    snap, logits = _snapshot("bfloat16")
    tol = {"float32": 1e-3, "bfloat16": 0.5}
    res = R.golden_check(snap, logits, tol)       # logits are normalized by the check
    print(res)
    assert res.passed and res.max_abs_error < 1e-5 and res.tolerance == 0.5
    moved = [x.clone() for x in logits]
    s = snap["token_ids"][1]
    moved[1][4, s[5]] += 0.4                      # token 5's log-prob moves by about 0.4
    res = R.golden_check(snap, moved, tol)
    print(res)
    assert res.passed and 0.2 < res.max_abs_error < 0.5  # within bf16's 0.5
    snap32 = dict(snap, dtype="float32")
    res = R.golden_check(snap32, moved, tol)
    assert not res.passed and res.worst == (1, 4) and res.num_failed >= 1
    moved[2][0] = float("nan")
    res = R.golden_check(snap, moved, tol)
    assert not res.passed and math.isinf(res.max_abs_error) and res.worst == (2, 0)


@pytest.mark.parametrize("change, match", [
    (lambda s, r: (dict(s, dtype="float8"), r), "no tolerance for the snapshot's dtype 'float8'"),
    (lambda s, r: (s, r[:2]), "2 scored sequences for a snapshot of 3"),
    (lambda s, r: (s, [x[:5] for x in r]), r"sequence 0: expected \[9, vocab\] rows"),
    (lambda s, r: ({k: v for k, v in s.items() if k != "logprobs"}, r), "missing"),
    (lambda s, r: (dict(s, logprobs=[x[:3] for x in s["logprobs"]]), r),
     "sequence 0 has 9 tokens, so it needs 8 log-probs, got 3"),
])
def test_golden_check_refuses_bad_input(change, match):
    snap, logits = _snapshot()
    snap, logits = change(snap, logits)
    with pytest.raises(ValueError, match=match):
        R.golden_check(snap, logits, R.DEFAULT_TOLERANCES)


# --- the gate on an engine ------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    from minivllm import LLM

    kw = dict(model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=64,
              max_model_len=128)
    return {"base": LLM(**kw),
            "reorder": LLM(**kw, block_size=32, max_num_seqs=2),  # benign: batch and layout
            "fp8": LLM(**kw, kv_cache_dtype="fp8_e4m3"),
            "penalty": LLM(**kw, override_generation_config={"repetition_penalty": 1.5})}


def test_the_gate_fails_planted_regressions_and_passes_a_batch_reorder(engines):
    tok = engines["base"].get_tokenizer()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, len(tok), (24,), generator=g).tolist() for _ in range(4)]
    rep = R.check(engines["base"], {k: engines[k] for k in ("reorder", "fp8", "penalty")},
                  thresholds=R.Thresholds(max_kl=1e-6), seqs=seqs, num_prompts=4,
                  max_tokens=12)
    print(rep.to_markdown())
    v = {x.label: x for x in rep.verdicts}
    assert v["reorder"].passed and v["reorder"].drift.mean_kl <= rep.noise.kl_ci[1]
    assert not v["fp8"].passed and "mean KL" in v["fp8"].failures[0]
    assert v["fp8"].drift.kl_ci[0] > max(1e-6, rep.noise.kl_ci[1])
    # teacher-forced scoring cannot see a sampling default: the KL is zero ...
    assert v["penalty"].drift.mean_kl == 0.0
    # ... but the default-sampling generation check does, and the report names the field
    assert not v["penalty"].passed and "default-sampling" in v["penalty"].failures[0]
    assert v["penalty"].default_changes == {"repetition_penalty": (1.0, 1.5)}
    assert not rep.passed and json.loads(json.dumps(rep.to_json()))["passed"] is False
    ok = R.check(engines["base"], {"reorder": engines["reorder"]}, seqs=seqs, num_prompts=2,
                 max_tokens=4)
    assert ok.passed and "PASS" in ok.to_markdown()


def test_golden_snapshot_round_trip_catches_fp8_kv_and_refuses_another_dtype(engines, tmp_path,
                                                                            tiny_model_dir):
    from minivllm import LLM

    tok = engines["base"].get_tokenizer()
    seqs = R.eval_sequences(tok, seq_len=32, num_sequences=3)
    path = R.save_golden(R.golden_snapshot(engines["base"], seqs), tmp_path / "g.json")
    snap = R.load_golden(path)
    assert snap["dtype"] == "float32" and len(snap["logprobs"][0]) == 31
    same = R.check_golden(engines["reorder"], snap)
    assert same.passed and same.max_abs_error <= 1e-6, same
    bad = R.check_golden(engines["fp8"], snap)
    print(bad.to_markdown())
    assert not bad.passed and bad.max_abs_error > R.DEFAULT_TOLERANCES["float32"]
    bf16 = LLM(model=str(tiny_model_dir), dtype="bfloat16", num_gpu_blocks_override=16,
               max_model_len=64)
    with pytest.raises(ValueError, match="taken in float32, this engine runs bfloat16"):
        R.check_golden(bf16, snap)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        R.load_golden(tmp_path / "bad.json")


# --- the command line ---------------------------------------------------------------------

def _run(argv, capsys):
    from minivllm.entrypoints.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_exit_status_is_1_on_a_regression_and_0_on_a_benign_change(tiny_model_dir, tmp_path,
                                                                     capsys):
    common = ["--model", str(tiny_model_dir), "--max-model-len", "128",
              "--num-gpu-blocks-override", "64", "--num-sequences", "3", "--seq-len", "24",
              "--num-prompts", "3", "--max-tokens", "8", "--json"]
    rc, out, _ = _run(["regress", "--candidate", "--block-size 32 --max-num-seqs 1",
                       "--out", str(tmp_path / "ok")] + common, capsys)
    rep = json.loads(out.splitlines()[-1])
    assert rc == 0 and rep["passed"], rep
    rc, out, _ = _run(["regress", "--candidate",
                       "--override-generation-config '{\"repetition_penalty\": 1.5}'",
                       "--out", str(tmp_path / "bad")] + common, capsys)
    rep = json.loads(out.splitlines()[-1])
    assert rc == 1 and not rep["passed"]
    assert rep["candidates"][0]["default_changes"] == {"repetition_penalty": [1.0, 1.5]}
    saved = json.loads((tmp_path / "bad" / "report.json").read_text())
    assert saved == rep and "REGRESSION" in (tmp_path / "bad" / "report.md").read_text()
    # golden: write it for one configuration, check the same one, then an fp8 cache
    gold = str(tmp_path / "golden.json")
    rc, out, _ = _run(["regress", "--golden", gold, "--update-golden", "--candidate",
                       "--kv-cache-dtype auto", "--out", str(tmp_path / "g")] + common, capsys)
    assert rc == 0 and "wrote golden snapshot" in out
    rc, out, _ = _run(["regress", "--golden", gold, "--candidate", "--kv-cache-dtype auto",
                       "--out", str(tmp_path / "g")] + common, capsys)
    assert rc == 0 and json.loads(out)["golden"]["passed"]
    rc, out, _ = _run(["regress", "--golden", gold, "--candidate", "--kv-cache-dtype fp8_e4m3",
                       "--out", str(tmp_path / "g")] + common, capsys)
    assert rc == 1 and not json.loads(out)["golden"]["passed"]


@pytest.mark.parametrize("argv, message", [
    (["regress"], "give --candidate FLAGS"),
    (["regress", "--update-golden", "--candidate", "--dtype float32"], "--update-golden needs --golden"),
    (["regress", "--golden", "g.json", "--candidate", "--dtype float32", "--candidate",
      "--dtype float16"], "give exactly one --candidate (got 2)"),
    (["regress", "--golden", "/nonexistent/g.json", "--candidate", "--dtype float32"],
     "cannot read golden snapshot"),
    (["regress", "--candidate", "--kv-cache-dtype fp9"], "invalid choice: 'fp9'"),
    (["regress", "--candidate", "--dtype float32", "--max-kl", "-1"], "max_kl must be"),
    (["regress", "--candidate", "--dtype float32", "--min-top1", "1.5"], "min_top1 must be"),
    (["regress", "--candidate", "--dtype float32", "--tolerance", "bfloat16"],
     "--tolerance takes DTYPE=NATS"),
    (["regress", "--candidate", "hf"], "must be engine flags, not the HF reference"),
])
def test_cli_bad_inputs_exit_2_with_a_clear_message_before_building_engines(argv, message, capsys):
    rc, _, err = _run(argv, capsys)
    print(err)
    assert rc == 2 and message in err
