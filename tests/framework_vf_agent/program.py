"""The agent program `framework_vf_agent` launches: the chat loop against an interception endpoint.

    python -m framework_vf_agent.program --base-url URL --api-key SECRET --model M --messages JSON
        [--mcp-config JSON]

Exits 0 after a reply without tool calls, 1 when the endpoint refuses a call (the rollout stopped);
what it did is on the rollout's trace, where the interception recorded each call.
"""

import argparse
import asyncio
import json
import sys

from framework_vf_chat import chat


def main() -> int:
    parser = argparse.ArgumentParser()
    for flag in ("--base-url", "--api-key", "--model", "--messages"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--mcp-config", default="{}")
    args = parser.parse_args()
    messages, mcp = json.loads(args.messages), json.loads(args.mcp_config)
    result = asyncio.run(chat(args.base_url, args.api_key, args.model, messages, mcp))
    sys.stderr.write(result.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
