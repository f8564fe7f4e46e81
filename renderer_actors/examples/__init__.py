"""Custom renderers a rollout may name by `Ref` under the default renderer allowlist."""
