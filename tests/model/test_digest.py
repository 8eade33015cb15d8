"""model/digest.py: the frozen weights a resume loads from model.path again, identified by every byte."""

from __future__ import annotations

import torch

from finetune.model import digest
from finetune.model.digest import frozen_digest


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    model[0].weight.requires_grad_(False)
    model[2].requires_grad_(False)
    return model


def test_every_byte_of_a_frozen_weight_counts_and_the_trained_ones_do_not():
    model = _model()
    before = frozen_digest(model)
    assert before is not None and len(before) == 64
    with torch.no_grad():
        model[1].weight.add_(1.0)  # trains: the checkpoint restores it
    assert frozen_digest(model) == before
    with torch.no_grad():
        flat = model[2].bias.view(-1)
        flat[-1] = torch.nextafter(flat[-1], torch.tensor(float("inf")))  # one ulp of one frozen weight
    assert frozen_digest(model) != before


def test_the_digest_is_none_when_everything_trains():
    model = _model().requires_grad_(True)
    assert frozen_digest(model) is None


def test_the_digest_does_not_depend_on_slices_or_threads(monkeypatch):
    """A device's weights go to the host a slice at a time; the value must not depend on the slice size or the
    number of threads (a checkpoint written with one must resume with another)."""
    model = _model()
    whole = frozen_digest(model)
    monkeypatch.setattr(digest, "SLICE_BYTES", 12)
    monkeypatch.setattr(digest, "THREADS", 1)
    assert frozen_digest(model) == whole


def test_the_values_count_not_their_layout_but_the_dtype_does():
    model = _model()
    before = frozen_digest(model)
    model[2].weight.data = model[2].weight.data.T.contiguous().T  # the same values, stored column by column
    assert not model[2].weight.is_contiguous() and frozen_digest(model) == before
    model[2].weight.data = model[2].weight.data.to(torch.bfloat16)
    assert frozen_digest(model) != before


def test_the_config_digest_ignores_where_a_config_was_written_not_what_it_says(tmp_path):
    from transformers import AutoConfig, LlamaConfig

    from finetune.model.digest import config_digest

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=100)
    for where in ("a", "b"):
        config.save_pretrained(tmp_path / where)
    a, b = (AutoConfig.from_pretrained(tmp_path / where) for where in ("a", "b"))
    assert a.to_dict()["_name_or_path"] != b.to_dict()["_name_or_path"]
    assert config_digest(a) == config_digest(b) == config_digest(config)
    b.rope_parameters = {**b.rope_parameters, "rope_theta": 1234.0}
    assert config_digest(b) != config_digest(a)
