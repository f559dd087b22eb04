"""The converted-model cache (runtime/model/files.py): built once by whichever process gets there
first while the others wait, and a shared cache that cannot be written falls back to the process's
own. The builds here write a marker file instead of converting a model."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from phasesplit.runtime.model import files


def test_concurrent_builders_build_once(tmp_path: Path):
    target = tmp_path / "models" / "abc"
    builds: list[int] = []
    entered = threading.Event()

    def write(out: Path) -> None:
        entered.set()
        time.sleep(0.3)  # long enough for the second builder to arrive while this one builds
        builds.append(1)
        (out / "model.safetensors").write_text("weights")

    results: list[Path] = []
    first = threading.Thread(target=lambda: results.append(files.build_once(target, write)))
    first.start()
    assert entered.wait(5)
    results.append(files.build_once(target, write))  # waits on the lock, then finds it built
    first.join(5)
    assert builds == [1]
    assert results == [target, target]
    assert (target / "model.safetensors").read_text() == "weights"
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".abc-")]  # no temporary folder left


def test_a_failed_build_leaves_nothing_and_the_next_one_builds(tmp_path: Path):
    target = tmp_path / "models" / "abc"

    def broken(out: Path) -> None:
        (out / "half").write_text("x")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError):
        files.build_once(target, broken)
    assert not target.exists() and not [p for p in target.parent.iterdir() if p.is_dir()]
    files.build_once(target, lambda out: (out / "ok").write_text("y"))
    assert (target / "ok").is_file()


def test_an_unwritable_shared_cache_falls_back_to_the_process_cache(tmp_path: Path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    # Running as root, permissions would not stop us: a path under a regular file cannot be created.
    monkeypatch.setenv("PHASESPLIT_CACHE", str(blocker / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "own"))
    with caplog.at_level(logging.WARNING):
        built = files.cached("models", "abc", lambda out: (out / "m").write_text("z"))
    assert built == tmp_path / "own" / "phasesplit" / "models" / "abc"
    assert (built / "m").is_file()
    assert "cannot be written" in caplog.text and str(blocker / "cache") in caplog.text


def test_the_process_cache_itself_unwritable_is_an_error(tmp_path: Path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.delenv("PHASESPLIT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with pytest.raises(files.CacheNotWritable, match="not-a-directory"):
        files.cached("models", "abc", lambda out: None)
