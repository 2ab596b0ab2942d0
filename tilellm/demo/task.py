"""The embedded model's task: multi-digit addition, checked by a program.

A prompt is a fixed instruction (the shared prefix of every request) followed by `a+b=`;
the answer is the decimal sum and then the end-of-text token::

    "Calculate the sum of the two numbers.\\n1234+5678="  ->  "6912"

A conversation of several turns states the instruction once; each earlier turn is its problem, its
sum and the end-of-text token, and the model answers the last problem::

    "Calculate the sum of the two numbers.\\n1234+5678=6912<|endoftext|>4000+1111="  ->  "5111"

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
EOS = "<|endoftext|>"  # the tokenizer's end-of-text token: it closes every assistant turn
# Turns of a training conversation, at most: with 4-digit problems (15-16 tokens a turn after the
# 38-token instruction) five turns always fit the model's 128 positions, six only sometimes.
MAX_TURNS = 5


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


@dataclass(frozen=True)
class Conversation:
    """Several problems asked in turn; every earlier turn carries its correct sum."""

    turns: tuple[Problem, ...]

    @property
    def last(self) -> Problem:
        return self.turns[-1]

    @property
    def messages(self) -> list[dict[str, str]]:
        """Chat messages up to the last question (what `LLM.chat` takes)."""
        out: list[dict[str, str]] = []
        for p in self.turns[:-1]:
            out += [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.answer}]
        return out + [{"role": "user", "content": self.last.question}]

    @property
    def prompt(self) -> str:
        """The conversation as the model's chat template renders it, ending before the last answer."""
        earlier = "".join(f"{p.question}={p.answer}{EOS}" for p in self.turns[:-1])
        return f"{self.last.prefix}{earlier}{self.last.question}="

    @property
    def answer(self) -> str:
        return self.last.answer

    def is_correct(self, completion: str) -> bool:
        return self.last.is_correct(completion)


def sample_conversation(
    rng: random.Random,
    turns: int,
    *,
    held_out: bool,
    min_digits: int = MIN_DIGITS,
    max_digits: int = MAX_DIGITS,
    prefix: str = PREFIX,
) -> Conversation:
    """`turns` problems, all from the training split (`held_out=False`) or all held out."""
    kw = dict(held_out=held_out, min_digits=min_digits, max_digits=max_digits, prefix=prefix)
    return Conversation(tuple(sample_problem(rng, **kw) for _ in range(turns)))


def held_out_conversations(
    n: int,
    seed: int = 1234,
    *,
    min_turns: int = 2,
    max_turns: int = 4,
    min_digits: int = MIN_DIGITS,
    max_digits: int = MAX_DIGITS,
    prefix: str = PREFIX,
) -> list[Conversation]:
    """`n` conversations of `min_turns..max_turns` held-out problems, the same for a given seed."""
    if not 1 <= min_turns <= max_turns:
        raise ValueError(f"need 1 <= min_turns <= max_turns, got {min_turns} and {max_turns}")
    rng = random.Random(seed)
    kw = dict(held_out=True, min_digits=min_digits, max_digits=max_digits, prefix=prefix)
    return [sample_conversation(rng, rng.randint(min_turns, max_turns), **kw) for _ in range(n)]


def conversations_for_model(
    meta: dict, n: int, seed: int, min_turns: int = 2, max_turns: int = 4
) -> list[Conversation]:
    """`n` held-out conversations in the form a trained model expects (its `tilellm_demo.json`)."""
    return held_out_conversations(
        n,
        seed,
        min_turns=min_turns,
        max_turns=max_turns,
        min_digits=meta["min_digits"],
        max_digits=meta["max_digits"],
        prefix=meta["prefix"],
    )
