"""Custom renderers that fail their start on purpose, loaded by Ref like any other (outside the default
allowlist: a pool must widen it to name them): one raises while its module imports, one ends its process
there as a crashing native extension would. The startup-failure tests run them in real renderer actors.
Never use them for training."""
