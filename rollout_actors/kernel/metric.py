"""Metrics declared where they are recorded, exported through Ray's metrics API. Imports nothing else of
the project."""

from __future__ import annotations

import threading
from typing import Any

from pydantic import BaseModel, ConfigDict

_instruments: dict[str, Any] = {}
_instruments_lock = threading.Lock()
_gauge_values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
"""The value each gauge (by name and tags) was last set to in this process: setting it again is skipped."""
MAX_GAUGE_SERIES = 4096  # remembered gauge values; forgotten all at once past this (one set each again)


class Metric(BaseModel):
    """One metric, declared where it is recorded and exported through Ray's metrics API
    (`ray.util.metrics`): it shows in the Ray dashboard and on every node's Prometheus endpoint as
    `ray_rollouts_<name>`. The instrument is created in each process on first use; recording never
    raises (a metric must not fail a rollout) and is a no-op outside a connected Ray worker. A gauge set
    to the value it already holds is not set again: owners may record their gauges on every tick."""

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
            if self.kind == "gauge":
                series = (self.name, tuple(sorted(tags.items())) if tags else ())
                if _gauge_values.get(series) == value:
                    return
                if len(_gauge_values) >= MAX_GAUGE_SERIES:
                    _gauge_values.clear()
            instrument = _instruments.get(self.name) or self._create()
            if instrument is None:
                return
            if self.kind == "counter":
                instrument.inc(value, tags=tags)
            elif self.kind == "gauge":
                instrument.set(value, tags=tags)
                _gauge_values[series] = value
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
