"""A custom renderer module whose import raises: the renderer's load fails with this error."""

raise RuntimeError("planted: the renderer's module broke on import")
