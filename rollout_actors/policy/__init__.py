"""Policy publication and weights: LoRA adapters published to every server, full-weight updates,
and the off-policy bounds that follow a new version."""
