#!/usr/bin/env python
"""Train tiny-copy: a tiny Qwen3 that rewrites a record with one field updated.

The task and its train/held-out split live in `tilellm.demo.copy_task`; its answers are long and, but
for one value, copies of the prompt, so speculative decoding by prompt lookup accepts most drafts. The
data are generated on the fly (nothing is downloaded). The tokenizer, learning-rate schedule and
config spelling are those of `tools/train_tiny_model.py` (same character-level vocabulary, same ids).
The script writes a Hugging Face directory (config.json, model.safetensors in bf16, tokenizer.json +
tokenizer_config.json with a chat template, generation_config.json, tilellm_demo.json, README.md),
measures greedy exact-match accuracy on held-out problems with the saved 16-bit weights, and exits 1,
leaving --out untouched, below --min-accuracy.

    python tools/train_copy_model.py --device cuda --steps 8000 --batch-size 512 --lr 0.003 --warmup 300 \\
        --layers 4 --seed 0 --threads 1 --workers 8 --eval-size 1000 --min-accuracy 0.99  # 377 s on an H200
    python tools/train_copy_model.py --device cpu --steps 40 --batch-size 8 --eval-size 16 \\
        --out /tmp/tiny-copy  # a smoke test of the script (under a minute)
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import queue
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
for p in (str(REPO), str(TOOLS)):
    if p not in sys.path:
        sys.path.insert(0, p)

from train_tiny_model import (  # noqa: E402
    EOS,
    PAD,
    UNK,
    build_tokenizer,
    lr_at,
    save_candidate,
)
from train_tiny_model import save_tokenizer as save_arith_tokenizer  # noqa: E402

from tilellm.demo.copy_task import (  # noqa: E402
    KEYS,
    MAX_LEN,
    MAX_TOKENS,
    MIN_LEN,
    PREFIX,
    RecordEdit,
    held_out_problems,
    sample_problem,
)

MAX_POSITIONS = 320  # covers MAX_TOKENS (prompt + answer + EOS), 20 KV blocks of 16
assert MAX_TOKENS <= MAX_POSITIONS
VOCAB_SIZE = 128  # the tokenizer has 99 entries (3 special + 96 characters); round up

# The instruction once, then the user's message ("set key=value\n" + record) and a newline; an
# assistant turn is the updated record and EOS. A one-message conversation is exactly
# `RecordEdit.prompt`. System messages are dropped: the model knows no other instruction.
CHAT_TEMPLATE = (
    PREFIX + "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)


def model_config(vocab_size: int, layers: int):
    """tiny-arith's shape (hidden 128, 4 query / 2 KV heads of 64, MLP 384) with `layers` layers and
    MAX_POSITIONS positions."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA 2:1
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        hidden_act="silu",
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
    )


def save_tokenizer(tok, out: Path) -> None:
    """The trainer's tokenizer files, with this task's chat template and context length."""
    save_arith_tokenizer(tok, out, MAX_POSITIONS, CHAT_TEMPLATE)


# --- data ----------------------------------------------------------------------------------------


def char_table(tok) -> np.ndarray:
    """Byte -> token id for the tokenizer's single-character tokens (the tokenizer's own encode, per
    character, without its per-call overhead); other bytes map to <unk>."""
    table = np.full(256, tok.token_to_id(UNK), dtype=np.int64)
    for piece, i in tok.get_vocab().items():
        if len(piece) == 1 and ord(piece) < 128:
            table[ord(piece)] = i
    return table


def encode(table: np.ndarray, text: str) -> np.ndarray:
    return table[np.frombuffer(text.encode("ascii"), dtype=np.uint8)]


