"""Quantized checkpoints built once and cached (``checkpoint.cached_quantized``): the cached
folder loads to the same logits as quantizing in place, a second call does not build, a
stale key (source weights or quantizer code changed) rebuilds, and a tampered or broken
cache is refused with a message that names the file and the way out. Tiny random Llama."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from minivllm import LLM
from minivllm.quantization import checkpoint as qc

AWQ = {"group_size": 32, "calibration": "corpus", "calibration_tokens": 256}
IDS = [list(range(3, 50)), list(range(200, 230))]


@pytest.fixture()
def src(tiny_model_dir, tmp_path):
    """A private copy of the tiny model (a test may change its weights)."""
    out = tmp_path / "tiny-src"
    shutil.copytree(tiny_model_dir, out)
    return out


def _cached(src, root, capsys, **kw):
    path = qc.cached_quantized(str(src), "awq", AWQ, cache_root=root, **kw)
    return path, capsys.readouterr().err


def test_cached_checkpoint_loads_to_the_in_place_logits_and_builds_once(src, tmp_path, capsys,
                                                                        one_thread):
    root = tmp_path / "cache"
    path, err = _cached(src, root, capsys)
    assert "building the awq-asym-g32 checkpoint" in err and "not built yet" in err
    manifest = json.loads((path / qc.MANIFEST).read_text())
    assert set(manifest["parts"]) == {"source", "config", "calibration", "code"}
    assert manifest["files"]["model.safetensors"] == qc._sha256_file(path / "model.safetensors")
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    again, err = _cached(src, root, capsys)
    assert again == path and "building" not in err
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    # float32, same tensors, same code path: the logits must be bit-equal (tolerance 0).
    # The build calibrates in windows of min(1024, max_position_embeddings) = 512 tokens
    # here; an in-place engine must use the same max_model_len to see the same windows.
    in_place = LLM(str(src), dtype="float32", max_model_len=512, quantization="awq",
                   quantization_config=AWQ).score(IDS, output="logits")
    loaded = LLM(str(path), dtype="float32", max_model_len=128).score(IDS, output="logits")
    diff = max(float((a - b).abs().max()) for a, b in zip(in_place, loaded))
    print(f"max |logit(in place) - logit(cached)| = {diff} (tolerance 0)")
    assert diff == 0.0
    # another config is another folder, not a rebuild of this one
    other = qc.cached_quantized(str(src), "int4", {"group_size": 32}, cache_root=root,
                                verbose=False)
    assert other != path and path.is_dir()


def test_a_stale_key_rebuilds(src, tmp_path, capsys, one_thread):
    from safetensors.torch import load_file, save_file

    root = tmp_path / "cache"
    path, _ = _cached(src, root, capsys)
    before = load_file(str(path / "model.safetensors"))
    key = json.loads((path / qc.MANIFEST).read_text())["key"]
    # the source weights change: the key's source part changes, the folder is rebuilt
    w = load_file(str(src / "model.safetensors"))
    name = next(k for k in w if k.endswith("layers.0.mlp.down_proj.weight"))
    w[name] = w[name] * 2
    save_file(w, str(src / "model.safetensors"))
    again, err = _cached(src, root, capsys)
    assert again == path and "stale (source changed)" in err
    after = load_file(str(path / "model.safetensors"))
    assert json.loads((path / qc.MANIFEST).read_text())["key"] != key
    assert not torch.equal(before["model.layers.0.mlp.down_proj.scales"],
                           after["model.layers.0.mlp.down_proj.scales"])
    # a manifest written by another version of the quantizer code: rebuilt too
    m = json.loads((path / qc.MANIFEST).read_text())
    m["parts"]["code"], m["key"] = "0" * 64, "1" * 64
    (path / qc.MANIFEST).write_text(json.dumps(m))
    _, err = _cached(src, root, capsys)
    assert "stale (code changed)" in err
    _, err = _cached(src, root, capsys)
    assert "building" not in err


def test_calibration_data_is_part_of_the_key(src, tmp_path):
    a = qc.cache_key(str(src), "awq", AWQ, tmp_path)
    b = qc.cache_key(str(src), "awq", {**AWQ, "calibration": "conversations"}, tmp_path)
    c = qc.cache_key(str(src), "int4", {"group_size": 32}, tmp_path)
    assert a["parts"]["calibration"] != b["parts"]["calibration"]
    assert a["parts"]["source"] == b["parts"]["source"] == c["parts"]["source"]
    assert c["parts"]["calibration"] == qc._sha256_json([])  # RTN calibrates on nothing


@pytest.mark.parametrize("damage,pattern", [
    ("flip", r"corrupt: model.safetensors has sha256 .* manifest says"),
    ("truncate", r"corrupt: model.safetensors has sha256"),
    ("config", r"corrupt: config.json has sha256"),
    ("delete", r"corrupt: model.safetensors is missing"),
    ("manifest", r"corrupt: its manifest minivllm-cache.json cannot be read"),
])
def test_a_tampered_cache_is_refused_until_rebuilt(src, tmp_path, capsys, one_thread, damage,
                                                   pattern):
    root = tmp_path / "cache"
    path, _ = _cached(src, root, capsys)
    f = path / "model.safetensors"
    if damage == "flip":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:-100])
    elif damage == "config":
        cfg = json.loads((path / "config.json").read_text())
        cfg["rms_norm_eps"] = 0.1
        (path / "config.json").write_text(json.dumps(cfg))
    elif damage == "delete":
        f.unlink()
    else:
        (path / qc.MANIFEST).write_text("{not json")
    with pytest.raises(qc.QuantizedCacheError, match=pattern) as e:
        qc.cached_quantized(str(src), "awq", AWQ, cache_root=root)
    print(e.value)
    assert "rebuild=True" in str(e.value)
    fixed, err = _cached(src, root, capsys, rebuild=True)
    assert "rebuild=True" in err and fixed == path
    assert qc.cached_quantized(str(src), "awq", AWQ, cache_root=root) == path


def test_bad_arguments(src, tmp_path, capsys, one_thread):
    with pytest.raises(ValueError, match="Unknown quantization 'awq4'"):
        qc.cached_quantized(str(src), "awq4", cache_root=tmp_path)
    with pytest.raises(ValueError, match="needs a quantization method"):
        qc.cached_quantized(str(src), None, cache_root=tmp_path)
    path, _ = _cached(src, tmp_path, capsys)
    with pytest.raises(ValueError, match="already a quantized checkpoint"):
        qc.cached_quantized(str(path), "awq", AWQ, cache_root=tmp_path)
