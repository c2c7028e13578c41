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
