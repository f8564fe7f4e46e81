"""Benchmark: the size of a long agentic trajectory's `Result`, stored once vs whole prompts per turn.

    python scripts/bench_result.py [--turns 64] [--tool-tokens 1500] [--completion-tokens 80]

One trajectory is built the way a token-mode rollout builds it: the bundled Qwen3 renderer renders the
first prompt and bridges every turn (sampled completion: a think block + a tool call, ~`--completion-tokens`
ids with full-precision logprobs, every 8th cut by `length`; then a tool answer of ~`--tool-tokens` tokens),
recording each turn as `turns.TokenTurns` does. At turns 1, 16 and 64 it prints the `Result`'s size as JSON
(what `rollouts run` writes, compact) and as Ray serialises it (what crosses from worker to driver: the
JSON, as a string), next to

  unique   the trajectory's unique token ids + the sampled logprobs alone, in the same encoding;
  old      the previous shape, where every turn carried its whole prompt (grows with turns x context).

Target (issue 12): result / unique <= 1.2 at 64 turns, ~100k tokens.

Timings (issue 29): every turn carries its phases (`Turn.timings`) and the result its waits
(`Result.timings`), with values as a real run rounds them. The `timings` lines compare the same result with
and without them: JSON bytes per turn, and the CPU per turn of what a result costs on its way (the worker
dumps its JSON, the plane validates it back), measured side by side. The last line is
`result bytes per token at 64 turns: x` (the JSON form).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from pydantic import BaseModel, create_model
from ray._private.worker import global_worker

from renderer_actors.calls import BridgeRequest
from renderer_actors.key import RendererKey
from renderer_actors.renderer import Renderer
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.kernel import EXACT_JSON
from rollout_actors.samples import trainer_samples, turn_prompts, unique_tokens
from rollout_actors.timings import RolloutTimings, TurnTimings
from rollout_actors.wire import RendererConfig, Result, Turn

REPORT_AT = (1, 16, 64)
WORDS = "the a model token prefix cache json tool call result search query answer value list of".split()
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_turns(turns: int, tool_tokens: int, completion_tokens: int) -> list[Turn]:
    renderer = Renderer.load(RendererKey.from_config(BUNDLED_MODEL, RendererConfig()))
    rng = random.Random(0)
    messages = [
        {"role": "system", "content": "You are a research agent. " + words(rng, 200)},
        {"role": "user", "content": "Find the answer. " + words(rng, 100)},
    ]
    added = renderer.start(messages, TOOLS).prompt_ids
    synthetic = 0
    out: list[Turn] = []
    clock = random.Random(1)  # phase durations of its own, so the tokens stay those of the previous shape
    for index in range(turns):
        half = completion_tokens // 2
        text = (
            f"<think>\n{words(rng, half)}\n</think>\n\n<tool_call>\n"
            f'{{"name": "search", "arguments": {{"q": "{words(rng, half - 20)}"}}}}\n</tool_call><|im_end|>'
        )
        completion = renderer.encode(text)
        cut = index % 8 == 7
        if cut:  # a `length` cut: no close token sampled, the bridge appends one
            completion = completion[: len(completion) - 3]
        logprobs = [-abs(rng.gauss(0.0, 1.5)) for _ in completion]
        parsed = renderer.parse(completion, TOOLS)
        out.append(
            Turn(
                new_prompt_ids=added,
                completion_ids=completion,
                logprobs=logprobs,
                finish_reason="length" if cut else "stop",
                synthetic_ids=synthetic,
                content=parsed.content,
                reasoning=parsed.reasoning,
                tool_calls=parsed.tool_calls,
                timings=TurnTimings(
                    render_s=round(clock.uniform(0.0005, 0.003), 4),
                    model_s=round(clock.uniform(0.2, 5.0), 4),
                    parse_s=round(clock.uniform(0.0003, 0.002), 4),
                    env_s=round(clock.uniform(0.001, 0.5), 4),
                ),
            )
        )
        reply = renderer.bridge(
            BridgeRequest(
                completion_ids=completion,
                finish_reason="length" if cut else "stop",
                new_messages=[
                    {"role": "tool", "tool_call_id": f"call-{index}", "content": words(rng, tool_tokens)}
                ],
                tools=TOOLS,
                prompt_tail=added,
                assistant_message=parsed.message,
            )
        )
        assert not reply.forked and not reply.needs_history
        added, synthetic = reply.appended_ids, reply.synthetic_ids
    return out


def ray_bytes(value: Any) -> int:
    return global_worker.get_serialization_context().serialize(value).total_bytes


def measure(turns: list[Turn]) -> dict[str, float]:
    result = Result(request_id="req-bench", lease_id="lease-bench", kind="ok", reward=1.0, turns=turns)
    (sample,) = trainer_samples(result)
    assert sample.token_ids == turn_prompts(result)[-1] + turns[-1].completion_ids
    ids = sample.token_ids
    logprobs = [x for t in turns for x in t.logprobs]
    unique = [ids, logprobs]
    old = {
        "turns": [
            {**t.model_dump(exclude={"new_prompt_ids"}), "prompt_ids": prompt}
            for t, prompt in zip(turns, turn_prompts(result), strict=True)
        ]
    }
    return {
        "tokens": unique_tokens(turns),
        "json": len(result.model_dump_json()),
        "json_unique": len(json.dumps(unique, separators=(",", ":"))),
        "json_old": len(json.dumps(old, separators=(",", ":"))),
        "ray": ray_bytes(result.model_dump_json()),  # a worker answers the result's JSON
        "ray_unique": ray_bytes(unique),
        "ray_old": ray_bytes(old),
    }


WAITS = RolloutTimings(
    submitted_at=1764590000.123,
    lane_s=0.0123,
    worker_s=0.0002,
    dispatch_s=0.0031,
    env_open_s=0.0412,
    renderer_s=0.0009,
    teardown_s=0.0021,
)
BARE = {"timings": True, "turns": {"__all__": {"timings"}}}
CPU_REPEATS = 200


def _without_timings(model: type[BaseModel], **swap: Any) -> type[BaseModel]:
    """`model` as it was before issue 29: the same fields but `timings` (and `swap`ped ones)."""
    fields = {n: (f.annotation, f) for n, f in model.model_fields.items() if n != "timings"}
    return create_model(f"Bare{model.__name__}", __config__=EXACT_JSON, **(fields | swap))


BareTurn = _without_timings(Turn)
BareResult = _without_timings(Result, turns=(list[BareTurn], []))


def timings_cost(turns: list[Turn]) -> tuple[float, float, float]:
    """(JSON bytes the timings add per turn, CPU µs per turn for a result's trip with them, without)."""
    timed = Result(request_id="req-bench", lease_id="lease-bench", kind="ok", turns=turns, timings=WAITS)
    bare = BareResult.model_validate_json(timed.model_dump_json(exclude=BARE))
    added = (len(timed.model_dump_json()) - len(bare.model_dump_json())) / len(turns)

    def trip(result: BaseModel) -> float:
        started = time.process_time()
        for _ in range(CPU_REPEATS):
            type(result).model_validate_json(result.model_dump_json())
        return (time.process_time() - started) / CPU_REPEATS / len(turns) * 1e6

    cpu = {"timed": [], "bare": []}
    for _ in range(5):  # interleaved, best of five: the machine is shared
        cpu["timed"].append(trip(timed))
        cpu["bare"].append(trip(bare))
    return added, min(cpu["timed"]), min(cpu["bare"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=64)
    parser.add_argument("--tool-tokens", type=int, default=1500)
    parser.add_argument("--completion-tokens", type=int, default=80)
    args = parser.parse_args()
    turns = build_turns(args.turns, args.tool_tokens, args.completion_tokens)
    rows = []
    for at in sorted({t for t in REPORT_AT if t <= args.turns} | {args.turns}):
        m = measure(turns[:at])
        rows.append((at, m))
    header = (
        f"{'turns':>5} {'tokens':>8} | {'json':>10} {'/unique':>7} {'B/token':>7} {'old/new':>7} | "
        f"{'ray':>10} {'/unique':>7} {'B/token':>7} {'old/new':>7}"
    )
    print(header)
    print("-" * len(header))
    for at, m in rows:
        print(
            f"{at:>5} {m['tokens']:>8.0f} | {m['json']:>10.0f} {m['json'] / m['json_unique']:>7.3f} "
            f"{m['json'] / m['tokens']:>7.2f} {m['json_old'] / m['json']:>7.1f} | "
            f"{m['ray']:>10.0f} {m['ray'] / m['ray_unique']:>7.3f} {m['ray'] / m['tokens']:>7.2f} "
            f"{m['ray_old'] / m['ray']:>7.1f}"
        )
    for at in (1, 16, args.turns):
        added, timed, bare = timings_cost(turns[:at])
        print(
            f"timings at {at} turns: +{added:.0f} B/turn of JSON; result dump + validate per turn "
            f"{timed:.1f} µs with them, {bare:.1f} µs without ({timed / bare - 1:+.1%})"
        )
    at, m = rows[-1]
    print(
        f"result / unique tokens+logprobs at {at} turns: json {m['json'] / m['json_unique']:.3f}, "
        f"ray {m['ray'] / m['ray_unique']:.3f}"
    )
    print(f"result bytes per token at {at} turns: {m['json'] / m['tokens']:.2f}")


if __name__ == "__main__":
    main()
