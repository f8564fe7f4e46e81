"""Restart intensity: N spawns in any window of T seconds, the rest refused until the window moves on."""

from __future__ import annotations

from env_actors.budget import RestartBudget, RestartIntensity


def test_budget_allows_max_restarts_per_window_then_refuses():
    budget = RestartBudget(RestartIntensity(max_restarts=3, window_s=60))
    assert [budget.try_spend(now=t) for t in (0, 1, 2, 3)] == [True, True, True, False]
    assert budget.remaining(now=30) == 0


def test_rare_deaths_over_a_long_run_never_exhaust_the_budget():
    budget = RestartBudget(RestartIntensity(max_restarts=2, window_s=60))
    assert all(budget.try_spend(now=t) for t in range(0, 3600, 31))


def test_spent_restarts_come_back_as_the_window_slides():
    budget = RestartBudget(RestartIntensity(max_restarts=2, window_s=10))
    assert budget.try_spend(now=0) and budget.try_spend(now=5) and not budget.try_spend(now=9)
    assert budget.remaining(now=10) == 1 and budget.try_spend(now=10) and not budget.try_spend(now=14)


def test_zero_restarts_means_no_respawn_at_all():
    assert not RestartBudget(RestartIntensity(max_restarts=0)).try_spend(now=0)
