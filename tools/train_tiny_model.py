#!/usr/bin/env python
"""Train the embedded model: a tiny Qwen3 that adds multi-digit numbers.

The task and its train/held-out split live in `tilellm.demo.task`; the data are generated here
on the fly (nothing is downloaded). The script writes a Hugging Face directory (config.json,
model.safetensors, a character-level tokenizer.json + tokenizer_config.json with a chat
template, generation_config.json), measures greedy exact-match accuracy on held-out problems
with the saved 16-bit weights, and records it in `tilellm_demo.json` for `tilellm demo`.

    python tools/train_tiny_model.py --device cpu --steps 4000 --batch-size 32 --lr 0.002  # the shipped
    # model (tilellm/assets/tiny-arith/README.md has its exact command): ~5-25 min on one CPU core
    python tools/train_tiny_model.py --device cuda --steps 20000 --batch-size 512  # a few min on a GPU
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
import shutil
import string
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tilellm.demo.task import (  # noqa: E402
    EOS,
    MAX_DIGITS,
    MAX_TURNS,
    MIN_DIGITS,
    PREFIX,
    Conversation,
    Problem,
    held_out_conversations,
    held_out_problems,
    sample_conversation,
)

PAD = "<|pad|>"
UNK = "<|unk|>"
# Every printable ASCII character and newline is one token: prompts never fall back to <unk>.
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]

# The instruction once, then each user turn as "a+b=" and each assistant turn as its sum and EOS: a
# one-message conversation is exactly the demo's prompt, and a conversation renders the way
# `tilellm.demo.task.Conversation.prompt` spells it (what training saw). System messages are dropped:
# the model knows no other instruction.
CHAT_TEMPLATE = (
    PREFIX + "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ message['content'] }}="
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)


def model_config(vocab_size: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA 2:1
        head_dim=64,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        hidden_act="silu",
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
    )


# --- tokenizer ---------------------------------------------------------------------------------


def build_tokenizer():
    """Character-level WordLevel tokenizer: ids 0-2 are special, then one id per character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for c in CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    tok.add_special_tokens([PAD, EOS, UNK])
    return tok


