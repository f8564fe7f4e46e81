"""A subprocess agent for the agent-mode tests: the official `openai` client, from its own process.

Reads `{"messages", "tools", "max_turns", "behaviour", "pid_dir", "leak_file"}` on stdin; its endpoint
comes from the environment (`OPENAI_BASE_URL`, `OPENAI_API_KEY`, `OPENAI_MODEL`), as for any program
written against the SDK. Prints `{"final", "tool_calls", "turns"}` as its last line. Behaviours:

- `normal`: call, run the calculator, repeat until an answer without a tool call.
- `no_calls`: answer at once without calling the model.
- `never_calls`: print a line (with its key: the failure must show it redacted), then wait forever.
- `rewrite`: from the second call on, send a history whose system message is rewritten (a compaction).
- `leak`: write its base URL and key to `leak_file` first (a test then calls with them after the end).
"""

from __future__ import annotations

import json
import os
import sys
import time

import openai

from env_actors.examples.calculator_env import evaluate, format_value


def main() -> None:
    job = json.loads(sys.stdin.read())
    behaviour = job["behaviour"]
    if job["pid_dir"]:
        with open(os.path.join(job["pid_dir"], f"{os.getpid()}.pid"), "w") as file:
            file.write(str(os.getpid()))
    print(f"agent {os.getpid()} started ({behaviour})", flush=True)
    if behaviour == "no_calls":
        print(json.dumps({"final": "", "tool_calls": 0, "turns": 0}), flush=True)
        return
    if behaviour == "never_calls":
        print(f"agent waiting without calling, key={os.environ['OPENAI_API_KEY']}", flush=True)
        time.sleep(3600)
    if behaviour == "leak":
        with open(job["leak_file"], "w") as file:
            json.dump(
                {"base_url": os.environ["OPENAI_BASE_URL"], "api_key": os.environ["OPENAI_API_KEY"]}, file
            )
    client = openai.OpenAI(max_retries=0, timeout=120)
    messages, tools = job["messages"], job["tools"]
    final, tool_calls, turns = "", 0, 0
    for turn in range(job["max_turns"]):
        if behaviour == "rewrite" and turn == 1:
            messages = [{"role": "system", "content": "Summary so far: use the calculator."}, *messages[1:]]
        print(f"calling the model (turn {turn})", flush=True)
        reply = client.chat.completions.create(
            model=os.environ["OPENAI_MODEL"], messages=messages, tools=tools
        )
        turns += 1
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            final = message.content or ""
            break
        for call in message.tool_calls:
            try:
                content = format_value(evaluate(json.loads(call.function.arguments)["expression"]))
                tool_calls += 1
            except Exception as exc:  # the model's bad call is the tool's answer, as in the token-mode env
                content = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    print(json.dumps({"final": final, "tool_calls": tool_calls, "turns": turns}), flush=True)


if __name__ == "__main__":
    main()
