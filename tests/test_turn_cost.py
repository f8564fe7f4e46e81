"""A turn costs what it adds: what a token-mode model call moves besides the prompt does not grow with the
context, and the ids it records are exactly the server's. (`scripts/bench_trajectory.py` measures the
whole plane per turn on 100k-token trajectories; these are the properties it rests on.)"""

from __future__ import annotations

import asyncio

import openai
import orjson

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.rollout.client import httpx
from rollout_actors.rollout.model_call import PromptJson, complete_tokens
from rollout_actors.wire import SamplingConfig

LONG = 20_000  # tokens: far past any answer, inside the stand-in's context window


def prompt_of(length: int) -> list[int]:
    words = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]  # "The quick brown fox ..."
    return (
        [151644, 872, 198]
        + [words[i % len(words)] for i in range(length)]
        + [151645, 198, 151644, 77091, 198]
    )


async def call(standin, prompt: list[int]) -> tuple[list[int], int, dict]:
    """(sampled ids, bytes of the answer, the answer) of one token-mode call."""
    answers: list[bytes] = []

    async def keep(response: httpx.Response) -> None:
        answers.append(await response.aread())

    http = httpx.AsyncClient(event_hooks={"response": [keep]})
    client = openai.AsyncOpenAI(base_url=standin.base_url, api_key="EMPTY", http_client=http)
    try:
        sampled = await complete_tokens(
            client, BUNDLED_MODEL, prompt, SamplingConfig(max_tokens=32, seed=3), timeout_s=60
        )
    finally:
        await client.close()
    return sampled.completion_ids, len(answers[-1]), orjson.loads(answers[-1])


def test_a_token_mode_answer_does_not_carry_the_prompt_back(standin):
    async def scenario():
        return await call(standin, prompt_of(20)), await call(standin, prompt_of(LONG))

    (short_ids, short_bytes, _), (long_ids, long_bytes, answer) = asyncio.run(
        asyncio.wait_for(scenario(), 120)
    )
    assert short_ids and long_ids
    assert "prompt_token_ids" not in answer["choices"][0] or not answer["choices"][0]["prompt_token_ids"]
    # What comes back is the turn's own tokens: about the same for a 20-token and a 20k-token prompt,
    # where an echoed prompt alone would be > 100 kB.
    assert long_bytes < 4 * short_bytes + 2048, (short_bytes, long_bytes)


def test_the_ids_a_token_mode_call_records_are_the_ones_the_server_sampled(standin):
    async def scenario():
        ids, _, _ = await call(standin, prompt_of(50))
        raw = await openai.AsyncOpenAI(base_url=standin.base_url, api_key="EMPTY").completions.create(
            model=BUNDLED_MODEL,
            prompt=prompt_of(50),
            max_tokens=32,
            seed=3,
            extra_body={"return_token_ids": True},
        )
        return ids, raw.choices[0].token_ids  # type: ignore[attr-defined]

    recorded, sampled = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert recorded == sampled


def test_a_prompt_encoded_as_it_grows_is_the_prompt_the_server_gets(standin):
    # `TokenTurns` keeps a `PromptJson` per rollout: each call encodes only what the turn appended. The
    # body must still carry exactly the prompt, however the list changed between calls.
    bodies: list[dict] = []

    async def keep(request: httpx.Request) -> None:
        bodies.append(orjson.loads(request.content))

    async def scenario():
        http = httpx.AsyncClient(event_hooks={"request": [keep]})
        client = openai.AsyncOpenAI(base_url=standin.base_url, api_key="EMPTY", http_client=http)
        encoded, prompt, sent, answers = PromptJson(), prompt_of(30), [], []
        sampling = SamplingConfig(max_tokens=16, seed=5)

        async def turn(ids, **kwargs):
            sent.append(list(ids))
            sampled = await complete_tokens(client, BUNDLED_MODEL, ids, sampling, timeout_s=60, **kwargs)
            answers.append(sampled.completion_ids)
            return sampled

        try:
            first = await turn(prompt, prompt_json=encoded)
            prompt.extend(first.completion_ids + prompt_of(5))  # grown in place: only the turn is encoded
            await turn(prompt, prompt_json=encoded)
            prompt[-1] = 11  # the same list changed in place, not appended: noticed, encoded afresh
            await turn(prompt, prompt_json=encoded)
            await turn(prompt + [13], prompt_json=encoded)  # another list (a resumed turn): afresh
            forked = prompt_of(12)  # a fork: a new, shorter list
            await turn(forked, prompt_json=encoded)
            await turn(forked)  # the same prompt without it: the same answer
        finally:
            await client.close()
        return sent, answers

    sent, answers = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert [body["prompt"] for body in bodies] == sent
    assert answers[-1] == answers[-2]
    assert all(set(body) == set(bodies[-1]) for body in bodies)  # the same fields with and without it
