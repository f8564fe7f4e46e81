"""Chat mode against token mode on the same misbehaving server: seconds per case, side by side.

    python scripts/bench_bad_server.py              # ~20 s; no Ray, no GPU
    python scripts/bench_bad_server.py --budget 15 --read-timeout 4

A tiny local server misbehaves in one way per case; each case runs one model call in token mode
(`complete_tokens`) and one in chat mode (`complete_chat`), at the same time, with the same
`ClientConfig` (the rollout's own client and model-call code). Printed per case: seconds and attempts
(requests the server saw) per mode, the failure each mode was answered, and chat minus token. Timings are
reported, not asserted; a call that outlives its budget by more than `SLACK_S` prints OVER and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_actors.rollout.client import build_client  # noqa: E402
from rollout_actors.rollout.failures import classify  # noqa: E402
from rollout_actors.rollout.model_call import complete_chat, complete_tokens  # noqa: E402
from rollout_actors.wire import ClientConfig, SamplingConfig  # noqa: E402

DRIP_INTERVAL_S = 0.5  # one byte per half second: below any read timeout, so only the total deadline ends it
SLACK_S = 2.0  # scheduling noise; a call past budget + this has escaped its deadline
RATE_LIMITED = b'{"error":{"message":"slow down","type":"RateLimitError","param":null,"code":429}}'
CASES = {
    "drip body": "a 200 whose body arrives one byte per 0.5 s and never ends",
    "slow headers": "a status line, then one header line per 0.5 s, never ending the headers",
    "silent": "reads the request, never answers (each attempt ends at the read timeout)",
    "429, Retry-After past budget": "429 with Retry-After: 30, every attempt",
    "429, Retry-After 2 s": "429 with Retry-After: 2, every attempt",
}


class BadServer:
    """One server; the case is the request's `X-Bench-Case` header, attempts counted per `X-Bench-Tag`."""

    def __init__(self) -> None:
        self.attempts: Counter[str] = Counter()
        self.closing = asyncio.Event()
        """Set once every call is answered: each handler still misbehaving ends."""

    async def _pause(self, seconds: float) -> bool:
        """Wait `seconds`; False once the server is closing."""
        try:
            await asyncio.wait_for(self.closing.wait(), seconds)
            return False
        except TimeoutError:
            return True

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            headers = dict(
                (k.strip().lower(), v.strip())
                for k, _, v in (ln.partition(":") for ln in head.split("\r\n")[1:])
            )
            await reader.readexactly(int(headers.get("content-length", 0)))
            self.attempts[headers.get("x-bench-tag", "?")] += 1
            await self._misbehave(headers.get("x-bench-case", ""), writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _misbehave(self, case: str, writer: asyncio.StreamWriter) -> None:
        if case == "drip body":
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000000\r\n\r\n"
            )
            while await self._pause(DRIP_INTERVAL_S):
                writer.write(b" ")
                await writer.drain()
        elif case == "slow headers":
            writer.write(b"HTTP/1.1 200 OK\r\n")
            while await self._pause(DRIP_INTERVAL_S):
                writer.write(b"x-slow: 1\r\n")
                await writer.drain()
        elif case.startswith("429"):
            after = b"30" if "past budget" in case else b"2"
            writer.write(
                b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"retry-after: "
                + after
                + b"\r\ncontent-length: %d\r\n\r\n" % len(RATE_LIMITED)
                + RATE_LIMITED
            )
            await writer.drain()
        else:  # silent
            await self.closing.wait()


async def one_call(config: ClientConfig, mode: str) -> tuple[float, str]:
    client = build_client(config)
    sampling = SamplingConfig(max_tokens=8, seed=1)
    started = time.monotonic()
    try:
        if mode == "token":
            await complete_tokens(
                client, config.model, [1, 2, 3], sampling, timeout_s=config.total_call_timeout_s
            )
        else:
            messages = [{"role": "user", "content": "hi"}]
            await complete_chat(
                client, config.model, messages, None, sampling, timeout_s=config.total_call_timeout_s
            )
        return time.monotonic() - started, "ok"
    except Exception as exc:
        kind, failure = classify(exc)
        status = f" {failure.status_code}" if failure.status_code else ""
        return time.monotonic() - started, f"{kind}: {failure.type}{status}"
    finally:
        await client.close()


async def main(budget_s: float, read_timeout_s: float) -> int:
    bad = BadServer()
    server = await asyncio.start_server(bad.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    def config(case: str, mode: str) -> ClientConfig:
        return ClientConfig(
            base_url=f"http://127.0.0.1:{port}/v1",
            model="bench",
            read_timeout_s=read_timeout_s,
            connect_timeout_s=2.0,
            call_timeout_s=budget_s,
            headers={"X-Bench-Case": case, "X-Bench-Tag": f"{case}/{mode}"},
        )

    runs = {(case, mode): one_call(config(case, mode), mode) for case in CASES for mode in ("token", "chat")}
    async with server:
        outcomes = dict(zip(runs, await asyncio.gather(*runs.values()), strict=True))
        bad.closing.set()
    print(f"budget {budget_s:g} s per call, read timeout {read_timeout_s:g} s per attempt, max_retries 1")
    print(
        f"{'case':<30} {'token s':>8} {'chat s':>8} {'chat-token':>10} {'attempts t/c':>12}  answered (token | chat)"
    )
    over = False
    for case in CASES:
        (token_s, token_saw), (chat_s, chat_saw) = outcomes[(case, "token")], outcomes[(case, "chat")]
        attempts = f"{bad.attempts[f'{case}/token']}/{bad.attempts[f'{case}/chat']}"
        flag = "  OVER" if max(token_s, chat_s) > budget_s + SLACK_S else ""
        over |= bool(flag)
        print(
            f"{case:<30} {token_s:>8.2f} {chat_s:>8.2f} {chat_s - token_s:>+10.2f} {attempts:>12}  "
            f"{token_saw} | {chat_saw}{flag}"
        )
    token_total = sum(outcomes[(c, "token")][0] for c in CASES)
    chat_total = sum(outcomes[(c, "chat")][0] for c in CASES)
    print(f"{'all cases':<30} {token_total:>8.2f} {chat_total:>8.2f} {chat_total - token_total:>+10.2f}")
    return 1 if over else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=15.0, help="call_timeout_s of each call")
    parser.add_argument("--read-timeout", type=float, default=4.0, help="read_timeout_s per attempt")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.budget, args.read_timeout)))
