"""Inference servers: the bundled stand-in (CPU) and supervised server actors."""