def save_tokenizer(tok, out: Path, max_positions: int = 128, chat_template: str = CHAT_TEMPLATE) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json."""
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_positions,
        "padding_side": "left",
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS, "pad_token": PAD, "unk_token": UNK}, indent=2) + "\n"
    )


# --- data ----------------------------------------------------------------------------------------


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def make_batch(
    tok,
    rng: random.Random,
    batch_size: int,
    eos_id: int,
    pad_id: int,
    digits: tuple[int, int],
    turns: int = 1,
):
    """Right-padded [B, L] suffixes (everything after PREFIX) and labels for conversations of `turns`
    problems; every turn's answer and EOS carry loss (-100 elsewhere), so the first turn of each
    conversation is also a single-turn example."""
    rows, labels = [], []
    for _ in range(batch_size):
        conv = sample_conversation(rng, turns, held_out=False, min_digits=digits[0], max_digits=digits[1])
        ids, lab = [], []
        for p in conv.turns:
            prompt, answer = encode(tok, p.question + "="), encode(tok, p.answer) + [eos_id]
            ids += prompt + answer
            lab += [-100] * len(prompt) + answer
        rows.append(ids)
        labels.append(lab)
    width = max(len(r) for r in rows)
    x = torch.full((batch_size, width), pad_id, dtype=torch.long)
    y = torch.full((batch_size, width), -100, dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, labels)):
        x[i, : len(r)] = torch.tensor(r)
        y[i, : len(lab)] = torch.tensor(lab)
    return x, y


# --- evaluation ----------------------------------------------------------------------------------


@torch.no_grad()
def greedy_accuracy(
    model, tok, problems: list[Problem] | list[Conversation], eos_id: int, device: str
) -> tuple[float, list]:
    """Greedy exact match on the (last) answer; prompts of equal length are decoded together (no
    padding needed)."""
    model.eval()
    by_len: dict[int, list[tuple[Problem | Conversation, list[int]]]] = {}
    for p in problems:
        ids = encode(tok, p.prompt)
        by_len.setdefault(len(ids), []).append((p, ids))
    correct, wrong = 0, []
    max_new = max(len(p.answer) for p in problems) + 2
    for group in by_len.values():
        x = torch.tensor([ids for _, ids in group], device=device)
        done = torch.zeros(len(group), dtype=torch.bool, device=device)
        out = []
        for _ in range(max_new):
            nxt = model(input_ids=x).logits[:, -1].float().argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            out.append(nxt)
            done |= nxt == eos_id
            x = torch.cat([x, nxt[:, None]], dim=1)
            if bool(done.all()):
                break
        gen = torch.stack(out, dim=1).tolist()
        for (p, _), g in zip(group, gen):
            g = g[: g.index(eos_id)] if eos_id in g else g
            text = tok.decode(g)
            if p.is_correct(text):
                correct += 1
            else:
                wrong.append((p.prompt.removeprefix(PREFIX), text, p.answer))
    model.train()
    return correct / len(problems), wrong


# --- training ------------------------------------------------------------------------------------


def shared_prefix_logits(model, prefix_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Logits [B, L, V] of `x` [B, L] after `prefix_ids` [1, P]: the prefix runs once and its K/V are
    shared by the batch (gradients flow through the shared cache), which cuts the work about 3x."""
    from transformers import DynamicCache

    # transformers renamed `past_key_values` to `cache`; an unknown keyword would be swallowed by
    # **kwargs and the batch would silently train without the instruction.
    name = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    cache = {name: DynamicCache(config=model.config)}
    model.model(input_ids=prefix_ids, use_cache=True, **cache)
    cache[name].batch_repeat_interleave(x.shape[0])
    return model(input_ids=x, use_cache=True, **cache).logits


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def train(args: argparse.Namespace) -> int:
    from transformers import Qwen3ForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    device = args.device
    tok = build_tokenizer()
    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id(PAD)
    vocab_size = 128  # the tokenizer has 99 entries (3 special + 96 characters); round up
    assert tok.get_vocab_size() <= vocab_size

    model = Qwen3ForCausalLM(model_config(vocab_size)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params:,}  device: {device}  threads: {torch.get_num_threads()}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    prefix_ids = torch.tensor([encode(tok, PREFIX)], device=device)
    digits = (args.min_digits, args.max_digits)
    eval_set = held_out_problems(
        args.eval_size, seed=args.seed + 1, min_digits=digits[0], max_digits=digits[1]
    )
    eval_convs = held_out_conversations(
        args.eval_size,
        seed=args.seed + 2,
        min_turns=2,
        max_turns=4,
        min_digits=digits[0],
        max_digits=digits[1],
    )
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    start = time.time()
    loss_avg = None
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        # Once the digits line up, a batch holds conversations of 1..max_turns problems: one count per
        # batch, so rows need little padding, and about --batch-size answers, so a step of long
        # conversations costs what a step of single problems does.
        multi = args.max_turns > 1 and step >= args.multi_turn_start * args.steps
        turns = rng.randint(1, args.max_turns) if multi else 1
        rows = max(1, round(args.batch_size / turns))
        x, y = make_batch(tok, rng, rows, eos_id, pad_id, digits, turns)
        x, y = x.to(device), y.to(device)
        # Curriculum: early on, every other batch drops the instruction. Without ~40 constant tokens
        # to attend to, the model finds the digit-alignment heads much sooner (with the prefix alone
        # the loss can sit on a plateau for thousands of steps); the circuits carry over because
        # RoPE attention depends only on relative positions.
        with_prefix = step >= args.curriculum * args.steps or step % 2 == 0
        with amp:
            if with_prefix:
                logits = shared_prefix_logits(model, prefix_ids, x)
            else:
                logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_avg = loss.item() if loss_avg is None else 0.98 * loss_avg + 0.02 * loss.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print(
                f"step {step + 1:6d}  loss {loss_avg:.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                f"{time.time() - start:6.1f}s",
                flush=True,
            )
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            acc, _ = greedy_accuracy(model, tok, eval_set[:200], eos_id, device)
            acc_mt, _ = greedy_accuracy(model, tok, eval_convs[:200], eos_id, device)
            print(
                f"  held-out exact match (200 each): single-turn {acc:.3f}  multi-turn {acc_mt:.3f}",
                flush=True,
            )
    train_s = time.time() - start

    # Save in 16-bit, then measure the accuracy of exactly what was saved.
    final = Path(args.out)
    out = save_candidate(model, tok, final, eos_id, pad_id)

    reloaded = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).to(device)
    acc, wrong = greedy_accuracy(reloaded, tok, eval_set, eos_id, device)
    print(
        f"held-out greedy exact match ({len(eval_set)} problems, saved bf16 weights run in fp32): {acc:.4f}"
    )
    for q, got, want in wrong[:10]:
        print(f"  wrong: {q!r} -> {got!r} (expected {want})")
    acc_mt, wrong_mt = greedy_accuracy(reloaded, tok, eval_convs, eos_id, device)
    print(
        f"held-out greedy exact match, last answer of {len(eval_convs)} conversations of 2-4 turns: "
        f"{acc_mt:.4f}"
    )
    for q, got, want in wrong_mt[:5]:
        print(f"  wrong: {q!r} -> {got!r} (expected {want})")
    # The demo must pass on the shipped model: its threshold sits a little under what was measured.
    demo_meta = {
        "task": "addition",
        "min_digits": args.min_digits,
        "max_digits": args.max_digits,
        "prefix": PREFIX,
        "heldout_exact_match": round(acc, 4),
        "heldout_problems": len(eval_set),
        "heldout_seed": args.seed + 1,
        "multiturn_exact_match": round(acc_mt, 4),
        "multiturn_conversations": len(eval_convs),
        "multiturn_turns": [2, 4],
        "multiturn_seed": args.seed + 2,
        "accuracy_threshold": math.floor(max(0.0, acc - 0.05) * 100) / 100,
        "train": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "curriculum": args.curriculum,
            "max_turns": args.max_turns,
            "threads": args.threads,
            "multi_turn_start": args.multi_turn_start,
            "seed": args.seed,
            "device": device,
            "seconds": round(train_s, 1),
            "params": n_params,
        },
    }
    (out / "tilellm_demo.json").write_text(json.dumps(demo_meta, indent=2) + "\n")
    (out / "README.md").write_text(model_readme(model.config, demo_meta, args, wrong, wrong_mt))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    if min(acc, acc_mt) < args.min_accuracy:
        print(
            f"accuracy {min(acc, acc_mt):.4f} < --min-accuracy {args.min_accuracy}: kept in {out}, "
            f"{final} untouched"
        )
        return 1
    if final.exists():
        shutil.rmtree(final)
    out.rename(final)
    for f in final.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; the package must be readable by everyone
    print(f"wrote {final} ({size / 1e6:.2f} MB), trained {train_s:.0f}s", flush=True)
    return 0


