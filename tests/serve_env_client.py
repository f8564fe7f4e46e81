"""verifiers 0.4's own side of the serve-env tests, run in the verifiers-0.4 stack's interpreter.

    python serve_env_client.py client < case.json      # EnvClient runs against an address; JSON out
    python serve_env_client.py server ADDRESS < config.json   # verifiers' own serve_env, until killed

`client`: `{"address", "taskset": TasksetConfig dict, "client": ClientConfig dict, "model", "sampling",
"runs": [{"index": i, "cancel": bool}]}`. All runs go at once through one `EnvClient` (the client prime-rl's
orchestrator uses); each prints as `{"episode": WireEpisode dumped | None, "error": str | None, "deltas": n,
"seconds": from the run's send to its end}`.
A run marked `cancel` is cancelled by its caller once its first delta arrives (its `cancel_at_delta`-th,
when it names one), as an orchestrator abandons a rollout; its outcome then also carries the raw `reply`
the server sent the run afterwards (a second
DEALER listens for nothing: the reply is read off the client's own socket by wrapping its receive).

`server`: `serve_env(max_workers, address, config_data)`: a lone `EnvServer` (`max_workers` 1) or the
elastic `EnvServerPool`, exactly as `vf-eval`/prime-rl spawn it.
"""

import asyncio
import json
import sys
import time

import msgpack


async def client(case: dict) -> list[dict]:
    from verifiers.v1.serve.client import EnvClient
    from verifiers.v1.utils.loaders import load_taskset, taskset_config_type

    taskset_config = taskset_config_type(case["taskset"]["id"]).model_validate(case["taskset"])
    tasks = list(load_taskset(taskset_config))
    env = EnvClient(case["address"])
    if case.get("wait_for_startup", True):
        await env.wait_for_server_startup(timeout=case.get("startup_timeout", 300))
    replies: dict[str, dict] = {}
    receive = env.socket.recv_multipart

    async def recording_receive(*args, **kwargs):  # what the server replied to runs the client gave up on
        frames = await receive(*args, **kwargs)
        if len(frames) == 3 and frames[1] == b"reply" and frames[0].decode() not in env._pending:
            replies[frames[0].decode()] = msgpack.unpackb(frames[2], raw=False)
        return frames

    env.socket.recv_multipart = recording_receive

    async def one(run: dict) -> dict:
        return dict(await outcome(run), seconds=round(time.monotonic() - started, 2))

    async def outcome(run: dict) -> dict:
        deltas = 0
        first = asyncio.Event()  # the delta the run is cancelled at has arrived
        cancel_at = run.get("cancel_at_delta", 1)

        def on_delta(_delta: dict) -> None:
            nonlocal deltas
            deltas += 1
            if deltas >= cancel_at:
                first.set()

        task = tasks[run["index"]]
        running = asyncio.ensure_future(
            env.run(
                case["client"], case["model"], case["sampling"], task.data.model_dump(mode="json"), on_delta
            )
        )
        if run.get("cancel"):
            await asyncio.wait(
                {running, asyncio.ensure_future(first.wait())}, return_when=asyncio.FIRST_COMPLETED
            )
            known = set(env._pending)
            running.cancel()
            try:
                await running
            except asyncio.CancelledError:
                pass
            await asyncio.sleep(case.get("cancel_settle_s", 5.0))
            after = [replies[rid] for rid in known if rid in replies]
            return {"episode": None, "error": "cancelled", "deltas": deltas, "replies": after}
        try:
            episode = await running
        except Exception as exc:
            return {"episode": None, "error": f"{type(exc).__name__}: {exc}", "deltas": deltas}
        return {"episode": episode.model_dump(mode="json"), "error": None, "deltas": deltas}

    started = time.monotonic()
    try:
        return list(await asyncio.gather(*(one(run) for run in case["runs"])))
    finally:
        await env.close()


def server(address: str, config: dict, max_workers: int) -> None:
    from verifiers.v1.serve.pool import serve_env

    serve_env(max_workers=max_workers, address=address, config_data=config)


if __name__ == "__main__":
    if sys.argv[1] == "client":
        json.dump(asyncio.run(client(json.load(sys.stdin))), sys.stdout)
    else:
        server(sys.argv[2], json.load(sys.stdin), int(sys.argv[3]) if len(sys.argv) > 3 else 1)
