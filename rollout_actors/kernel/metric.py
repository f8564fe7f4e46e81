"""Metrics declared where they are recorded, exported through Ray's metrics API. Imports nothing else of
the project."""

from __future__ import annotations

import threading
from typing import Any

from pydantic import BaseModel, ConfigDict

_instruments: dict[str, Any] = {}
_instruments_lock = threading.Lock()


class Metric(BaseModel):
    """One metric, declared where it is recorded and exported through Ray's metrics API
    (`ray.util.metrics`): it shows in the Ray dashboard and on every node's Prometheus endpoint as
    `ray_rollouts_<name>`. The instrument is created in each process on first use; recording never
    raises (a metric must not fail a rollout) and is a no-op outside a connected Ray worker."""

    model_config = ConfigDict(frozen=True)

    kind: str
    """`counter`, `gauge` or `histogram`."""
    name: str
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()
    """Histogram bucket upper bounds."""

    def record(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        try:
            instrument = _instruments.get(self.name) or self._create()
            if instrument is None:
                return
            if self.kind == "counter":
                instrument.inc(value, tags=tags)
            elif self.kind == "gauge":
                instrument.set(value, tags=tags)
            else:
                instrument.observe(value, tags=tags)
        except Exception:  # noqa: BLE001 - observability must never break the thing observed
            pass

    def _create(self) -> Any:
        import ray
        from ray.util import metrics

        if not ray.is_initialized():
            return None
        with _instruments_lock:
            if self.name not in _instruments:
                name, keys = f"rollouts_{self.name}", self.tag_keys
                if self.kind == "counter":
                    made = metrics.Counter(name, description=self.description, tag_keys=keys)
                elif self.kind == "gauge":
                    made = metrics.Gauge(name, description=self.description, tag_keys=keys)
                else:
                    made = metrics.Histogram(
                        name, description=self.description, boundaries=list(self.boundaries), tag_keys=keys
                    )
                _instruments[self.name] = made
            return _instruments[self.name]


LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
