"""The GPU actor in a child process (`actor="process"`): the same answers as the thread actor,
aborts, load failures, a child that dies, and a child that never outlives its engine.

Here the pipe link alone; the engine over the process actor: tests/integration/test_actor_process.py;
a parent killed with SIGKILL: tests/system/test_actor_process.py.
"""

from __future__ import annotations

import os


def test_the_pipe_link_keeps_commands_that_came_with_the_config_and_stops_at_end_of_file():
    from trio_mlx.actor import Abort, Shutdown, StepReport
    from trio_mlx.actor._process import PipeLink, _frame

    to_child, from_engine = os.pipe()
    link = PipeLink(to_child, os.open(os.devnull, os.O_WRONLY))
    os.write(from_engine, _frame("config") + _frame([Abort(1)]) + _frame([Abort(2), Abort(3)]))
    assert link.config() == "config"
    assert link.wait_commands() == [Abort(1), Abort(2), Abort(3)]
    assert link.exchange(StepReport()) == []  # nothing waiting: no block while decoding
    os.write(from_engine, _frame([Abort(4)])[:3])  # half a frame, then the engine is gone
    os.close(from_engine)
    assert link.wait_commands() == [Shutdown()]
