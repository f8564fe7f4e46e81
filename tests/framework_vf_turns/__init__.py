"""A verifiers v1 harness with a fixed number of turns, for the serve-env benchmark
(`scripts/bench_serve_env.py`): the plain chat loop of `framework_vf_chat`, except that after each reply the
environment answers with a user message until the episode has made `TURNS` model calls. Three model calls,
three trace turns and their deltas per episode, whatever the model says; run in process (no network)."""

import openai
import verifiers.v1 as vf

TURNS = 3
FOLLOW_UP = "Check your answer once more and give it again in \\boxed{}."


class FixedTurnsChatHarness(vf.Harness[vf.HarnessConfig]):
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
            for turn in range(TURNS):
                try:
                    completion = await client.chat.completions.create(model=ctx.model, messages=messages)
                except openai.APIStatusError as exc:  # a refused call ("rollout stopped") ends the program
                    return vf.ProgramResult(exit_code=1, stdout="", stderr=str(exc))
                messages.append({"role": "assistant", "content": completion.choices[0].message.content or ""})
                if turn + 1 < TURNS:
                    messages.append({"role": "user", "content": FOLLOW_UP})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["FixedTurnsChatHarness"]
