"""Rollout workers that answer at once, for `bench_driver.py`: nothing here is in the product. The bench
installs it in every Ray worker process it starts (`worker_process_setup_hook`), and it wraps
`rollout_actors.rollout.worker.run_rollout` there: a request whose `metadata` carries `{"bench": "instant"}`
is answered `ok` at once (no env session, no renderer, no model call); any other runs as usual. So one
cluster measures both the driver alone and the real path.
"""

from __future__ import annotations

import time
from typing import Any

INSTANT = {"bench": "instant"}
"""The request metadata that asks for an instant answer."""


def install() -> None:
    """Wrap `run_rollout` in this process (idempotent)."""
    import rollout_actors.rollout.worker as worker
    from rollout_actors.wire import Result

    if getattr(worker, "_bench_instant", False):
        return
    worker._bench_instant = True
    run_rollout = worker.run_rollout

    async def instant_or_real(request: Any, *args: Any, **kwargs: Any) -> Any:
        if request.metadata.get("bench") != "instant":
            return await run_rollout(request, *args, **kwargs)
        now = time.time()
        return Result.of(request, "ok", reward=1.0, started_at=now, finished_at=now)

    worker.run_rollout = instant_or_real
