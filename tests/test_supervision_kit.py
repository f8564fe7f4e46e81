"""The supervision kit: restart intensity is data, one budget spends it, with one edge rule, and one
liveness rule, for every supervisor (rollout workers, env servers, renderers, inference servers, the
plane's pools)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollout_actors.kernel.supervision import Liveness, RestartBudget, RestartIntensity


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


def test_a_child_is_wedged_only_once_nothing_showed_it_alive_for_its_hang_timeout():
    life = Liveness(hang_timeout_s=10, last_alive=0.0)
    assert not life.wedged(now=10.0) and life.wedged(now=10.5)
    life.heard(now=12.0)
    assert life.silent_s(now=20.0) == 8.0 and not life.wedged(now=20.0)
    assert life.verdict(now=23.0) == "no sign of life for 11.0 s (hang_timeout_s 10 s)"


def test_an_answer_from_a_side_loop_is_dated_back_by_the_main_loops_stall():
    life = Liveness(hang_timeout_s=10, last_alive=0.0)
    life.heard(loop_stall_s=9.0, now=12.0)  # answered at 12, but its rollout loop last turned at 3
    assert life.wedged(now=13.5)
    life.heard(loop_stall_s=0.0, now=1.0)  # an older answer never moves the clock back
    assert life.last_alive == 3.0


def test_time_the_supervisor_could_not_listen_is_excused_not_held_against_the_child():
    life = Liveness(hang_timeout_s=10, last_alive=0.0)
    life.excuse(6.0, now=14.0)  # the supervisor's own loop stalled for 6 s
    assert not life.wedged(now=14.0) and life.wedged(now=16.5)
    life.excuse(100.0, now=20.0)  # never alive "in the future"
    assert life.last_alive == 20.0
