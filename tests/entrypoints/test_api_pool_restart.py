"""The supervisor's bound on restarting API processes (api_server_pool.RestartBudget) and how
it words an exit, without processes. The restart itself is checked in
test_api_server_count.py (an API process killed, a new one serving on its index)."""

from __future__ import annotations

import signal

import pytest

from shoal.entrypoints.openai.pool_restart import RestartBudget, describe_exit


def test_an_index_is_restarted_at_most_limit_times_within_the_window():
    budget = RestartBudget(limit=5, window_s=60.0)
    assert [budget.take(0, t) for t in (0.0, 1.0, 2.0, 3.0, 4.0)] == [True] * 5
    assert budget.recent(0) == 5
    assert not budget.take(0, 5.0)  # a 6th death within 60 s: given up
    assert not budget.take(0, 59.9)  # (a refusal is not counted against it)
    assert budget.recent(0) == 5
    # the other indexes have budgets of their own
    assert budget.take(1, 5.0) and budget.recent(1) == 1
    # the window slides: once the first restart is 60 s old there is room for one more
    assert budget.take(0, 60.0)
    assert not budget.take(0, 60.5)
    assert budget.take(0, 61.0) and budget.recent(0) == 5  # (restarts at 2..4, 60, 61)


def test_a_quiet_minute_gives_the_whole_budget_back():
    budget = RestartBudget(limit=2, window_s=10.0)
    assert budget.take(3, 0.0) and budget.take(3, 0.5) and not budget.take(3, 1.0)
    assert budget.take(3, 100.0) and budget.take(3, 100.1) and not budget.take(3, 100.2)


def test_limit_zero_never_restarts_and_bad_bounds_are_refused_by_name():
    assert not RestartBudget(limit=0).take(0, 0.0)
    with pytest.raises(ValueError, match="limit must be >= 0"):
        RestartBudget(limit=-1)
    with pytest.raises(ValueError, match="window_s must be > 0"):
        RestartBudget(window_s=0)


def test_exit_codes_and_signals_in_words():
    assert describe_exit(-signal.SIGKILL) == "killed by signal SIGKILL"
    assert describe_exit(-signal.SIGSEGV) == "killed by signal SIGSEGV"
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(None) == "exit status unknown"


def test_repeated_restarts_back_off_and_a_quiet_window_resets_the_wait():
    budget = RestartBudget(limit=6, window_s=60.0)
    waits = []
    for t in (0.0, 1.0, 2.0, 3.0, 4.0, 5.0):
        assert budget.take(2, t)
        waits.append(budget.backoff_s(2))
    assert waits == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0]  # the first comes back at once
    assert budget.backoff_s(0) == 0.0  # an index that never died
    big = RestartBudget(limit=20, window_s=60.0)
    for t in range(20):
        big.take(0, float(t))
    assert big.backoff_s(0) == 8.0  # capped
    assert budget.take(2, 200.0) and budget.backoff_s(2) == 0.0
