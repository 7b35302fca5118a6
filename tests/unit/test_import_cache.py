"""The suite's cache of transformers' import table (tests/startup/import_cache.py): read back only
for the same folder, modification time and version; built by transformers' own function otherwise."""

from __future__ import annotations

import os
from pathlib import Path

import import_cache
import pytest


def test_the_table_is_built_once_then_read_back_and_rebuilt_when_its_folder_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(import_cache, "_DIR", tmp_path / "cache")
    scanned = tmp_path / "models"
    scanned.mkdir()
    calls: list[tuple[str, str | None]] = []

    def real(module_path: object, prefix: str | None = None) -> dict:
        calls.append((str(module_path), prefix))
        return {frozenset(): {"llama.configuration_llama": {"LlamaConfig"}, "n": len(calls)}}

    first = import_cache._cached(real, "5.0")(scanned, "models")
    assert calls == [(str(scanned), "models")] and first[frozenset()]["n"] == 1
    # another process (a fresh wrapper, no in-process memo) reads it back without scanning
    assert import_cache._cached(real, "5.0")(scanned, "models") == first and len(calls) == 1
    # another prefix, another version, or a folder whose entries changed: scanned again
    import_cache._cached(real, "5.0")(scanned, None)
    import_cache._cached(real, "5.1")(scanned, "models")
    assert len(calls) == 3
    (scanned / "new_model").mkdir()
    os.utime(scanned, ns=(1, 1))
    again = import_cache._cached(real, "5.0")(scanned, "models")
    assert len(calls) == 4 and again[frozenset()]["n"] == 4


def test_a_table_that_cannot_be_read_back_is_scanned_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(import_cache, "_DIR", tmp_path / "cache")
    calls: list[object] = []

    def real(module_path: object, prefix: str | None = None) -> dict:
        calls.append(module_path)
        return {"n": len(calls)}

    import_cache._cached(real, "5.0")(tmp_path, None)
    for f in (tmp_path / "cache").iterdir():
        f.write_bytes(b"not a pickle")
    assert import_cache._cached(real, "5.0")(tmp_path, None) == {"n": 2}
