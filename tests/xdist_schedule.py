"""How pytest-xdist hands out the suite under `--dist loadfile` (scripts/test.sh): longest work first.

xdist's own loadfile scheduler sends whole files in order of how many tests they hold, so the
files that take longest (a few subprocess tests each, 30-50 s apiece) came last, and the run ended
with one worker on them while the other sat idle. `LongestFirst` keeps loadfile's unit, the file
(a module's fixtures and its tests' order stay together), with two changes:

- the next unit a worker gets is the one expected to take longest (`COST`), so the system layer
  starts first and the unit layer's small files fill the end;
- the files in `SPLIT` (tests that each start their own processes and share no module fixture)
  are a unit per test, so their long tests run on several workers at once.

The estimates only order the work: a wrong one costs balance, never a test. A test not in `COST`
counts its layer's `PER_TEST`.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

# Seconds a test takes, by node id prefix (the longest prefix that matches wins), from the plugin-timed
# walls of a whole-suite run with two workers on the 2-core dev machine (beside other work).
COST = {
    "tests/system/test_soak.py": 40,
    "tests/system/test_process_exit.py": 15,
    "tests/system/test_distributed.py": 4,  # the module's group of ranks: ~35 s once, in its first test
    "tests/system/test_distributed.py::test_a_follower_that_dies_or_hangs": 14,
    "tests/system/test_connections.py": 9,
    "tests/system/test_workers.py": 9,
    "tests/system/test_supervise.py": 8,
    "tests/system/test_app_process.py": 5.5,
    "tests/system/test_faults_process.py": 5.5,
    "tests/system/test_models.py": 4,
    "tests/system/test_agents_cli.py": 4,
    "tests/system/test_actor_process.py": 6.5,
    "tests/system/test_page_browser.py": 3,
    "tests/system/test_examples.py": 3,
    "tests/system/test_asgi_servers.py": 3,
    "tests/system/test_bench.py": 2,
    "tests/system/test_fuzz.py": 2,
    "tests/integration/test_warmup.py": 3,
    "tests/integration/test_actor_process.py": 2.7,
    "tests/integration/test_starvation.py": 2.3,
    "tests/integration/test_kv_bits.py": 1.9,
    "tests/integration/test_models.py": 1.6,
    "tests/integration/test_app_responses.py": 1.5,
    "tests/integration/test_prompt_cache.py": 1.4,
    "tests/integration/test_engine.py": 1.4,
    "tests/integration/test_adapters.py": 1.4,
    "tests/integration/test_speculative.py": 1.3,
    "tests/integration/test_structured_engine.py": 1.3,
    # the unit layer's waits (fake actors' slow loads and steps): first when it runs alone
    "tests/unit/test_app_models.py": 1.4,
    "tests/unit/test_model_pool.py": 0.9,
    "tests/unit/test_hostile_bounds.py": 0.6,
}
PER_TEST = {"tests/system/": 3.0, "tests/integration/": 1.0, "tests/unit/": 0.2}

# Node id prefixes whose tests are each a unit of their own.
SPLIT = (
    "tests/system/test_process_exit.py::",
    "tests/system/test_soak.py::",
    "tests/system/test_distributed.py::test_a_follower_that_dies_or_hangs",
    "tests/system/test_workers.py::",
    "tests/system/test_connections.py::",
    "tests/system/test_agents_cli.py::",
    "tests/system/test_faults_process.py::",
    "tests/system/test_models.py::",
    "tests/system/test_app_process.py::",
    "tests/system/test_supervise.py::",
)


def cost(nodeid: str) -> float:
    matches = [prefix for prefix in COST if nodeid.startswith(prefix)]
    if matches:
        return COST[max(matches, key=len)]
    return next((s for layer, s in PER_TEST.items() if nodeid.startswith(layer)), 1.0)


class LongestFirst(LoadFileScheduling):
    """loadfile, handing out the longest unit first, with the `SPLIT` files a unit per test."""

    def _split_scope(self, nodeid: str) -> str:
        if nodeid.startswith(SPLIT):
            return nodeid
        return super()._split_scope(nodeid)

    def _assign_work_unit(self, node) -> None:  # noqa: ANN001 - xdist's WorkerController
        scope = max(self.workqueue, key=lambda s: sum(cost(nodeid) for nodeid in self.workqueue[s]))
        self.workqueue.move_to_end(scope, last=False)  # the base class pops the first unit
        super()._assign_work_unit(node)
