"""dualvllm.training.untie: a tied checkpoint becomes the same model with its own output layer."""

from __future__ import annotations

import json

import pytest

from dualvllm.common.errors import InvalidInputError
from dualvllm.training import untie

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def tied_checkpoint(directory):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=32, tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text("{}")
    return model


def test_an_untied_copy_gives_the_same_logits_and_owns_its_output_layer(tmp_path):
    model = tied_checkpoint(tmp_path / "tied")
    untie.main([str(tmp_path / "tied"), str(tmp_path / "untied")])
    copy = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "untied", dtype=torch.float32)
    assert json.loads((tmp_path / "untied" / "config.json").read_text())["tie_word_embeddings"] is False
    assert copy.lm_head.weight.data_ptr() != copy.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 5, 9, 200]])
    assert torch.equal(copy(ids).logits, model(ids).logits)
    assert (tmp_path / "untied" / "tokenizer_config.json").is_file()
    with torch.no_grad():  # the copy trains its layers apart
        copy.lm_head.weight.add_(1.0)
    assert not torch.equal(copy.lm_head.weight, copy.model.embed_tokens.weight)


def test_a_tied_base_is_refused_with_the_command_that_unties_it(tmp_path):
    model = tied_checkpoint(tmp_path / "tied")
    with pytest.raises(InvalidInputError, match=r"ties its input and output embeddings.*python -m dualvllm.training.untie"):
        untie.refuse_tied(model, str(tmp_path / "tied"))
    model.config.tie_word_embeddings = False
    untie.refuse_tied(model, str(tmp_path / "tied"))  # untied: nothing to say


def test_untying_an_untied_checkpoint_or_into_an_existing_directory_is_refused(tmp_path):
    tied_checkpoint(tmp_path / "tied")
    assert untie.main([str(tmp_path / "tied"), str(tmp_path / "tied")]) == 2
    untie.main([str(tmp_path / "tied"), str(tmp_path / "untied")])
    with pytest.raises(InvalidInputError, match="nothing to untie"):
        untie.untie(tmp_path / "untied", tmp_path / "again")
