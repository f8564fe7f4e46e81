"""The `calculator` tool server: a verifiers `Toolset`, which verifiers launches per rollout as
`python -m framework_vf_tools.toolset` in the rollout's runtime and reaches over MCP."""

import verifiers.v1 as vf
from framework_envs import calculator


class Calculator(vf.Toolset[vf.ToolsetConfig, vf.State]):
    TOOL_PREFIX = None  # advertised bare, as `calculator`: the name the stand-in calls

    @vf.tool
    async def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression, e.g. "(3 + 4) * 5"."""
        return calculator(expression)


if __name__ == "__main__":
    Calculator.run()
