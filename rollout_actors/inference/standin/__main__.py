import sys

# The stand-in runs no model: `torch` (vLLM's dependency) stays out of its process. transformers 5 imports
# torch at its own import whenever it is installed, ~5 s of every stand-in start on 2 cores; blocked, it
# loads the same tokenizers (tokenizers only). Anything here that did reach for torch fails loudly.
sys.modules.setdefault("torch", None)

from rollout_actors.inference.standin.server import main  # noqa: E402

sys.exit(main())
