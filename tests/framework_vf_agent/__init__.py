"""A verifiers v1 harness (0.4.x) that runs its agent as a program of its own, as verifiers' bundled
harnesses do: `python -m framework_vf_agent.program`, started in the rollout's runtime
(`runtime.run_program`), is handed the rollout's interception endpoint and secret (argv, as verifiers
hands them, so tools do not inherit them) and the tool servers' MCP config, and calls the model only
through that endpoint. The program is the chat loop of `framework_vf_chat`, with the stack's own
interpreter: verifiers' bundled chat program is a uv script that would need the network to install,
and it streams, which the stand-in does not."""

import json
import os
import sys

from framework_vf_chat import InProcessChatHarness, mcp_config, opening


def import_path() -> str:
    """The program imports what this process imports (a pool ships each package to a folder of its
    own), whatever its runtime's cwd."""
    return os.pathsep.join(path for path in sys.path if path)


class AgentProgramHarness(InProcessChatHarness):
    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        argv = [
            sys.executable, "-m", "framework_vf_agent.program",
            f"--base-url={endpoint}", f"--api-key={secret}", f"--model={ctx.model}",
            f"--messages={json.dumps(opening(self, data))}",
            f"--mcp-config={json.dumps(mcp_config(mcp_urls, self.config.tool_timeout))}",
        ]  # fmt: skip
        return await runtime.run_program(argv, {"PYTHONPATH": import_path()})


__all__ = ["AgentProgramHarness"]
