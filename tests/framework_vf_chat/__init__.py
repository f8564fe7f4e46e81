"""A verifiers v1 harness for the parity tests' own-loop side: the `null` harness's plain chat loop
(system prompt, prompt, then model calls until a reply without tool calls; the tools are the rollout's
MCP tool servers, listed and called with verifiers' own MCP client; a call of a tool it was not given is
answered with an error), run in process instead of as a uv script, which would need the network to
install. verifiers allows it: every model call still goes through the rollout's interception endpoint,
which is where its stops, limits and trace live.

`chat` is the loop itself; `framework_vf_agent` runs the same loop as a program of its own."""

import contextlib
import json

import openai
import verifiers.v1 as vf
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp


def opening(harness: vf.Harness, data: vf.TaskData) -> list[dict]:
    """The conversation's first messages: the system prompt, then the task's prompt."""
    system, prompt = harness.resolve_prompt(data)
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    else:
        messages.extend(m.model_dump(exclude_none=True) for m in prompt or [])
    return messages


def mcp_config(mcp_urls: dict[str, str], tool_timeout: float) -> dict:
    return {"mcpServers": {name: {"url": url, "timeout": tool_timeout} for name, url in mcp_urls.items()}}


async def chat(endpoint: str, secret: str, model: str, messages: list[dict], mcp: dict) -> vf.ProgramResult:
    """Model calls through `endpoint` until a reply without tool calls; tool calls go to the MCP servers
    of `mcp` (verifiers' `--mcp-config` shape). A refused call ("rollout stopped") ends the program."""
    async with contextlib.AsyncExitStack() as stack:
        tools, dispatch, servers = await connect_mcp(mcp, stack) if mcp.get("mcpServers") else ([], {}, {})
        client = await stack.enter_async_context(
            openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        )
        while True:
            try:
                completion = await client.chat.completions.create(
                    model=model, messages=messages, **({"tools": tools} if tools else {})
                )
            except openai.APIStatusError as exc:
                return vf.ProgramResult(exit_code=1, stdout="", stderr=str(exc))
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return vf.ProgramResult(exit_code=0, stdout="", stderr="")
            for call in message.tool_calls:
                name = call.function.name
                if name in dispatch:
                    content = await call_mcp(
                        servers, dispatch, name, json.loads(call.function.arguments or "{}")
                    )
                else:
                    content = f"error: unknown tool {name!r}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": content, "name": name})


class InProcessChatHarness(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        mcp = mcp_config(mcp_urls, self.config.tool_timeout)
        return await chat(endpoint, secret, ctx.model, opening(self, data), mcp)


__all__ = ["InProcessChatHarness"]
