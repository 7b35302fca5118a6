"""Pin the public surface: what `import trio_mlx` offers is a deliberate choice."""

import types

import trio_mlx

EXPECTED = {
    "ActorTuning",
    "ContextLengthExceededError",
    "Engine",
    "EngineBrokenError",
    "EngineClosedError",
    "EngineRestartingError",
    "EngineStatistics",
    "Finished",
    "GenerationOptions",
    "InvalidRequestError",
    "ModelLoadError",
    "QueueFullError",
    "RequestStream",
    "SamplingParams",
    "TextDelta",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "ToolCalls",
    "TrioMLXError",
    "Usage",
    "open_engine",
}


def test_public_names():
    public = {
        n for n in dir(trio_mlx) if not n.startswith("_") and not isinstance(getattr(trio_mlx, n), types.ModuleType)
    }
    assert public == EXPECTED


def test_tool_call_delta_is_the_shape_openai_streams():
    """The streamed-call event: OpenAI's `delta.tool_calls` entry (index, id, name, an
    arguments fragment), frozen like every event, and one of `Event`'s members."""
    import dataclasses
    import typing

    fields = [f.name for f in dataclasses.fields(trio_mlx.ToolCallDelta)]
    assert fields == ["index", "id", "name", "arguments"]
    delta = trio_mlx.ToolCallDelta(0, "call_1", "f", "")
    assert dataclasses.is_dataclass(delta) and delta.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert trio_mlx.ToolCallDelta in typing.get_args(trio_mlx.engine.Event)
    assert trio_mlx.ToolCalls in typing.get_args(trio_mlx.engine.Event)  # whole calls stay


def test_the_event_records_fields():
    """The fields of the public records are API too: a change here is a deliberate one."""
    import dataclasses

    def names(cls: type) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    assert names(trio_mlx.Usage) == ["prompt_tokens", "completion_tokens", "cached_tokens", "draft_tokens",
                                     "accepted_draft_tokens"]
    assert trio_mlx.Usage(3, 2).cached_tokens == 0 and trio_mlx.Usage(3, 2).total_tokens == 5
    assert names(trio_mlx.Finished) == ["finish_reason", "usage", "error", "stop"]
    assert names(trio_mlx.EngineStatistics)[-12:] == [
        "prompt_cache_lookups", "prompt_cache_hits", "prompt_cache_hit_tokens",
        "prompt_cache_evictions", "prompt_cache_bytes", "prompt_cache_entries", "actor_restarts",
        "tokenizer_prefix_hits", "tokenizer_prefix_tokens", "draft_tokens", "accepted_draft_tokens",
        "prompt_tokens_in_flight"]
    # One request's options: what every API builds and the engine checks (docs/design.md,
    # "Adding a sampling parameter").
    assert names(trio_mlx.GenerationOptions) == [
        "max_tokens", "fit_max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop", "stop_token_ids", "ignore_eos",
        "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls",
        "continue_final_message", "chat_template_kwargs", "cache_salt", "adapter"]
    assert trio_mlx.GenerationOptions.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_errors_share_one_base():
    for name in EXPECTED:
        obj = getattr(trio_mlx, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, trio_mlx.TrioMLXError), name


def test_runtime_errors_are_in_the_one_tree():
    """Every public exception class the runtime's layers define (the HTTP layer's too) derives
    from TrioMLXError, so one `except` catches whatever trio_mlx raises."""
    import importlib
    import pkgutil

    import trio_mlx.engine
    import trio_mlx.server

    found = []
    for pkg in (trio_mlx.engine, trio_mlx.server):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                if (isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == info.name
                        and not obj.__name__.startswith("_")):  # a private one never leaves its module
                    found.append(obj)
                    assert issubclass(obj, trio_mlx.TrioMLXError), f"{info.name}.{obj.__name__}"
    assert any(e.__name__ == "HTTPError" for e in found)


def test_importing_the_package_does_not_import_mlx():
    import subprocess
    import sys

    code = "import sys, trio_mlx; sys.exit(1 if any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules) else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- the layout: which package may import which ---------------------------------------------

import ast  # noqa: E402
from pathlib import Path  # noqa: E402

