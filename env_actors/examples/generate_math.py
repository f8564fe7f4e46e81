"""Generate `data/math_problems.jsonl`, the task set of `MathEnv`, deterministically from a seed.

    python -m env_actors.examples.generate_math            # rewrites the bundled file
    python -m env_actors.examples.generate_math --check    # exits 1 if the bundled file is stale

The phrasing is a contract: the stand-in server's scripted policy parses it. A problem is a start quantity
("Ava has 12 marbles."), then one to three operations, one sentence each, with these verbs only:

    plus:  "buys N more", "finds N more", "receives N more"
    minus: "gives away N", "sells N", "loses N"
    times: "multiplies them by N"

then "How many marbles does Ava have now?". Every intermediate and final quantity is a non-negative integer.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

DATA_PATH = Path(__file__).parent / "data" / "math_problems.jsonl"
SEED = 20240611
NUM_PROBLEMS = 300
MAX_QUANTITY = 500
"""Keeps products small enough that a tiny policy (and a reader) can check them by hand."""

NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena")
OBJECTS = ("marbles", "apples", "stickers", "books", "coins", "pencils", "shells", "cards")
PLUS_VERBS = ("buys {n} more", "finds {n} more", "receives {n} more")
MINUS_VERBS = ("gives away {n}", "sells {n}", "loses {n}")
TIMES_VERB = "multiplies them by {n}"


def make_problem(rng: random.Random, index: int) -> dict:
    name, noun = rng.choice(NAMES), rng.choice(OBJECTS)
    quantity = rng.randint(2, 30)
    sentences = [f"{name} has {quantity} {noun}."]
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(("plus", "minus", "times"))
        if kind == "minus" and quantity == 0:
            kind = "plus"
        if kind == "times" and quantity * 2 > MAX_QUANTITY:
            kind = "minus"
        if kind == "plus":
            n = rng.randint(1, 20)
            quantity += n
            verb = rng.choice(PLUS_VERBS)
        elif kind == "minus":
            n = rng.randint(1, quantity)
            quantity -= n
            verb = rng.choice(MINUS_VERBS)
        else:
            n = rng.randint(2, min(4, MAX_QUANTITY // max(quantity, 1)))
            quantity *= n
            verb = TIMES_VERB
        sentences.append(f"{name} {verb.format(n=n)}.")
    sentences.append(f"How many {noun} does {name} have now?")
    return {"id": f"math-{index:04d}", "question": " ".join(sentences), "answer": quantity}


def generate(seed: int = SEED, count: int = NUM_PROBLEMS) -> list[dict]:
    rng = random.Random(seed)
    return [make_problem(rng, i) for i in range(count)]


def render(problems: list[dict]) -> str:
    return "".join(json.dumps(p, sort_keys=True) + "\n" for p in problems)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the bundled file differs")
    args = parser.parse_args(argv)
    text = render(generate())
    if args.check:
        current = DATA_PATH.read_text() if DATA_PATH.exists() else ""
        if current != text:
            print(f"{DATA_PATH} is stale; rerun without --check", file=sys.stderr)
            return 1
        return 0
    DATA_PATH.parent.mkdir(parents=True, exist_ok=True)
    DATA_PATH.write_text(text)
    print(f"wrote {NUM_PROBLEMS} problems to {DATA_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
