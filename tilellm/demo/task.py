"""The embedded model's task: multi-digit addition, checked by a program.

A prompt is a fixed instruction (the shared prefix of every request) followed by `a+b=`;
the answer is the decimal sum and then the end-of-text token::

    "Calculate the sum of the two numbers.\\n1234+5678="  ->  "6912"

The problem space is split once and for all by a hash of `(a, b)`: training never sees a
held-out problem, and accuracy (in `tools/train_tiny_model.py` and `tilellm demo`) is measured
on held-out problems only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Both operands of a problem have the same number of digits, MIN_DIGITS..MAX_DIGITS (the trainer's
# defaults; a trained model's own range and prefix are recorded in its tilellm_demo.json).
MIN_DIGITS = 4
MAX_DIGITS = 4
# 38 characters (one token each): two full KV blocks of 16 tokens shared by every request through the
# prefix cache. With a 4-digit problem ("1234+5678=") a prompt fills exactly 3 blocks, so the first
# generated token needs a new block: a small pool then makes the scheduler preempt.
PREFIX = "Calculate the sum of the two numbers.\n"
HELD_OUT_MODULUS = 101  # about 1% of all problems are held out


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    prefix: str = PREFIX  # the instruction the model was trained with (its tilellm_demo.json has it)

    @property
    def question(self) -> str:
        """The user's part of the prompt (what a chat message carries)."""
        return f"{self.a}+{self.b}"

    @property
    def prompt(self) -> str:
        return f"{self.prefix}{self.question}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    def is_correct(self, completion: str) -> bool:
        """Exact match of the completion (surrounding whitespace ignored) with the sum."""
        return completion.strip() == self.answer


def problems_for_model(meta: dict, n: int, seed: int) -> list[Problem]:
    """`n` held-out problems in the form a trained model expects (its `tilellm_demo.json`)."""
    return held_out_problems(
        n, seed, min_digits=meta["min_digits"], max_digits=meta["max_digits"], prefix=meta["prefix"]
    )


def is_held_out(a: int, b: int) -> bool:
    """Fixed train/held-out split: a hash of the pair, independent of any seed."""
    return (a * 1_000_003 + b * 7_919 + 17) % HELD_OUT_MODULUS == 0


def _operand(rng: random.Random, digits: int) -> int:
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def sample_problem(
    rng: random.Random,
    *,
    held_out: bool,
    min_digits: int = MIN_DIGITS,
    max_digits: int = MAX_DIGITS,
    prefix: str = PREFIX,
) -> Problem:
    """One problem from the training split (`held_out=False`) or the held-out split."""
    while True:
        digits = rng.randint(min_digits, max_digits)
        a, b = _operand(rng, digits), _operand(rng, digits)
        if is_held_out(a, b) == held_out:
            return Problem(a, b, prefix)


def held_out_problems(
    n: int,
    seed: int = 1234,
    *,
    min_digits: int = MIN_DIGITS,
    max_digits: int = MAX_DIGITS,
    prefix: str = PREFIX,
) -> list[Problem]:
    """`n` distinct held-out problems, the same for a given seed on every machine."""
    rng = random.Random(seed)
    seen: set[Problem] = set()
    out: list[Problem] = []
    while len(out) < n:
        p = sample_problem(rng, held_out=True, min_digits=min_digits, max_digits=max_digits, prefix=prefix)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out
