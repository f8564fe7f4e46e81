"""The supervision kit: restart intensity is data, one budget spends it, with one edge rule for every
supervisor (rollout workers, env servers, renderers, inference servers, the plane's pools)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollout_actors.kernel import RestartBudget, RestartIntensity


def test_budget_allows_max_restarts_per_window_then_refuses():
    budget = RestartBudget(RestartIntensity(max_restarts=3, window_s=60))
    assert [budget.try_spend(now=t) for t in (0, 1, 2, 3)] == [True, True, True, False]
    assert budget.remaining(now=30) == 0 and budget.used(now=30) == 3 and budget.spent_total == 3


def test_a_restart_stops_counting_exactly_window_s_after_it_was_spent():
    budget = RestartBudget(RestartIntensity(max_restarts=1, window_s=10))
    assert budget.try_spend(now=0.0)
    assert not budget.try_spend(now=9.999)
    assert budget.remaining(now=10.0) == 1 and budget.try_spend(now=10.0)


def test_rare_deaths_over_a_long_run_never_exhaust_the_budget():
    budget = RestartBudget(RestartIntensity(max_restarts=2, window_s=60))
    assert all(budget.try_spend(now=t) for t in range(0, 3600, 31))


def test_spent_restarts_come_back_as_the_window_slides():
    budget = RestartBudget(RestartIntensity(max_restarts=2, window_s=10))
    assert budget.try_spend(now=0) and budget.try_spend(now=5) and not budget.try_spend(now=9)
    assert budget.remaining(now=10) == 1 and budget.try_spend(now=10) and not budget.try_spend(now=14)


def test_zero_restarts_means_no_respawn_at_all():
    budget = RestartBudget(RestartIntensity(max_restarts=0, window_s=60))
    assert not budget.try_spend(now=0)
    assert "0 restarts in 60 s" in budget.spent_message()


def test_intensity_is_frozen_data_that_refuses_unknown_or_absurd_settings():
    with pytest.raises(ValidationError):
        RestartIntensity(max_restart=3, window_s=60)  # a misspelled key is an error, not a silent default
    with pytest.raises(ValidationError):
        RestartIntensity(max_restarts=3)  # half a setting is refused, not completed from a generic default
    with pytest.raises(ValidationError):
        RestartIntensity(max_restarts=3, window_s=0)
    with pytest.raises(ValidationError):
        RestartIntensity(max_restarts=3, window_s=60).max_restarts = 4  # type: ignore[misc]
