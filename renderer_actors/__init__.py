"""Renderers (tokenizer + chat template) and the autoscaling pool of renderer actors."""
