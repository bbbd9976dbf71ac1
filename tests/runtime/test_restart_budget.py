"""The supervisor's restart budget: a crash loop gives up, a runtime that crashes now and then
over weeks keeps being restarted, and the back-off grows with the deaths in the window."""

from __future__ import annotations

from minirt.launch.supervisor import RestartBudget


def test_a_crash_loop_gives_up_after_the_limit():
    budget = RestartBudget(limit=5, window_s=600)
    waits = [budget.died(t) for t in (0, 3, 6, 12, 22)]
    assert waits == [2.0, 2.0, 4.0, 8.0, 10.0]  # every peer has seen the death after 2 s
    assert budget.died(40) is None  # a sixth death within the window: give up
    assert budget.total == 5


def test_deaths_far_apart_never_exhaust_it():
    budget = RestartBudget(limit=5, window_s=600)
    day = 86_400.0
    waits = [budget.died(i * day) for i in range(30)]  # one crash a day for a month
    assert waits == [2.0] * 30 and budget.total == 30


def test_the_window_slides():
    budget = RestartBudget(limit=2, window_s=100)
    assert budget.died(0) == 2.0 and budget.died(50) == 2.0
    assert budget.died(99) is None  # three within 100 s
    assert budget.died(100) is not None  # the first has left the window
