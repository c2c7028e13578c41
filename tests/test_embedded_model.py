"""minivllm.models.embedded: the first-use conversion is done once when several processes
ask at the same time (pytest -n 2 on a fresh machine): a lock, and a second look after
waiting for it."""

from __future__ import annotations

import pytest

from minivllm.models import embedded


def test_a_caller_that_waited_for_the_lock_uses_the_model_the_other_converted(
        tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    looks = iter([False, True])  # not there before the lock; there once the lock is ours
    monkeypatch.setattr(embedded, "is_converted", lambda: next(looks))

    def convert(target, verbose):
        raise AssertionError("converted although the other process had done it")

    monkeypatch.setattr(embedded, "_convert", convert)
    assert embedded.ensure_embedded_model(verbose=False) == embedded.embedded_model_dir()
    assert (tmp_path / "models" / f".{embedded.ALIAS}.lock").exists()  # the lock file


def test_the_first_caller_converts_under_the_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "is_converted", lambda: False)
    calls = []

    def convert(target, verbose):
        from filelock import FileLock, Timeout

        # the lock is held while converting: another process could not take it now
        with pytest.raises(Timeout):
            FileLock(str(target.parent / f".{embedded.ALIAS}.lock")).acquire(blocking=False)
        calls.append(target)
        return target

    monkeypatch.setattr(embedded, "_convert", convert)
    assert embedded.ensure_embedded_model(verbose=False) == embedded.embedded_model_dir()
    assert calls == [embedded.embedded_model_dir()]


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_the_converted_model_has_the_modes_of_any_file_the_user_creates(
        tmp_path, monkeypatch, mask):
    """The weights file is readable as config.json is (0666 less the umask): safetensors
    writes 0600, which other uids sharing a converted model (a hub's learners, the grader's
    sandboxes) could not read. transformers' loaders are stand-ins: nothing is downloaded."""
    import os
    from types import SimpleNamespace

    import torch
    import transformers
    from safetensors.torch import load_file

    class Tokenizer:
        def save_pretrained(self, out):
            (out / "tokenizer.json").write_text("{}")

    model = SimpleNamespace(
        config=SimpleNamespace(to_dict=lambda: {"bos_token_id": 1, "eos_token_id": 2}),
        state_dict=lambda: {"model.embed_tokens.weight": torch.ones(4, 2, dtype=torch.float16),
                            "lm_head.weight": torch.ones(4, 2)})
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: Tokenizer())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: model)
    out = tmp_path / "hf"
    old = os.umask(mask)
    try:
        embedded._convert_gguf(tmp_path / "model.gguf", out)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o666 & ~mask, modes
    assert list(load_file(str(out / "model.safetensors"))) == ["model.embed_tokens.weight"]


def test_umask_is_read_without_changing_it():
    import os

    from minivllm.utils import umask

    old = os.umask(0o027)
    try:
        assert umask() == 0o027
        assert umask() == 0o027  # unchanged by the first look
    finally:
        os.umask(old)
