"""`rollouts run`'s progress: rollouts done of rollouts asked, and until the first one, what the run waits for.

    status = RunStatus(total=256, live=True)
    with status:
        status.stage("starting the env pool")
        ...
        status.update(done=31, in_flight=64, failed={"caller": 2})

Live, it is one bar that fits an 80-column terminal whole (the counter is never cut); with `live=False`
(`--no-progress`, `ray job logs`) a plain line every `STATUS_EVERY_S` and one at the end. The rate is
rollouts per second since the first submission, the same clock `rollouts report` reads from the file.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

STATUS_EVERY_S = 5.0  # the plain status line of `--no-progress`
BAR_WIDTH = 16  # with the counter, the clock and a 40-character description: 80 columns
DESCRIPTION_WIDTH = 40


def counts_text(in_flight: int, failed: Mapping[str, int], rate: float) -> str:
    """The live bar's description once results come: short enough for `DESCRIPTION_WIDTH`."""
    return f"in flight {in_flight}  failed {sum(failed.values())}  {rate:.1f}/s"


def plain_line(done: int, total: int, in_flight: int, failed: Mapping[str, int], rate: float) -> str:
    kinds = " ".join(f"{k}={v}" for k, v in sorted(failed.items())) or "none"
    return f"done {done}/{total}  in flight {in_flight}  failed: {kinds}  {rate:.1f} rollouts/s"


class RunStatus:
    """Done / in flight / failed and rollouts/s per rollout answered; a stage line until the first one."""

    def __init__(
        self,
        total: int,
        live: bool,
        console: Console | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._total, self._live, self._clock = total, live, clock
        self._first_submit: float | None = None
        self._last_line = 0.0
        self._progress = Progress(
            TextColumn("{task.description}", table_column=_fixed(DESCRIPTION_WIDTH)),
            BarColumn(bar_width=BAR_WIDTH),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=not live,
            transient=False,
        )
        # Its clock starts at the first submission (`submitted`), the report's zero: bar and summary agree.
        self._task = self._progress.add_task("starting", total=total, start=False)

    def __enter__(self) -> RunStatus:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def stage(self, text: str) -> None:
        """What the run waits for before its first result (Ray, the stand-in, the env pool, a tokenizer)."""
        if self._live:
            self._progress.update(self._task, description=text[:DESCRIPTION_WIDTH])
        else:
            print(f"{text} ...", flush=True)

    def submitted(self) -> None:
        """The first submission: the clock of the rate starts here, as the report's does."""
        if self._first_submit is None:
            self._first_submit = self._clock()
            self._progress.start_task(self._task)

    def update(self, done: int, in_flight: int, failed: Mapping[str, int]) -> None:
        now = self._clock()
        since = now - self._first_submit if self._first_submit is not None else 0.0
        rate = done / since if since > 0 else 0.0
        if self._live:
            text = counts_text(in_flight, failed, rate)
            self._progress.update(self._task, completed=done, description=text)
        elif now - self._last_line >= STATUS_EVERY_S or done == self._total:
            self._last_line = now
            print(plain_line(done, self._total, in_flight, failed, rate), flush=True)


def _fixed(width: int) -> Any:
    from rich.table import Column

    return Column(width=width, no_wrap=True, overflow="ellipsis")
