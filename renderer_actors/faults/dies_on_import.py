"""A custom renderer module whose import ends the renderer's process, as a native crash would."""

import os

os._exit(3)
