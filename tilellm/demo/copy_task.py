"""A copy-heavy task: rewrite a record with one field updated, checked by a program.

A prompt is a fixed instruction, a change `set key=value` and a record of `key=value` fields
separated by `;`; the answer is the record again with that one field's value replaced, then the
end-of-text token::

    "Rewrite the record with the change.\\n"
    "set city=oslo\\n"
    "name=alice;age=31;city=paris;color=blue;job=cook\\n"
        ->  "name=alice;age=31;city=oslo;color=blue;job=cook"

Answers are long (MIN_LEN..MAX_LEN characters) and, but for the new value, an exact copy of the
prompt's record: the kind of output that speculative decoding by prompt lookup (n-gram drafts taken
from the prompt) accepts most of.

Keys come from a fixed list, each at most once per record, in random order; values are random
lowercase words or numbers, generated here (nothing is downloaded). The updated key is always one of
the record's, and its new value differs from the old one.

The problem space is split once and for all by a hash of the problem (record, key, new value): training
never sees a held-out problem, and accuracy (in `tools/train_copy_model.py`) is measured on held-out
problems only.
"""

from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass

PREFIX = "Rewrite the record with the change.\n"
# Field names, 2-5 characters, none a prefix or suffix of another (so "key=" finds one field) and no two
# ending in the same two characters.
KEYS = (
    "name",
    "age",
    "city",
    "color",
    "job",
    "pet",
    "food",
    "team",
    "car",
    "sport",
    "zip",
    "level",
    "score",
    "tag",
    "lang",
    "size",
    "mode",
    "band",
    "book",
    "gift",
    "plan",
    "rank",
    "role",
    "id",
)
MIN_FIELDS, MAX_FIELDS = 5, 12
# Characters of the record and of the answer (without EOS), both at least MIN_LEN and at most MAX_LEN.
MIN_LEN, MAX_LEN = 60, 120
WORD_LEN = (3, 8)  # letters of a word value
NUMBER_DIGITS = (1, 4)  # digits of a number value (no leading zero)
NUMBER_P = 0.3  # share of number values
HELD_OUT_MODULUS = 101  # about 1% of all problems are held out
EOS = "<|endoftext|>"  # the tokenizer's end-of-text token: it closes the answer
# The longest prompt + answer + EOS: the instruction, "set " + longest key + "=" + longest value + "\n",
# the record and "\n", the answer and EOS. The model's positions (max_position_embeddings) must cover it.
MAX_TOKENS = (
    len(PREFIX)
    + len("set ")
    + max(map(len, KEYS))
    + 1
    + max(WORD_LEN[1], NUMBER_DIGITS[1])
    + 1
    + (MAX_LEN + 1)
    + (MAX_LEN + 1)
)


@dataclass(frozen=True)
class RecordEdit:
    """A record (`fields`, in order) and the change `key=value` to apply to it."""

    fields: tuple[tuple[str, str], ...]
    key: str
    value: str
    prefix: str = PREFIX  # the instruction the model was trained with (its tilellm_demo.json has it)

    @property
    def record(self) -> str:
        return ";".join(f"{k}={v}" for k, v in self.fields)

    @property
    def change(self) -> str:
        return f"set {self.key}={self.value}"

    @property
    def old_value(self) -> str:
        return dict(self.fields)[self.key]

    @property
    def question(self) -> str:
        """The user's part of the prompt (what a chat message carries): the change, then the record."""
        return f"{self.change}\n{self.record}"

    @property
    def prompt(self) -> str:
        return f"{self.prefix}{self.question}\n"

    @property
    def answer(self) -> str:
        return ";".join(f"{k}={self.value if k == self.key else v}" for k, v in self.fields)

    def is_correct(self, completion: str) -> bool:
        """Exact match of the completion (surrounding whitespace ignored) with the updated record."""
        return completion.strip() == self.answer


def is_held_out(p: RecordEdit) -> bool:
    """Fixed train/held-out split: a hash of the record and the change, independent of any seed and of
    the instruction (Python's own `hash` of a string changes from run to run; blake2b does not)."""
    digest = hashlib.blake2b(f"{p.record}\n{p.change}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % HELD_OUT_MODULUS == 0


def _value(rng: random.Random) -> str:
    if rng.random() < NUMBER_P:
        digits = rng.randint(*NUMBER_DIGITS)
        return str(rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1))
    return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(*WORD_LEN)))


def _sample(rng: random.Random, prefix: str) -> RecordEdit:
    while True:
        keys = rng.sample(KEYS, rng.randint(MIN_FIELDS, MAX_FIELDS))
        fields = tuple((k, _value(rng)) for k in keys)
        key = rng.choice(keys)
        old = dict(fields)[key]
        value = _value(rng)
        while value == old:
            value = _value(rng)
        p = RecordEdit(fields, key, value, prefix)
        if MIN_LEN <= len(p.record) <= MAX_LEN and MIN_LEN <= len(p.answer) <= MAX_LEN:
            return p


def sample_problem(rng: random.Random, *, held_out: bool = False, prefix: str = PREFIX) -> RecordEdit:
    """One problem from the training split (`held_out=False`) or the held-out split."""
    while True:
        p = _sample(rng, prefix)
        if is_held_out(p) == held_out:
            return p


def held_out_problems(n: int, seed: int = 1234, *, prefix: str = PREFIX) -> list[RecordEdit]:
    """`n` distinct held-out problems, the same for a given seed on every machine."""
    rng = random.Random(seed)
    seen: set[RecordEdit] = set()
    out: list[RecordEdit] = []
    while len(out) < n:
        p = sample_problem(rng, held_out=True, prefix=prefix)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def problems_for_model(meta: dict, n: int, seed: int) -> list[RecordEdit]:
    """`n` held-out problems in the form a trained model expects (its `tilellm_demo.json`)."""
    return held_out_problems(n, seed, prefix=meta["prefix"])
