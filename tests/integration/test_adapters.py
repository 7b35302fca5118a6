"""Named LoRA adapters side by side (`adapters`, `--adapter NAME=PATH`), on the tiny fp32 model.

Two adapters made here as mlx_lm.lora writes them, of different ranks and targets (x: rank 4
on every linear of every layer; y: rank 8 on two projections of the last layer), so that the
stacked layers pad ranks and fill missing targets with zeros. A request naming an adapter
must get `mlx_lm.load(model, adapter_path=...)`'s own greedy tokens; rows of x, y and no
adapter in one batch (entering, decoding and leaving together, prefilled together) each get
what they get alone; the prompt cache never hands one adapter's KV to another's request or
the model's.
"""

from __future__ import annotations

import collections
import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from app_server import serve
from processes import ENV, SERVE

import trio_mlx
from trio_mlx import ModelLoadError
from trio_mlx.actor import ActorConfig, ActorTuning, SamplingParams, Submit
from trio_mlx.actor._actor import Actor

from .test_adapter import _make_adapter
from .test_engine import run
from .test_speculative import _oracles

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def x(tiny_model_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_adapter(tiny_model_fp32, tmp_path_factory.mktemp("lora-x") / "x", rank=4, seed=11)


@pytest.fixture(scope="module")
def y(tiny_model_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_adapter(tiny_model_fp32, tmp_path_factory.mktemp("lora-y") / "y", rank=8, layers=1, seed=12,
                         keys=["self_attn.q_proj", "self_attn.v_proj"])


@pytest.fixture(scope="module")
def greedy(tiny_model_fp32: Path, x: Path, y: Path) -> Any:
    """mlx-lm's own greedy tokens for (adapter name or None, prompt ids, n), each model loaded
    once by mlx-lm's own `load` (with `adapter_path` for an adapter)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    models = {name: load(str(tiny_model_fp32), **({"adapter_path": str(p)} if p else {}))[0]
              for name, p in (("x", x), ("y", y), (None, None))}

    def tokens(name: str | None, prompt: tuple[int, ...], n: int) -> list[int]:
        return [int(t) for t, _ in generate_step(mx.array(prompt), models[name], max_tokens=n)]

    return tokens


class _Link:
    def built(self) -> None:
        pass


def _actor(path: Path, adapters: dict[str, Path], **config: Any) -> Actor:
    tuning = ActorTuning(**{"warmup": False, "admit_window": 0.0, "adapters": {k: str(v) for k, v in adapters.items()},
                            **config})
    actor = Actor(ActorConfig(model_path=path, tuning=tuning), link=_Link())  # type: ignore[arg-type]
    actor._load()
    return actor


def _serve(actor: Actor, script: dict[int, list[Any]], steps: int) -> tuple[dict[int, list[int]], list[int]]:
    """Each rid's tokens over `steps` of the actor's own `_apply` and `_step` (`script[k]` applied
    before step k), and the decoding batch's rows at each step."""
    tokens: dict[int, list[int]] = collections.defaultdict(list)
    rows: list[int] = []
    for k in range(steps):
        failed = actor._apply(script.get(k, []))
        report = actor._step(failed or [])
        assert not report.failed, report.failed
        rows.append(len(actor._bg._generation_batch.uids))  # type: ignore[union-attr]
        for t in report.tokens:
            tokens[t.rid].append(t.token)
    return tokens, rows


def test_rows_of_two_adapters_and_of_none_share_a_batch_and_each_gets_its_own_tokens(tiny_model_fp32, x, y, greedy):
    """Seven rows: a group of four (x, y, none, x) prefilled together, then a group of three (y,
    none, x) entering while they decode; different lengths, so rows leave while others stay
    (the batch's rows filtered and extended under the adapter index). Every row's tokens are
    mlx-lm's own with its adapter loaded alone."""
    actor = _actor(tiny_model_fp32, {"x": x, "y": y}, max_batch=8, prefill_batch=4, retire_steps=2)
    vocab = actor._vocab
    which = ["x", "y", None, "x", "y", None, "x"]
    prompts = {rid: tuple(3 + (rid * 7 + i * 13) % (vocab - 3) for i in range(5 + 3 * rid)) for rid in range(7)}
    lengths = {rid: 6 + 2 * rid for rid in range(7)}
    subs = {rid: Submit(rid, prompts[rid], lengths[rid], SamplingParams(temperature=0.0), frozenset(),
                        adapter=which[rid]) for rid in range(7)}
    tokens, rows = _serve(actor, {0: [subs[r] for r in range(4)], 3: [subs[r] for r in range(4, 7)]}, 40)
    assert max(rows) == 7, rows  # all seven decoded in one batch at some step
    for rid in range(7):
        assert tokens[rid] == greedy(which[rid], prompts[rid], lengths[rid]), (rid, which[rid])
    # and the adapters changed something: no two of the three agree on the first row's prompt
    outs = {name: greedy(name, prompts[0], 8) for name in ("x", "y", None)}
    assert len({tuple(v) for v in outs.values()}) == 3, outs
    assert not actor._adapters.slots  # type: ignore[union-attr]  # every row that left was forgotten


def test_a_lone_row_on_an_adapter_speculates_with_its_adapter(tiny_model_fp32, x, greedy, monkeypatch):
    """Prompt lookup's verify forward runs the row's adapter: the tokens are mlx-lm's own
    greedy ones with the adapter, and drafts were verified. The row drafts its own tokens,
    a third of them spoiled (`_oracles`): this random model's text seldom repeats two
    tokens, so its own lookup might not draft at all."""
    prompt = tuple([5, 6, 7, 8, 9] * 8)
    _oracles(monkeypatch, {prompt: greedy("x", prompt, 24)}, spoil=0.3)
    actor = _actor(tiny_model_fp32, {"x": x}, speculative="ngram")
    drafted = 0
    tokens: list[int] = []
    failed = actor._apply([Submit(1, prompt, 24, SamplingParams(temperature=0.0), frozenset(), adapter="x")])
    for _ in range(40):
        report = actor._step(failed or [])
        tokens += [t.token for t in report.tokens]
        drafted += sum(d for _, d, _ in report.speculated)
        failed = actor._apply([])
    assert tokens == greedy("x", prompt, 24)
    assert drafted > 0


def test_rows_of_a_batch_on_different_adapters_speculate_each_with_its_own(tiny_model_fp32, x, y, greedy,
                                                                             monkeypatch):
    """Prompt lookup in a batch of rows on x, y and no adapter: one verify forward runs each
    row's adapter, every row's tokens are mlx-lm's own greedy ones with its adapter, and drafts
    were verified while the rows shared the batch (each row drafting its own tokens, a third
    spoiled, as above)."""
    prompts = [tuple([5, 6, 7, 8, 9] * 8), tuple([11, 12, 13, 14] * 9), tuple([20, 21, 22] * 12)]
    which = ["x", "y", None]
    _oracles(monkeypatch, {p: greedy(a, p, 24) for p, a in zip(prompts, which, strict=True)}, spoil=0.3)
    actor = _actor(tiny_model_fp32, {"x": x, "y": y}, speculative="ngram")
    subs = [Submit(i, p, 24, SamplingParams(temperature=0.0), frozenset(), adapter=a)
            for i, (p, a) in enumerate(zip(prompts, which, strict=True))]
    drafted = 0
    tokens: dict[int, list[int]] = collections.defaultdict(list)
    failed = actor._apply(subs)
    for _ in range(40):
        report = actor._step(failed or [])
        for t in report.tokens:
            tokens[t.rid].append(t.token)
        if len(actor._bg._generation_batch.uids) == 3:  # type: ignore[union-attr]
            drafted += sum(d for _, d, _ in report.speculated)
        failed = actor._apply([])
    for i in range(3):
        assert tokens[i] == greedy(which[i], prompts[i], 24), which[i]
    assert drafted > 0


@pytest.mark.parametrize("actor", ["thread", "process"])
async def test_a_request_naming_an_adapter_gets_mlx_lm_s_tokens_with_it(tiny_model_fp32, x, y, greedy, actor):
    async with trio_mlx.open_engine(tiny_model_fp32, adapters={"x": str(x), "y": str(y)}, actor=actor) as engine:
        prompt = "The quick brown fox jumps over the lazy dog"
        ids = tuple(engine.encode_prompt("text", prompt))
        got = {name: (await run(engine, prompt, max_tokens=12, adapter=name, **GREEDY))[0]
               for name in ("x", "y", None)}
        with pytest.raises(trio_mlx.InvalidRequestError, match="adapter 'z' is not served"):
            await run(engine, prompt, max_tokens=2, adapter="z")
    for name in ("x", "y", None):
        assert got[name] == greedy(name, ids, 12), name


async def test_the_prompt_cache_never_crosses_adapters(tiny_model_fp32, x, y, greedy):
    """A prompt long enough to be stored (a few 64-token blocks): served by the model, then x,
    then y, each finds nothing the others stored, and gets its own tokens; asked again, each
    finds its own entry."""
    async with trio_mlx.open_engine(tiny_model_fp32, adapters={"x": str(x), "y": str(y)}) as engine:
        prompt = " ".join(f"word{i}" for i in range(150))
        ids = tuple(engine.encode_prompt("text", prompt))
        assert len(ids) > 200
        first: dict[str | None, tuple[list[int], int]] = {}
        for name in (None, "x", "y"):
            got, _, fin = await run(engine, prompt, max_tokens=6, adapter=name, **GREEDY)
            first[name] = (got, fin.usage.cached_tokens)
        again: dict[str | None, tuple[list[int], int]] = {}
        for name in ("y", "x", None):
            got, _, fin = await run(engine, prompt, max_tokens=6, adapter=name, **GREEDY)
            again[name] = (got, fin.usage.cached_tokens)
    for name in (None, "x", "y"):
        want = greedy(name, ids, 6)
        assert first[name] == (want, 0), name
        assert again[name][0] == want and again[name][1] >= 64, (name, again[name])


async def test_adapter_entries_stay_off_the_disk_tier(tiny_model_fp32, x, tmp_path):
    """The disk tier keeps the model's own entries across a restart and none of an adapter's
    (they are in memory only): after the restart the adapter's request finds nothing."""
    prompt = " ".join(f"word{i}" for i in range(150))
    opts = {"adapters": {"x": str(x)}, "prompt_cache_disk_gb": 0.5, "cache_dir": str(tmp_path)}
    async with trio_mlx.open_engine(tiny_model_fp32, **opts) as engine:
        for name in (None, "x"):
            await run(engine, prompt, max_tokens=4, adapter=name, **GREEDY)
    async with trio_mlx.open_engine(tiny_model_fp32, **opts) as engine:
        _, _, on_x = await run(engine, prompt, max_tokens=4, adapter="x", **GREEDY)
        _, _, on_model = await run(engine, prompt, max_tokens=4, **GREEDY)
    assert on_x.usage.cached_tokens == 0
    assert on_model.usage.cached_tokens >= 64


async def test_v1_models_and_the_model_field_over_a_real_model(tiny_model_fp32, x, y, greedy):
    from trio_mlx.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_fp32)
    prompt = "The quick brown fox"
    async with serve(tiny_model_fp32, adapters=(f"x={x}", f"y={y}")) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            data = (await client.get("/v1/models")).json()["data"]
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            answers = {}
            async with trio.open_nursery() as nursery:  # together: rows of two adapters and of none
                async def ask(name: str) -> None:
                    more = {"n": 2} if name == "y" else {}  # choice 2 is the same request again
                    answers[name] = (await client.post("/v1/completions", json={**body, **more, "model": name})).json()
                for name in ("model:x", "y", "model"):
                    nursery.start_soon(ask, name)
    assert [(m["id"], m.get("parent")) for m in data] == [("model", None), ("x", "model"), ("y", "model")]
    assert [answers[n]["model"] for n in ("model:x", "y", "model")] == ["x", "y", "model"]
    ids = tuple(tokenizer.encode(prompt))
    for name, adapter in (("model:x", "x"), ("y", "y"), ("model", None)):
        texts = [c["text"] for c in answers[name]["choices"]]
        assert texts == [tokenizer.decode(greedy(adapter, ids, 8))] * len(texts), name
    assert len(answers["y"]["choices"]) == 2


def test_serve_takes_the_flag_once_per_adapter_and_exits_1_naming_a_bad_one(tiny_model_fp32, x, tmp_path):
    missing = tmp_path / "missing"
    proc = subprocess.run([*SERVE, str(tiny_model_fp32), "--adapter", f"x={x}", "--adapter", f"gone={missing}",
                           "--port", "0", "--no-warmup", "--actor", "thread"], capture_output=True, text=True,
                          timeout=60, env=ENV)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "could not start" in proc.stderr and f"adapter 'gone': adapter {str(missing)!r}: no such directory" \
        in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


async def test_adapters_that_cannot_be_served_side_by_side_fail_startup_naming_them(tiny_model_fp32, x, tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ModelLoadError, match="adapter 'gone'.*no such directory"):
        async with trio_mlx.open_engine(tiny_model_fp32, adapters={"gone": str(missing)}, warmup=False):
            pass
    dora = _make_adapter(tiny_model_fp32, tmp_path / "dora", kind="dora")
    with pytest.raises(ModelLoadError, match="adapter 'd' .* is a 'dora' adapter: only LoRA adapters"):
        async with trio_mlx.open_engine(tiny_model_fp32, adapters={"x": str(x), "d": str(dora)}, warmup=False):
            pass
    other = tmp_path / "other"  # the weights of rank 4, a config that says 8: the shapes do not fit
    other.mkdir()
    (other / "adapters.safetensors").write_bytes((x / "adapters.safetensors").read_bytes())
    config = json.loads((x / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = 8
    (other / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"(?s)could not apply the adapter 'o' at .*other.*does not match"):
        async with trio_mlx.open_engine(tiny_model_fp32, adapters={"o": str(other)}, warmup=False):
            pass


async def test_adapters_with_a_quantized_kv_cache_are_mlx_lm_s_quantized_tokens(tmp_path_factory):
    """`kv_bits` and named adapters combine: a batch of a row on an adapter and a row on none,
    each mlx-lm's own greedy tokens with its `QuantizedKVCache` (and the adapter loaded)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache

    from trio_mlx.models import build_test_model

    model = build_test_model(tmp_path_factory.mktemp("tiny-hd64") / "model", shape="tiny-hd64")
    lora = _make_adapter(model, tmp_path_factory.mktemp("lora-hd64") / "q", seed=13)
    prompts = {None: [5 + (7 * i) % 400 for i in range(90)], "q": [5 + (11 * i) % 400 for i in range(70)]}
    async with trio_mlx.open_engine(model, adapters={"q": str(lora)}, kv_bits=8) as engine:
        got: dict[str | None, list[int]] = {}
        async with trio.open_nursery() as nursery:
            async def one(name: str | None) -> None:
                got[name] = (await run(engine, prompts[name], max_tokens=12, adapter=name, **GREEDY))[0]
            for name in prompts:
                nursery.start_soon(one, name)
    def want(adapter: str | None, prompt: list[int]) -> list[int]:
        m, _ = load(str(model), **({"adapter_path": str(lora)} if adapter else {}))
        cache = [QuantizedKVCache(group_size=64, bits=8) for _ in m.layers]
        return [int(t) for t, _ in generate_step(mx.array(prompt), m, max_tokens=12, prompt_cache=cache)]

    for name, prompt in prompts.items():
        assert got[name] == want(name, prompt), name
    assert got["q"] != want(None, prompts["q"]), "the adapter changed nothing"


@pytest.mark.parametrize("length", [1, 6])
def test_a_bfloat16_mixed_batch_gives_each_row_its_own_adapters_update(length):
    """A mix of adapters in a bfloat16 batch (a decode step, a prefill): each row's output is the
    one it gets with its adapter alone. MLX's CPU `gather_mm` takes float32 only, so a bf16
    model served mixed rows no step on the CPU (`MultiLoRALinear` copies each row's A and B there)."""
    import mlx.core as mx
    import mlx.nn as nn

    from trio_mlx.models._lora import AdapterRows, MultiLoRALinear

    mx.random.seed(3)
    base = nn.Linear(32, 24, bias=False)
    base.set_dtype(mx.bfloat16)
    lora_a = (mx.random.normal((3, 32, 4)) * 0.3).astype(mx.bfloat16) * mx.array([0, 1, 1])[:, None, None]
    lora_b = (mx.random.normal((3, 4, 24)) * 0.3).astype(mx.bfloat16)
    rows = AdapterRows(("p", "q"))
    layer = MultiLoRALinear(base, lora_a, lora_b, [0.0, 2.0, 1.0], rows)
    x = mx.random.normal((3, length, 32)).astype(mx.bfloat16)
    slots = [1, 0, 2]
    rows.set(slots)
    mixed = layer(x)
    rows.clear()
    assert mixed.dtype == mx.bfloat16
    for i, slot in enumerate(slots):
        rows.set([slot])
        alone = layer(x[i:i + 1])
        rows.clear()
        assert mx.allclose(mixed[i:i + 1].astype(mx.float32), alone.astype(mx.float32), atol=3e-2, rtol=3e-2).item(), i
    rows.set([0])
    assert not mx.allclose(layer(x[:1]), mixed[:1]).item(), "the adapter changed nothing"
    rows.clear()
