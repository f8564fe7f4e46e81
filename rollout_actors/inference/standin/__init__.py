"""The bundled stand-in inference server: vLLM's OpenAI-compatible wire format, served on CPU for tests,
benchmarks and the demo. Production points the same code at vLLM.

    with StandinServer(StandinOptions(latency_s=0.05)) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x")

`python -m rollout_actors.inference.standin --help` runs one by hand.
"""

from rollout_actors.inference.standin.launch import StandinServer, StandinStartupError
from rollout_actors.inference.standin.server import StandinOptions

__all__ = ["StandinOptions", "StandinServer", "StandinStartupError"]
