"""A verifiers v1 harness for the parity tests' own-loop side: the `null` harness's plain chat loop
(system prompt, prompt, then model calls until a reply without tool calls; a call of a tool it was not
given is answered with an error), run in process instead of as a uv script, which would need the
network to install. verifiers allows it: every model call still goes through the rollout's
interception endpoint, which is where its stops, limits and trace live."""

import openai
import verifiers.v1 as vf


class InProcessChatHarness(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.extend(m.model_dump(exclude_none=True) for m in prompt or [])
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            while True:
                try:
                    completion = await client.chat.completions.create(model=ctx.model, messages=messages)
                except openai.APIStatusError as exc:  # a refused call ("rollout stopped") ends the program
                    return vf.ProgramResult(exit_code=1, stdout="", stderr=str(exc))
                message = completion.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    return vf.ProgramResult(exit_code=0, stdout="", stderr="")
                for call in message.tool_calls:
                    content = f"error: unknown tool {call.function.name!r}"
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": call.id,
                            "content": content,
                            "name": call.function.name,
                        }
                    )


__all__ = ["InProcessChatHarness"]
