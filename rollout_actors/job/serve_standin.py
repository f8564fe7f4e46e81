"""`rollouts serve-standin [--port N]`: the bundled CPU stand-in inference server on its own, until Ctrl-C.

    rollouts serve-standin --port 8000
    # stand-in inference server: base URL http://127.0.0.1:8000/v1, model <the bundled model>
    rollouts run --base-url http://127.0.0.1:8000/v1 --model <the bundled model>

The same server `rollouts run` starts when given no endpoint (`run_batch.standin_server`), with the same
settings flags; it prints the base URL and the model name a client or a run names, then serves. It exits
with the server: 0 on Ctrl-C, 1 when the server fails to start or dies (with its log's tail).
"""

from __future__ import annotations

import argparse
import sys
import time

from rollout_actors.job.run_config import StandinSettings

POLL_S = 0.5  # how often the foreground checks the server is still alive


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = StandinSettings()
    parser.add_argument("--port", type=int, default=0, metavar="N", help="port to listen on [0: a free one]")
    parser.add_argument("--host", default="127.0.0.1", metavar="HOST", help="address to bind [127.0.0.1]")
    parser.add_argument(
        "--latency",
        type=float,
        default=defaults.latency_s,
        metavar="SECONDS",
        help="fixed latency per call [%(default)s]",
    )
    parser.add_argument(
        "--per-token-latency",
        type=float,
        default=defaults.per_token_latency_s,
        metavar="SECONDS",
        help="latency per sampled token [%(default)s]",
    )
    parser.add_argument(
        "--correct-rate",
        type=float,
        default=defaults.correct_rate,
        metavar="P",
        help="how often the bundled policy answers the bundled environments right [%(default)s]",
    )
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed [%(default)s]")


def serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from renderer_actors.tokenizer import BUNDLED_MODEL
    from rollout_actors.inference.standin import StandinStartupError
    from rollout_actors.job.run_batch import standin_server

    try:
        settings = StandinSettings(
            latency_s=args.latency, per_token_latency_s=args.per_token_latency, correct_rate=args.correct_rate
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        flag = {"latency_s": "--latency", "per_token_latency_s": "--per-token-latency"}.get(
            str(error["loc"][0]), "--correct-rate"
        )
        print(f"rollouts serve-standin: {flag}: {error['msg']}", file=sys.stderr)
        return 2
    server = standin_server(settings, args.seed, host=args.host, port=args.port)
    print("starting the stand-in inference server (loading its tokenizer) ...", file=sys.stderr, flush=True)
    try:
        server.start()
    except StandinStartupError as exc:
        print(f"rollouts serve-standin: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"stand-in inference server: base URL {server.base_url}, model {BUNDLED_MODEL}", flush=True)
        print(f"  rollouts run --base-url {server.base_url} --model {BUNDLED_MODEL}", flush=True)
        print("serving until Ctrl-C", file=sys.stderr, flush=True)
        while server.exit_code() is None:
            time.sleep(POLL_S)
        print(
            f"rollouts serve-standin: the server exited ({server.exit_code()}):\n{server.log_tail()}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.close()
