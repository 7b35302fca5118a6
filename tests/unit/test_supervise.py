"""A GPU actor that dies is started again (engine/_supervise.py), within a budget.

In-process (the thread actor, its loop made to raise through the fault hook) and as a real
`trio-mlx serve` process whose actor process is SIGKILLed: every request in flight ends at
once with an error (rule 8); while the new actor loads, /ready and new requests get 503 with
Retry-After and /health stays 200 ("restarting"); then the server serves again. Past the
restart budget the engine is broken and `trio-mlx serve` exits 1.

Here the budget alone; in process: tests/integration/test_supervise.py; as a process:
tests/system/test_supervise.py.
"""

from __future__ import annotations

import pytest

from trio_mlx.engine._supervise import RestartBudget

pytestmark = pytest.mark.timeout(90)


def test_the_budget_backs_off_and_runs_out() -> None:
    b = RestartBudget(limit=3, window=100.0, backoff=1.0)
    assert [b.next_delay(t) for t in (0, 1, 2)] == [1.0, 2.0, 4.0]
    assert b.next_delay(3) is None  # 3 within 100 s
    assert b.next_delay(101) == 4.0  # the first one left the window
    assert RestartBudget(limit=0).next_delay(0) is None
    capped = RestartBudget(limit=10, backoff=10)
    assert [capped.next_delay(i) for i in range(4)] == [10, 20, 30, 30]
