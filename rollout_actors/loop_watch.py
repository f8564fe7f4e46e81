"""Moved to the kernel (`rollout_actors.kernel.loop_watch`), where env servers can use it too."""

from rollout_actors.kernel.loop_watch import HEARTBEAT_S, LoopWatch

__all__ = ["HEARTBEAT_S", "LoopWatch"]
