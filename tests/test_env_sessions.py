"""The env pool's record of open sessions (`OpenSessions`), without Ray: the per-worker index kept in step,
and the quiet sessions found at the front of the order their pool last heard of them in."""

from __future__ import annotations

from env_actors.sessions import OpenSessions


def sessions_at(*placed: tuple[str, str, float]) -> OpenSessions:
    record = OpenSessions()
    for session_id, worker, now in placed:
        record.add(session_id, worker, now, owner="worker-a")
    return record


def test_the_quiet_sessions_are_those_not_heard_of_since_the_cutoff_oldest_first():
    record = sessions_at(("s1", "env0", 1.0), ("s2", "env1", 2.0), ("s3", "env0", 3.0))
    assert [sid for sid, _ in record.quiet_since(2.5)] == ["s1", "s2"]
    assert record.quiet_since(1.0) == []
    assert [session.server for _, session in record.quiet_since(9.0)] == ["env0", "env1", "env0"]


def test_a_session_heard_of_again_leaves_the_quiet_ones_and_keeps_its_place_on_its_worker():
    record = sessions_at(("s1", "env0", 1.0), ("s2", "env1", 2.0), ("s3", "env0", 3.0))
    record.touch("s1", 4.0)
    assert [sid for sid, _ in record.quiet_since(3.5)] == ["s2", "s3"]
    assert record.get("s1").last_used == 4.0 and record.on("env0") == 2
    assert [sid for sid, _ in record.quiet_since(5.0)] == ["s2", "s3", "s1"]


def test_ended_sessions_leave_the_order_and_the_index_together():
    record = sessions_at(("s1", "env0", 1.0), ("s2", "env1", 2.0), ("s3", "env0", 3.0))
    assert record.pop("s1").server == "env0"
    assert record.drop_server("env1") == ["s2"]
    assert [sid for sid, _ in record.quiet_since(9.0)] == ["s3"]
    assert record.on("env0") == 1 and record.only_one_on("env0") == "s3" and len(record) == 1
    assert record.owned_by("worker-a") == ["s3"] and "s1" not in record
