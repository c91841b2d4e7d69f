"""The second quick start's task (`python quickstart.py --task arithmetic`): sums a small chat model partly gets right,
made here, and the reward that checks each answer against the one the dataset holds.

    {"text": "What is 7 + 12? Answer with just the number.", "answer": 19}

`write_problems` writes every sum of two numbers in 0..MAX_TERM once, in a seeded order, as JSON lines: the query
text and its `answer` column. The policy script hands that column to the reward function, one value per response,
as TRL's reward functions get a dataset's columns (train_policy_accelerate.py --rewards.function
arithmetic_task:answer_reward; `answer` is a parameter it names). Importing this module has no side effects.
"""

import json
import random
import re
from pathlib import Path

MAX_TERM = 20
"""Both terms are in 0..MAX_TERM: 441 sums. SmolLM2-135M-Instruct answers about a quarter of them right, in one way
or another, at temperature 0.7 (docs/quickstart.md#the-arithmetic-quick-start)."""
PROMPT = "What is {a} + {b}? Answer with just the number."
NUMBER = re.compile(r"-?\d+")


def problems(seed: int = 0) -> list[dict]:
    """Every sum a + b with a, b in 0..MAX_TERM, once each, in a seeded order: {"text": ..., "answer": a + b}."""
    rows = [
        {"text": PROMPT.format(a=a, b=b), "answer": a + b} for a in range(MAX_TERM + 1) for b in range(MAX_TERM + 1)
    ]
    random.Random(seed).shuffle(rows)
    return rows


def write_problems(path: Path, seed: int = 0) -> Path:
    """problems(seed) as JSON lines at `path` (written whole, then renamed into place)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text("".join(json.dumps(row) + "\n" for row in problems(seed)), encoding="utf-8")
    temporary.replace(path)
    return path


def final_number(response: str):
    """The last integer the response writes, or None (the answer of "8 + 7 = 15." is 15)."""
    numbers = NUMBER.findall(response)
    return int(numbers[-1]) if numbers else None


def answer_reward(queries: list[str], responses: list[str], answer: list[int]) -> list[float]:
    """1 where the response's last number is the dataset's answer, else 0 (a response that never reaches its end of
    turn scores --task.penalty-reward-value instead: the policy script applies it). `answer`: the dataset's column,
    one value per response."""
    return [
        float(final_number(response) == int(expected)) for response, expected in zip(responses, answer, strict=True)
    ]
