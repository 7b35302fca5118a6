"""Sampling defaults: a request that leaves temperature, top_p, top_k, min_p or
repetition_penalty out samples with the model's generation_config.json (as vLLM does);
its own values always win. The embedded default ships greedy decoding, so the README's
first request answers "Paris" without a temperature.

Here the generation_config reading and what the engine submits (over the fake actor); /v1/models
and the embedded default: tests/integration/test_sampling_defaults.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import trio_mlx
from trio_mlx.actor import FakeActor, Submit
from trio_mlx.models import _models

MODEL_DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1}


@pytest.fixture
def tuned_model(tiny_model_fp32: Path, tmp_path: Path) -> Path:
    path = Path(shutil.copytree(tiny_model_fp32, tmp_path / "tuned"))
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, **MODEL_DEFAULTS}))
    return path


class _Spy:
    """The actor's link, recording every command the engine sends."""

    def __init__(self, link: Any, seen: list[Any]):
        self._link, self._seen = link, seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._link, name)

    def exchange(self, report: Any) -> list[Any]:
        commands = self._link.exchange(report)
        self._seen.extend(commands)
        return commands

    def wait_commands(self) -> list[Any]:
        commands = self._link.wait_commands()
        self._seen.extend(commands)
        return commands


async def _sampling_of(model: Path, options: dict[str, Any], **engine_options: Any) -> tuple[Any, dict[str, Any]]:
    seen: list[Any] = []
    factory = lambda config, link: FakeActor(config, _Spy(link, seen))  # noqa: E731
    async with trio_mlx.open_engine(model, actor=factory, **engine_options) as engine:
        async with engine.generate("hello", max_tokens=2, **options) as stream:
            async for _ in stream:
                pass
        defaults = dict(engine.sampling_defaults)
    [submit] = [c for c in seen if isinstance(c, Submit)]
    return submit.sampling, defaults


def test_sampling_defaults_read_the_generation_config(tuned_model: Path, tmp_path: Path) -> None:
    assert _models.sampling_defaults(tuned_model) == MODEL_DEFAULTS
    assert _models.sampling_defaults(tmp_path) == {}  # no file: no defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": "hot", "top_p": 0, "top_k": 2.5, "min_p": True, "repetition_penalty": 1.3}))
    # the wrong types dropped; the range (top_p 0) is the engine's to check
    assert _models.sampling_defaults(tmp_path) == {"top_p": 0.0, "repetition_penalty": 1.3}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert _models.sampling_defaults(tmp_path) == {}


async def test_defaults_the_engine_would_refuse_are_left_out(tuned_model: Path, caplog) -> None:
    """A broken generation_config.json cannot make every request fail: the engine keeps the
    values its one check accepts, and says which it left out."""
    (tuned_model / "generation_config.json").write_text(json.dumps(
        {"temperature": 300, "top_p": 0, "top_k": 7, "repetition_penalty": 1.3}))
    sampling, defaults = await _sampling_of(tuned_model, {})
    assert defaults == {"top_k": 7, "repetition_penalty": 1.3}
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 1.0, 7)
    assert "left out of the sampling defaults" in caplog.text and "top_p" in caplog.text


async def test_a_request_without_sampling_options_gets_the_models(tuned_model: Path) -> None:
    sampling, defaults = await _sampling_of(tuned_model, {})
    assert defaults == MODEL_DEFAULTS
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p,
            sampling.repetition_penalty) == (0.2, 0.9, 7, 0.05, 1.1)


async def test_a_requests_own_values_win(tuned_model: Path) -> None:
    sampling, _ = await _sampling_of(tuned_model, {"temperature": 0.0, "top_k": 0, "top_p": None})
    assert (sampling.temperature, sampling.top_k) == (0.0, 0)  # given: kept, 0 included
    assert (sampling.top_p, sampling.min_p, sampling.repetition_penalty) == (0.9, 0.05, 1.1)  # left out


async def test_the_engine_option_replaces_the_models_defaults(tuned_model: Path) -> None:
    sampling, defaults = await _sampling_of(tuned_model, {}, sampling_defaults={})
    assert defaults == {}
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 1.0, 0)
    sampling, _ = await _sampling_of(tuned_model, {}, sampling_defaults={"temperature": 0.5})
    assert (sampling.temperature, sampling.top_p) == (0.5, 1.0)
    with pytest.raises(ValueError, match="top_p"):
        trio_mlx.Engine(tuned_model, sampling_defaults={"top_p": 2.0})
    with pytest.raises(ValueError, match="stop"):
        trio_mlx.Engine(tuned_model, sampling_defaults={"stop": ["x"]})