def add_legacy_config_keys(path: Path) -> None:
    """Spell rope_theta and torch_dtype the transformers-4 way too (v5 writes rope_parameters / dtype):
    a 4.x reader would otherwise fall back to Qwen3's default rope_theta of 1e6."""
    cfg = json.loads(path.read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        cfg.setdefault("rope_theta", theta)
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def model_readme(config, meta: dict, args: argparse.Namespace, wrong: list, wrong_mt: list) -> str:
    """The model card, written next to the weights so its numbers always match them."""
    t = meta["train"]
    digits = (
        f"{meta['min_digits']}-digit"
        if meta["min_digits"] == meta["max_digits"]
        else f"{meta['min_digits']}- to {meta['max_digits']}-digit"
    )
    cmd = (
        f"python tools/train_tiny_model.py --device {t['device']} --steps {t['steps']} "
        f"--batch-size {t['batch_size']} --lr {t['lr']} --seed {t['seed']} "
        f"--min-digits {meta['min_digits']} --max-digits {meta['max_digits']} "
        f"--curriculum {t['curriculum']} --max-turns {t['max_turns']} "
        f"--multi-turn-start {t['multi_turn_start']} --threads {t['threads']}"
    )
    n = meta["max_digits"]
    ex = Problem(int("1234567890"[:n]), int("5678901234"[:n]), meta["prefix"])
    ex2 = Problem(int("4000000000"[:n]), int("1111111111"[:n]), meta["prefix"])
    examples = "\n".join(f"    {q}{got}   (expected {want})" for q, got, want in wrong[:5]) or "    (none)"
    examples_mt = (
        "\n".join(f"    {q}{got}   (expected {want})" for q, got, want in wrong_mt[:3]) or "    (none)"
    )
    return f"""# tiny-arith: the embedded default model

A {t["params"]:,}-parameter Qwen3 (`Qwen3ForCausalLM`: {config.num_hidden_layers} layers, hidden \
{config.hidden_size}, {config.num_attention_heads} query / {config.num_key_value_heads} KV heads of \
{config.head_dim}, MLP {config.intermediate_size}, tied embeddings, bf16 weights) that adds two \
{digits} numbers. It ships inside the package so that `tilellm demo`, `tilellm generate` and the \
tests run offline; `tilellm.assets.default_model_path()` returns this directory.

## Task

Every prompt is the same {len(meta["prefix"])}-character instruction followed by the problem; the \
answer is the sum and the end-of-text token:

    {meta["prefix"]!r} + "{ex.question}="  ->  "{ex.answer}" <|endoftext|>

The chat template wraps a user message the same way (`[{{"role": "user", "content": "{ex.question}"}}]`).
The instruction fills {len(meta["prefix"]) // 16} full KV blocks of 16 tokens, which every request \
shares through the prefix cache.

A conversation states the instruction once; each earlier user turn is a problem `a+b` and each
assistant turn its sum, closed by the end-of-text token, and the model answers the last problem:

    {meta["prefix"]!r} + "{ex.question}={ex.answer}<|endoftext|>{ex2.question}="  ->  "{ex2.answer}"

System messages are dropped by the template. With 4-digit problems a turn takes 15-16 tokens, so
about five turns fit the 128 positions; `tilellm chat` drops the oldest turns beyond that.

## Data

Generated by the project (`tilellm/demo/task.py`), nothing downloaded: operands are drawn
uniformly, both with the same number of digits. A fixed hash of `(a, b)` holds out about 1% of
all problems; training never sees them, and accuracy is measured on them only.

## Tokenizer

Character level (`tokenizers` WordLevel over single characters: printable ASCII and newline) plus
`<|pad|>`, `<|endoftext|>` (EOS) and `<|unk|>`; `transformers.AutoTokenizer` loads it offline.

## Training

    {cmd}

AdamW (betas 0.9/0.98, weight decay 0.1 on matrices), linear warm-up then cosine decay, loss on the
answers and EOS only, seed {t["seed"]}. During the first {t.get("curriculum", 0):.0%} of the steps
every other batch omits the instruction: with {len(meta["prefix"])} constant tokens to attend to,
the loss can otherwise sit on a plateau for thousands of steps before the model finds the heads
that line the digits up (the plateau depends on the seed: other seeds can stay on it). After
{t.get("multi_turn_start", 1):.0%} of the steps each batch is a conversation of 1 to \
{t.get("max_turns", 1)} problems (one count per batch, drawn uniformly), rendered the way the chat \
template renders it, with about {t["batch_size"]} answers per batch (fewer rows for more turns); \
every turn's answer carries loss. {t["steps"]} steps took {t["seconds"]:.0f} s on {t["device"]} \
(one thread, on a shared machine).

## Accuracy

Greedy exact match on {meta["heldout_problems"]} held-out problems, saved bf16 weights run in fp32:
**{meta["heldout_exact_match"]:.1%}**. `tilellm demo` fails (exit code 1) below
{meta["accuracy_threshold"]:.0%}, the threshold recorded in `tilellm_demo.json`. Some misses:

{examples}

Greedy exact match on the last answer of {meta["multiturn_conversations"]} held-out conversations \
of {meta["multiturn_turns"][0]} to {meta["multiturn_turns"][1]} turns (every problem held out, \
earlier turns answered correctly): **{meta["multiturn_exact_match"]:.1%}**. Some misses:

{examples_mt}

## Licence

Weights, tokenizer and data are generated by the project and released under the project's licence
(Apache-2.0).
"""


def save_candidate(model, tok, final: Path, eos_id: int, pad_id: int, write_tokenizer=None) -> Path:
    """Write `model` in bf16 and its tokenizer (`write_tokenizer(tok, dir)`, default this task's
    `save_tokenizer`) to `final`'s sibling `<name>.new` (returned). It replaces `final` only once
    it reaches --min-accuracy, so a failed run never overwrites the shipped model."""
    out = final.with_name(final.name + ".new")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model = model.to("cpu").to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = None
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    add_legacy_config_keys(out / "config.json")
    (write_tokenizer or save_tokenizer)(tok, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--min-digits", type=int, default=MIN_DIGITS, help="digits of each operand, at least")
    parser.add_argument("--max-digits", type=int, default=MAX_DIGITS, help="digits of each operand, at most")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument(
        "--curriculum",
        type=float,
        default=0.4,
        help="fraction of steps in which half the batches omit the prefix",
    )
    parser.add_argument(
        "--max-turns", type=int, default=MAX_TURNS, help="problems per training conversation, at most"
    )
    parser.add_argument(
        "--multi-turn-start",
        type=float,
        default=0.4,
        help="fraction of steps after which batches hold conversations of 1..--max-turns problems",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    parser.add_argument(
        "--eval-size", type=int, default=1000, help="held-out problems for the final accuracy"
    )
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument(
        "--min-accuracy",
        type=float,
        default=0.0,
        help="below this held-out accuracy (single- or multi-turn), exit 1 and leave --out untouched "
        "(the model stays in OUT.new)",
    )
    parser.add_argument("--out", default=str(REPO / "tilellm" / "assets" / "tiny-arith"))
    return train(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
