"""``compare``, its figures and the ``minivllm compare`` CLI, on the tiny random model
(the eval sets are plain text, so any tokenizer can score them)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minivllm.entrypoints.cli import main as cli_main
from minivllm.entrypoints.cli import parse_config
from minivllm.precision import evalsets as E
from minivllm.precision.report import compare

pytestmark = pytest.mark.usefixtures("one_thread")


def _png_ok(path):
    """Decodes as an image, and is not one flat colour."""
    import matplotlib.image as mpimg

    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, img.shape
    flat = img.reshape(-1, img.shape[-1])
    assert len(np.unique(flat, axis=0)) > 10, "blank image"
    assert flat.std() > 0.01


@pytest.fixture(scope="module")
def report(tiny_model_dir):
    return compare({"dtype": "float32"},
                   [{"kv_cache_dtype": "float16"}, {"kv_cache_dtype": "fp8_e4m3"}],
                   eval_sets=("corpus", "qa"), model=str(tiny_model_dir), seq_len=64,
                   max_sequences=6, max_qa=4, layer_diff_tokens=48, progress=False)


def test_compare_measures_and_orders_candidates(report):
    noise, fp16, fp8 = report.noise_floor, report.results[0], report.results[1]
    assert fp16.drift.num_sequences == 6 and fp16.drift.num_positions == 6 * 64
    # fp8 KV rounds far more coarsely than fp16: more KL and less agreement
    assert fp8.drift.mean_kl > fp16.drift.mean_kl > noise.drift.mean_kl >= 0
    assert fp8.drift.kl_ci[0] <= fp8.drift.mean_kl <= fp8.drift.kl_ci[1]
    assert fp8.exceeds_noise_floor is True
    assert fp8.drift.top1_agreement <= fp16.drift.top1_agreement
    assert fp8.layer_diff.first_jump_layer == 0
    assert report.baseline.qa_accuracy is not None and fp8.qa_agreement is not None


def test_report_json_schema(report):
    j = report.to_json()
    assert set(j) >= {"baseline", "results", "noise_floor"}
    assert len(j["results"]) == 2
    for r in j["results"]:
        for key in ("config", "mean_kl", "kl_ci", "top1_agreement", "ppl_ratio",
                    "passkey_accuracy", "exceeds_noise_floor"):
            assert key in r, key
        assert r["kl_ci"][0] <= r["mean_kl"] <= r["kl_ci"][1]
    json.dumps(j)  # serializable


def test_report_markdown_and_pngs(report, tmp_path):
    md = report.to_markdown()
    assert "noise floor" in md and "kv_cache_dtype=fp8_e4m3" in md
    paths = report.save(tmp_path)
    assert {"kl_by_position", "agreement_by_position", "layer_error"} <= set(paths)
    for name in ("kl_by_position", "agreement_by_position", "layer_error"):
        _png_ok(paths[name])
    assert "![kl_by_position](kl_by_position.png)" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["results"]


def test_compare_rejects_bad_arguments(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown eval set"):
        compare(None, [{}], eval_sets=("wikitext",), model=str(tiny_model_dir))
    with pytest.raises(ValueError, match="at least one candidate"):
        compare(None, [], model=str(tiny_model_dir))
    with pytest.raises(ValueError, match="mode"):
        compare(None, [{}], mode="greedy", model=str(tiny_model_dir))


@pytest.mark.parametrize("kw, match", [
    (dict(max_sequences=0), "max_sequences"), (dict(max_sequences=-1), "max_sequences"),
    (dict(max_qa=0), "max_qa"), (dict(seq_len=1), "seq_len"), (dict(batch_size=0), "batch_size"),
    (dict(layer_diff_tokens=-1), "layer_diff_tokens"), (dict(max_passkey_items=0), "max_passkey"),
    (dict(passkey_lengths=[300]), "allowed lengths"), (dict(passkey_lengths=256), "list"),
])
def test_compare_limits_are_checked(tiny_model_dir, kw, match):
    with pytest.raises(ValueError, match=match):
        compare(None, [{"kv_cache_dtype": "float16"}], model=str(tiny_model_dir), **kw)


def test_compare_rejects_duplicates_and_ignored_reference_keys(tiny_model_dir):
    with pytest.raises(ValueError, match="more than once"):
        compare(None, [{"kv_cache_dtype": "float16"}, {"kv_cache_dtype": "float16"}],
                model=str(tiny_model_dir))
    with pytest.raises(ValueError, match="ignored"):
        compare(None, [{"reference": "float32", "kv_cache_dtype": "float16"}],
                eval_sets="corpus", model=str(tiny_model_dir))


def test_parse_config():
    assert parse_config("--kv-cache-dtype fp8_e4m3 --block-size 32") == {
        "kv_cache_dtype": "fp8_e4m3", "block_size": 32}
    assert parse_config("--no-enable-prefix-caching") == {"enable_prefix_caching": False}
    assert parse_config("hf-float64") == {"reference": "float64"}
    assert parse_config("") == {}
    with pytest.raises(ValueError, match="unknown engine flag"):
        parse_config("--kv-cache-dtyp float16")
    with pytest.raises(ValueError, match="bad engine flags"):
        parse_config("--block-size sixteen")


def test_cli_json_last_line(tiny_model_dir, tmp_path, capsys):
    rc = cli_main(["compare", "--model", str(tiny_model_dir), "--dtype", "float32",
                   "--candidate", "--kv-cache-dtype bfloat16", "--eval-set", "corpus",
                   "--seq-len", "48", "--max-sequences", "3", "--layer-diff-tokens", "0",
                   "--out", str(tmp_path), "--json"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    j = json.loads(out[-1])
    assert j["baseline"]["config"] == {"dtype": "float32", "kv_cache_dtype": "float32"}
    (res,) = j["results"]
    assert res["config"] == {"dtype": "float32", "kv_cache_dtype": "bfloat16"}
    assert res["mean_kl"] > 0 and 0 <= res["top1_agreement"] <= 1
    _png_ok(tmp_path / "kl_by_position.png")


def test_cli_single_flag_candidate_and_bad_out(tiny_model_dir, tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    rc = cli_main(["compare", "--model", str(tiny_model_dir), "--candidate",
                   "--no-enable-prefix-caching", "--out", str(f)])
    assert rc == 2
    assert "is not a folder" in capsys.readouterr().err


def test_cli_bad_candidate_is_a_clear_error(tiny_model_dir, tmp_path, capsys):
    rc = cli_main(["compare", "--model", str(tiny_model_dir), "--candidate",
                   "--kv-cache-dtype float8", "--out", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "float8" in err and "fp8_e4m3" in err, err


def test_eval_sets_are_as_documented():
    qa = E.load_qa()
    assert len(qa) >= 100
    assert len({q.question for q in qa}) == len(qa)
    assert all(E.answer_matches(q.reference_output, q.answers) for q in qa)
    pk = E.load_passkey()
    lengths = sorted({p.target_tokens for p in pk})
    assert lengths[0] == 256 and lengths[-1] == 4096
    assert all(p.num_tokens <= p.target_tokens for p in pk)
    assert all(p.passkey in p.prompt for p in pk)
    convs = E.load_conversations()
    assert len(convs) >= 10
    for c in convs:
        assert sum(m["role"] == "user" for m in c) >= 10
        assert [m["role"] for m in c[:2]] == ["user", "assistant"]
    assert len(E.load_corpus().split()) >= 2000


@pytest.mark.parametrize("out, answers, ok", [
    ("The capital of France is Paris.", ["Paris"], True),
    ("paris", ["Paris"], True),
    ("Parisian food is good.", ["Paris"], False),       # whole words only
    ("It is twenty-four hours.", ["twenty-four"], True),
    ("About 300,000 km/s.", ["300,000"], True),
    ("The answer is 12.", ["2"], False),
])
def test_answer_matching(out, answers, ok):
    assert E.answer_matches(out, answers) is ok


def test_passkey_check():
    assert E.passkey_correct("The pass key is 12345.", "12345")
    assert not E.passkey_correct("The pass key is 123456.", "12345")
    assert not E.passkey_correct("I do not know.", "12345")
