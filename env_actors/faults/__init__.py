"""Environments that fail on purpose, loaded by Ref like any other: the fault table and the fault tests
run real environment code in real EnvServer processes, not mocks. Never use them for training."""