def make_batch(
    table: np.ndarray, rng: random.Random, batch_size: int, eos_id: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded [B, L] token ids of prompt + answer + EOS for training problems, and labels: the
    answer and EOS carry loss, -100 elsewhere."""
    problems = [sample_problem(rng, held_out=False) for _ in range(batch_size)]
    prompts = [encode(table, p.prompt) for p in problems]
    answers = [encode(table, p.answer) for p in problems]
    width = max(len(a) + len(b) for a, b in zip(prompts, answers)) + 1
    x = np.full((batch_size, width), pad_id, dtype=np.int64)
    y = np.full((batch_size, width), -100, dtype=np.int64)
    for i, (a, b) in enumerate(zip(prompts, answers)):
        n, m = len(a), len(b)
        x[i, :n], x[i, n : n + m], x[i, n + m] = a, b, eos_id
        y[i, n : n + m], y[i, n + m] = b, eos_id
    return x, y


def batch_for_step(
    step: int, table: np.ndarray, seed: int, batch_size: int, eos_id: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Step `step`'s batch: its own generator, so the data are the same with or without workers."""
    return make_batch(table, random.Random(seed * 1_000_003 + step), batch_size, eos_id, pad_id)


def _fill(out, steps: range, args: tuple) -> None:
    for step in steps:
        out.put((step, batch_for_step(step, *args)))


class Batches:
    """The batches of steps 0, 1, ... in order (`batch_for_step(step, *args)`), built a few steps ahead
    of training in `workers` processes (forked before any CUDA work; worker i builds steps i, i +
    workers, ...); in this process when `workers` is 0."""

    def __init__(self, workers: int, steps: int, args: tuple):
        self.args = args
        ctx = multiprocessing.get_context("fork")
        self.queues = [ctx.Queue(maxsize=2) for _ in range(workers)]
        self.procs = [
            ctx.Process(target=_fill, args=(q, range(i, steps, workers), args), daemon=True)
            for i, q in enumerate(self.queues)
        ]
        for proc in self.procs:
            proc.start()

    def get(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        if not self.procs:
            return batch_for_step(step, *self.args)
        i = step % len(self.procs)
        while True:
            try:
                built, batch = self.queues[i].get(timeout=10)
                break
            except queue.Empty:
                if not self.procs[i].is_alive():
                    raise RuntimeError(f"batch worker {i} exited ({self.procs[i].exitcode})") from None
        assert built == step, f"batches are taken in order: asked for step {step}, got {built}"
        return batch

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.join()


# --- evaluation ----------------------------------------------------------------------------------


@torch.no_grad()
def greedy_completions(
    model, table: np.ndarray, tok, prompts: list[str], eos_id: int, pad_id: int, device: str, chunk: int
) -> list[str]:
    """Greedy completions up to EOS (at most MAX_LEN + 2 tokens), `chunk` left-padded prompts at a time
    (transformers' `generate` masks the padding and counts positions from each prompt's first token)."""
    model.eval()
    out: list[str] = []
    for start in range(0, len(prompts), chunk):
        ids = [encode(table, p) for p in prompts[start : start + chunk]]
        width = max(map(len, ids))
        x = torch.full((len(ids), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, r in enumerate(ids):
            x[i, width - len(r) :] = torch.from_numpy(r)
            mask[i, width - len(r) :] = 1
        gen = model.generate(
            input_ids=x.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=MAX_LEN + 2,
            do_sample=False,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )[:, width:].tolist()
        for g in gen:
            out.append(tok.decode(g[: g.index(eos_id)] if eos_id in g else g))
    model.train()
    return out


def greedy_accuracy(model, table, tok, problems: list[RecordEdit], eos_id, pad_id, device, chunk=256):
    """Greedy exact match of the whole answer, and the misses as (prompt, completion, answer)."""
    got = greedy_completions(model, table, tok, [p.prompt for p in problems], eos_id, pad_id, device, chunk)
    wrong = [(p.prompt, g, p.answer) for p, g in zip(problems, got) if not p.is_correct(g)]
    return 1 - len(wrong) / len(problems), wrong


# --- training ------------------------------------------------------------------------------------


def train(args: argparse.Namespace) -> int:
    from transformers import Qwen3ForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = args.device
    tok = build_tokenizer()
    table = char_table(tok)
    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id(PAD)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    # Forked before the model touches the device.
    batches = Batches(args.workers, args.steps, (table, args.seed, args.batch_size, eos_id, pad_id))

    model = Qwen3ForCausalLM(model_config(VOCAB_SIZE, args.layers)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"params: {n_params:,}  layers: {args.layers}  device: {device}  threads: {torch.get_num_threads()}"
        f"  workers: {args.workers}",
        flush=True,
    )
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
        fused=device == "cuda",
    )
    eval_set = held_out_problems(args.eval_size, seed=args.seed + 1)
    chunk = 1024 if device == "cuda" else 64
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    start = time.time()
    loss_sum, loss_n, loss_avg = torch.zeros((), device=device), 0, None
    try:
        for step in range(args.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
            # From pinned memory the copy is asynchronous: a pageable one would wait for the device.
            x, y = (
                (torch.from_numpy(a).pin_memory() if device == "cuda" else torch.from_numpy(a)).to(
                    device, non_blocking=True
                )
                for a in batches.get(step)
            )
            with amp:
                logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1), ignore_index=-100
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            # No per-step .item(): the device runs ahead while the next batch is built.
            loss_sum += loss.detach()
            loss_n += 1
            if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
                loss_avg, loss_sum, loss_n = loss_sum.item() / loss_n, loss_sum.zero_(), 0
                elapsed = time.time() - start
                eta = elapsed / (step + 1) * (args.steps - step - 1)
                print(
                    f"step {step + 1:6d}/{args.steps}  loss {loss_avg:.4f}  "
                    f"lr {opt.param_groups[0]['lr']:.2e}  {elapsed:6.1f}s  eta {eta:5.0f}s",
                    flush=True,
                )
            if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
                acc, _ = greedy_accuracy(model, table, tok, eval_set[:200], eos_id, pad_id, device, chunk)
                print(f"  held-out exact match (200 problems): {acc:.3f}", flush=True)
    finally:
        batches.close()
    train_s = time.time() - start

    # Save in 16-bit, then measure the accuracy of exactly what was saved.
    final = Path(args.out)
    out = save_candidate(model, tok, final, eos_id, pad_id, save_tokenizer)

    reloaded = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).to(device)
    eval_start = time.time()
    acc, wrong = greedy_accuracy(reloaded, table, tok, eval_set, eos_id, pad_id, device, chunk)
    print(
        f"held-out greedy exact match ({len(eval_set)} problems, saved bf16 weights run in fp32): "
        f"{acc:.4f}  ({time.time() - eval_start:.0f}s)",
        flush=True,
    )
    for q, got, want in wrong[:10]:
        print(f"  wrong: {q.removeprefix(PREFIX)!r} -> {got!r} (expected {want!r})")
    copied = statistics.mean(1 - len(p.value) / len(p.answer) for p in eval_set)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    # A demo built on this model must pass: its threshold sits a little under what was measured.
    demo_meta = {
        "task": "record-edit",
        "prefix": PREFIX,
        "keys": list(KEYS),
        "min_len": MIN_LEN,
        "max_len": MAX_LEN,
        "copied_share": round(copied, 4),
        "heldout_exact_match": round(acc, 4),
        "heldout_problems": len(eval_set),
        "heldout_seed": args.seed + 1,
        "accuracy_threshold": math.floor(max(0.0, acc - 0.05) * 100) / 100,
        "train": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "warmup": args.warmup,
            "layers": args.layers,
            "seed": args.seed,
            "device": device,
            "device_name": device_name,
            "threads": args.threads,
            "workers": args.workers,
            "min_accuracy": args.min_accuracy,
            "seconds": round(train_s, 1),
            "params": n_params,
        },
    }
    (out / "tilellm_demo.json").write_text(json.dumps(demo_meta, indent=2) + "\n")
    (out / "README.md").write_text(model_readme(model.config, demo_meta, eval_set[0], wrong))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    if acc < args.min_accuracy:
        print(f"accuracy {acc:.4f} < --min-accuracy {args.min_accuracy}: kept in {out}, {final} untouched")
        return 1
    if final.exists():
        shutil.rmtree(final)
    out.rename(final)
    for f in final.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; the package must be readable by everyone
    print(f"wrote {final} ({size / 1e6:.2f} MB), trained {train_s:.0f}s", flush=True)
    return 0


def command(meta: dict) -> str:
    """The command that trains this model (--out left at its default)."""
    t = meta["train"]
    return (
        f"python tools/train_copy_model.py --device {t['device']} --steps {t['steps']} "
        f"--batch-size {t['batch_size']} --lr {t['lr']} --warmup {t['warmup']} --layers {t['layers']} "
        f"--seed {t['seed']} --threads {t['threads']} --workers {t['workers']} "
        f"--eval-size {meta['heldout_problems']} --min-accuracy {t['min_accuracy']}"
    )


def model_readme(config, meta: dict, example: RecordEdit, wrong: list) -> str:
    """The model card, written next to the weights so its numbers always match them."""
    t = meta["train"]
    misses = (
        "\n".join(
            f"    {q.removeprefix(meta['prefix'])!r}\n    -> {got!r}\n       (expected {want!r})"
            for q, got, want in wrong[:3]
        )
        or "    (none)"
    )
    where = "one thread, on a shared machine" if t["device"] == "cpu" else f"one {t['device_name']}"
    return f"""# tiny-copy: a copy-heavy model for speculative decoding

A {t["params"]:,}-parameter Qwen3 (`Qwen3ForCausalLM`: {config.num_hidden_layers} layers, hidden \
{config.hidden_size}, {config.num_attention_heads} query / {config.num_key_value_heads} KV heads of \
{config.head_dim}, MLP {config.intermediate_size}, tied embeddings, {config.max_position_embeddings} \
positions, bf16 weights) that rewrites a record with one field updated. Its answers are long and, \
but for the new value, copies of the prompt: speculative decoding by prompt lookup (`ngram`) accepts \
most of its drafts, where tiny-arith's short sums give it little to find.

## Task

Every prompt is the same {len(meta["prefix"])}-character instruction, a change `set key=value` and a \
record of `key=value` fields separated by `;`; the answer is the record with that field's value \
replaced, then the end-of-text token:

    {meta["prefix"]!r}
    {example.change + chr(10)!r}
    {example.record + chr(10)!r}
      ->  {example.answer!r} <|endoftext|>

The chat template wraps a user message the same way (`[{{"role": "user", "content": \
"set key=value\\n" + record}}]`). Records and answers are {meta["min_len"]}-{meta["max_len"]} \
characters; on the held-out problems {meta["copied_share"]:.1%} of an answer's characters, on \
average, are copied from the record (all but the new value). Prompt, answer and EOS always fit \
the {config.max_position_embeddings} positions.

## Data

Generated by the project (`tilellm/demo/copy_task.py`), nothing downloaded: 5 to 12 distinct keys \
out of {len(meta["keys"])} ({", ".join(meta["keys"])}) in random order, each with a random \
lowercase word (3-8 letters) or number (1-4 digits); the updated key is one of the record's and \
its new value differs from the old. A fixed hash of the record and the change holds out about 1% of \
all problems; training never sees them, and accuracy is measured on them only.

## Tokenizer

tiny-arith's: character level (`tokenizers` WordLevel over single characters: printable ASCII and \
newline) plus `<|pad|>`, `<|endoftext|>` (EOS) and `<|unk|>`, the same ids; \
`transformers.AutoTokenizer` loads it offline.

## Training

    {command(meta)}

AdamW (betas 0.9/0.98, weight decay 0.1 on matrices), {t["warmup"]} steps of linear warm-up then \
cosine decay to 5% of the peak learning rate, loss on the answers and EOS only, seed {t["seed"]}; \
every batch is {t["batch_size"]} fresh problems. {t["steps"]} steps took {t["seconds"]:.0f} s on \
{where}.

## Accuracy

Greedy exact match of the whole answer on {meta["heldout_problems"]} held-out problems, saved bf16 \
weights run in fp32: **{meta["heldout_exact_match"]:.1%}** (the run's --min-accuracy: \
{t["min_accuracy"]:.0%}). Some misses:

{misses}

## Licence

Weights, tokenizer and data are generated by the project and released under the project's licence
(Apache-2.0).
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    parser.add_argument("--steps", type=int, default=8000)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="processes that build batches ahead of training (0: in this process); the data are the "
        "same for any number",
    )
    parser.add_argument(
        "--eval-size", type=int, default=1000, help="held-out problems for the final accuracy"
    )
    parser.add_argument("--eval-every", type=int, default=1000)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument(
        "--min-accuracy",
        type=float,
        default=0.0,
        help="below this held-out accuracy, exit 1 and leave --out untouched (the model stays in OUT.new)",
    )
    parser.add_argument("--out", default=str(REPO / "tilellm" / "assets" / "tiny-copy"))
    return train(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