PACKAGE = Path(trio_mlx.__file__).parent
# Each layer may import the ones listed (and itself); `_errors`, `_fields` (settings as text),
# `_heap` (imports only `gc`) and `_cpus` (the CPUs the process may use: `os` alone) are the
# leaves the layers share. The top-level modules (`__init__`, `app`, `cli`) are the
# public face over all of them. `bench` is a client beside the runtime, through public names only
# (`test_bench_imports_only_public_names`); no layer imports it.
ALLOWED = {
    "server": {"engine", "_errors", "_fields"},
    "engine": {"actor", "models", "_errors", "_fields", "_heap", "_cpus"},
    "actor": {"models", "_errors", "_fields", "_heap", "_cpus"},
    "models": {"_errors"},
    "bench": {"engine", "actor", "models"},
}
MLX_USERS = {"actor", "models"}


def _imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in a file: top level, in functions, and
    under TYPE_CHECKING alike (a circle through a type hint is still a circle to a reader)."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    pkg = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [f"{mod}.{a.name}" for a in node.names] if not node.module else [mod]
                out += [(n, node.lineno) for n in names]
            else:
                out.append((node.module or "", node.lineno))
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "trio_mlx" else None


def test_imports_point_one_way_and_only_the_actor_and_models_import_mlx():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        here = rel.parts[0] if len(rel.parts) > 1 else None  # None: the public face
        for module, line in _imports(path):
            where = f"{rel}:{line} imports {module}"
            if module.split(".")[0] in ("mlx", "mlx_lm") and here not in MLX_USERS:
                bad.append(where)
            target = _layer(module)
            if here in ALLOWED and target not in (None, here) and target not in ALLOWED[here]:
                bad.append(where)
    assert bad == []


def test_no_module_imports_itself_back_through_a_circle():
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = {m for m, _ in _imports(path) if m.startswith("trio_mlx")}

    def resolve(m: str) -> str:  # `from .x import Name` names a module or an attribute of one
        while m not in graph:
            m = m.rpartition(".")[0]
        return m

    edges = {a: {resolve(m) for m in bs} - {a} for a, bs in graph.items()}
    circles, done = [], set()

    def visit(node: str, trail: list[str]) -> None:
        for nxt in sorted(edges[node]):
            if nxt in trail:
                circles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, trail + [nxt])
        done.add(node)

    for start in sorted(edges):
        if start not in done:
            visit(start, [start])
    assert circles == []


def test_bench_imports_only_public_names():
    """`trio-mlx bench` uses the runtime as a client would (docs/design.md, "Where things
    live"): every module it imports from the runtime and every name it imports from one are
    public, whatever its own private modules are; an attribute it reads off a module it imports
    is public too (`actor.ceiling`, the one it reads that way)."""
    bad = []
    for path in sorted((PACKAGE / "bench").rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(path, node)
                names = [f"{module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                names = [f"{node.value.id}.{node.attr}"] if node.value.id in ("trio_mlx", "actor", "models") else []
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] in ("trio_mlx", "actor", "models") and parts[:2] != ["trio_mlx", "bench"]:
                    if any(p.startswith("_") and not p.startswith("__") for p in parts):
                        bad.append(f"{rel}:{node.lineno} uses {name}")
    assert bad == []


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module of a `from ... import` in `path`."""
    if not node.level:
        return node.module or ""
    pkg = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    return ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))


def test_the_quantized_kv_knobs_are_tuning_fields():
    """`kv_bits`, `kv_group_size`, `quantized_kv_start`: fields of the one settings record, so
    `open_engine(..., kv_bits=8)`, `--kv-bits` and TRIO_MLX_KV_BITS all reach them."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(trio_mlx.ActorTuning)}
    assert {k: defaults[k] for k in ("kv_bits", "kv_group_size", "quantized_kv_start")} == {
        "kv_bits": None, "kv_group_size": 64, "quantized_kv_start": 0}
    assert dataclasses.replace(trio_mlx.ActorTuning(), kv_bits=4).kv_bits == 4


def test_a_distributed_rank_is_an_object_the_actor_holds_not_a_subclass_of_it():
    """What an actor's place in a distributed group changes is its `Rank` (`actor/_rank.py`),
    which it holds: no class subclasses `Actor` to override its private hooks."""
    import ast

    subclasses = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases}
                if "Actor" in bases:
                    subclasses.append(f"{path.name}: {node.name}")
    assert subclasses == []
