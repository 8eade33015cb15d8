"""Packing rows with images (architectures.packing_refusal, data/pack.py, data/pixels.py): for LLaVA and SmolVLM a
packed document equals itself alone, images included, and nothing of another document reaches it; the other
families are refused with the reason, which is measured here too."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import max_rel_diff
from vision_fixtures import model_config, tokenizer_config, write_data

from finetune.batch import MicroBatch
from finetune.data.collate import collate
from finetune.data.formats import MessageFields, to_example
from finetune.data.pack import packed_row
from finetune.data.sources import RawRow
from finetune.data.tokenize import tokenize_example
from finetune.labels import IGNORE_INDEX
from finetune.model.architectures import VLM_PACKED, packing_refusal
from finetune.model.isolation import check_packable, check_packing_isolation
from finetune.model.loading import load_model
from finetune.model.tokenizer import load_tokenizer
from finetune.model.with_loss import CausalLMWithLoss
from finetune.recipe import AdapterConfig, DataConfig

MAX_SEQ_LEN = 512
PACKED = DataConfig(packing=True, max_seq_len=MAX_SEQ_LEN)
PADDED = DataConfig(packing=False)
# Two packed rows of 3 documents: 0, 1 or 2 images each, the image-less document (3) in the middle of row 0.
PLAN = [[0, 3, 1], [2, 4, 5]]


def _setup(family, folder, n=6, **overrides):
    tok = load_tokenizer(tokenizer_config(family), model_config(family))
    model = load_model(model_config(family, **overrides), AdapterConfig(), tok, seed=0).eval()
    if family == "gemma3":  # its projection starts at zero: images would add nothing
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(
                0, 0.2, generator=torch.Generator().manual_seed(0))
    data = write_data(folder, n=n)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    samples = [tokenize_example(to_example(RawRow(row, f"t.jsonl:{i}"), "chat",
                                           fields=MessageFields(image_root=str(folder))), tok)
               for i, row in enumerate(rows)]
    return tok, model, samples


def _spans(plan, samples):
    """(row, start, sample index) of each document of the packed rows."""
    spans = []
    for r, members in enumerate(plan):
        start = 0
        for k in members:
            spans.append((r, start, k))
            start += len(samples[k]["input_ids"])
    return spans


def _logits(model, batch: MicroBatch) -> torch.Tensor:
    vision = batch.vision.inputs if batch.vision is not None else {}
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                     use_cache=False, **vision).logits


def _doc_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one document's tokens (position t scores label t + 1)."""
    return torch.nn.functional.cross_entropy(logits[:-1].double(), labels[1:], ignore_index=IGNORE_INDEX,
                                             reduction="sum")


@pytest.mark.parametrize("family", VLM_PACKED)
def test_packed_documents_equal_themselves_alone(tmp_path, family):
    """Each document of two packed rows (0, 1 and 2 images of four sizes; pixels listed in token order across the
    rows) has the logits and the loss it has alone in a padded batch, within 1e-5 (measured: 2e-7, float32
    rounding); the fused loss of the packed micro-batch is the sum of the documents' fused losses alone."""
    tok, model, samples = _setup(family, tmp_path)
    check_packable(model, tok.pad_token_id)  # not refused
    batch = collate([packed_row(samples, m, MAX_SEQ_LEN) for m in PLAN], PACKED, tok.pad_token_id).to("cpu")
    assert batch.attention_mask is None and batch.vision is not None
    assert batch.vision.images == sum(len((samples[k].get("images") or {"items": []})["items"]) for m in PLAN
                                      for k in m) == 7
    packed = _logits(model, batch)
    net = CausalLMWithLoss(model, "torch", chunk_size=16, z_loss=0.0, softcap=None)
    with torch.no_grad():
        packed_sum, packed_count = net(**batch.model_inputs())
    alone_sum, alone_count = 0.0, 0
    for r, start, k in _spans(PLAN, samples):
        single = collate([samples[k]], PADDED, tok.pad_token_id).to("cpu")
        alone = _logits(model, single)[0]
        n = len(samples[k]["input_ids"])
        assert (packed[r, start:start + n] - alone).abs().max().item() <= 1e-5, (k, family)
        labels = torch.tensor(samples[k]["labels"])
        got, want = _doc_loss(packed[r, start:start + n], labels), _doc_loss(alone, labels)
        assert abs(got.item() - want.item()) <= 1e-5 * want.item(), (k, got.item(), want.item())
        with torch.no_grad():
            loss_sum, count = net(**single.model_inputs())
        alone_sum, alone_count = alone_sum + loss_sum.item(), alone_count + int(count)
    assert int(packed_count) == alone_count == batch.targets
    assert abs(packed_sum.item() - alone_sum) <= 1e-5 * alone_sum, (packed_sum.item(), alone_sum)


def _tiles(item) -> int:
    """The pixel_values entries of one image: SmolVLM's tiles plus its global image, else one."""
    rows, cols = item.get("grid", [0, 0])
    return rows * cols + 1


def _perturbed(batch: MicroBatch, samples, keep: int, image_id: int, vocab: int) -> MicroBatch:
    """The packed micro-batch with every other document's pixels and text replaced (image tokens kept where they
    are, so that features still meet tokens)."""
    ids = batch.input_ids.clone()
    pixels = batch.vision.inputs["pixel_values"].clone()
    flat = pixels.view(-1, *pixels.shape[-3:])
    gen = torch.Generator().manual_seed(1)
    tile = 0
    for r, start, k in _spans(PLAN, samples):
        n = len(samples[k]["input_ids"])
        items = (samples[k].get("images") or {"items": []})["items"]
        tiles = sum(_tiles(item) for item in items)
        if k != keep:
            flat[tile:tile + tiles] = torch.randn(flat[tile:tile + tiles].shape, generator=gen)
            doc = ids[r, start:start + n]
            text = doc != image_id
            other = (doc + 1 + torch.randint(0, vocab - 2, doc.shape, generator=gen)) % vocab
            other[other == image_id] = (image_id + 1) % vocab
            ids[r, start:start + n] = torch.where(text, other, doc)
        tile += tiles
    assert tile == flat.shape[0]  # every pixel entry belongs to one image, in token order
    vision = type(batch.vision)({**batch.vision.inputs, "pixel_values": pixels}, batch.vision.images)
    return MicroBatch(ids, batch.labels, targets=batch.targets, seq_tokens=batch.seq_tokens,
                      padded_tokens=batch.padded_tokens, position_ids=batch.position_ids, vision=vision)


@pytest.mark.parametrize("family", VLM_PACKED)
def test_other_documents_images_and_text_change_nothing(tmp_path, family):
    """Replacing the pixels and the text of every other document of the packed micro-batch (both rows) leaves a
    document's logits as they were: a change of at most 1e-6 (measured: exactly 0); the replaced documents' own
    logits do change (by far more than that), so the replacement reached the model."""
    tok, model, samples = _setup(family, tmp_path)
    batch = collate([packed_row(samples, m, MAX_SEQ_LEN) for m in PLAN], PACKED, tok.pad_token_id).to("cpu")
    base = _logits(model, batch)
    image_id, vocab = model.config.image_token_id, model.get_input_embeddings().num_embeddings
    for r, start, k in _spans(PLAN, samples):
        changed = _logits(model, _perturbed(batch, samples, k, image_id, vocab))
        n = len(samples[k]["input_ids"])
        assert (changed[r, start:start + n] - base[r, start:start + n]).abs().max().item() <= 1e-6, (k, family)
        others = torch.ones(base.shape[:2], dtype=torch.bool)
        others[r, start:start + n] = False
        assert (changed - base)[others].abs().max().item() > 1e-2


@pytest.mark.parametrize("family", VLM_PACKED)
def test_accumulation_of_packed_rows_equals_unpacked(tmp_path, family):
    """Gradients (the vision encoder's included) of 16 documents packed two by two into 8 rows, as micro-batch x
    accumulation 8x1 and 2x4, equal those of the 16 documents unpacked (padded, 4 micro-batches of 4), the loss
    summed and divided by the step's targets as the trainer does: per tensor max |a - b| / max |b| <= 1e-5 (a key
    bias whose gradient is float noise held to the largest gradient's scale)."""
    tok, model, samples = _setup(family, tmp_path, n=16, freeze_vision=False)
    net = CausalLMWithLoss(model, "torch", chunk_size=16, z_loss=0.0, softcap=None)
    rows = [packed_row(samples, [2 * i, 2 * i + 1], MAX_SEQ_LEN) for i in range(8)]

    def grads(micro_batches):
        model.zero_grad()
        total = sum(b.targets for b in micro_batches)
        for b in micro_batches:
            loss_sum, _ = net(**b.model_inputs())
            (loss_sum / total).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    unpacked = grads([collate(samples[i:i + 4], PADDED, tok.pad_token_id).to("cpu") for i in range(0, 16, 4)])
    top = max(g.abs().max().item() for g in unpacked.values())
    assert any(name.startswith(("model.vision_tower.", "model.vision_model.")) and g.abs().sum() > 0
               for name, g in unpacked.items())
    for size in (8, 2):
        packed = grads([collate(rows[i:i + size], PACKED, tok.pad_token_id).to("cpu") for i in range(0, 8, size)])
        assert packed.keys() == unpacked.keys()
        for name, want in unpacked.items():
            if want.abs().max() < 1e-7 * top:  # zero but for float noise (CLIP's key bias)
                assert (packed[name] - want).abs().max() <= 1e-5 * top, name
            else:
                assert max_rel_diff(packed[name], want) <= 1e-5, (size, name, max_rel_diff(packed[name], want))


REFUSED = {"qwen2_vl": "M-RoPE positions come from get_rope_index only when no position_ids are given",
           "qwen2_5_vl": "M-RoPE positions come from get_rope_index only when no position_ids are given",
           "gemma3": "applies that image-block mask before remapping the mask to each packed document's positions"}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_other_families_are_refused_with_the_measured_reason(tmp_path, family):
    """Qwen2-VL, Qwen2.5-VL and Gemma 3 refuse packing with their reason; the reason is real: a packed document's
    logits differ from its logits alone by more than 1e-3 (measured: 0.2-0.4), far beyond the 1e-5 the packed
    families hold."""
    tok, model, samples = _setup(family, tmp_path)
    why = packing_refusal(model, tok.pad_token_id)
    assert why and why.startswith(f"data.packing: {family} is a vision-language model") and REFUSED[family] in why
    assert "Packing is proven for llava, smolvlm" in why and "data.packing: false" in why
    batch = collate([packed_row(samples, m, MAX_SEQ_LEN) for m in PLAN], PACKED, tok.pad_token_id).to("cpu")
    packed = _logits(model, batch)
    error = 0.0
    for r, start, k in _spans(PLAN, samples):
        alone = _logits(model, collate([samples[k]], PADDED, tok.pad_token_id).to("cpu"))[0]
        error = max(error, (packed[r, start:start + len(alone)] - alone).abs().max().item())
    assert error > 1e-3, (family, error)


@pytest.mark.parametrize("family", VLM_PACKED)
def test_the_start_of_run_check_passes(family):
    """The start-of-run isolation check (text tokens) passes on the packed families: exactly 0 change."""
    tok = load_tokenizer(tokenizer_config(family), model_config(family))
    model = load_model(model_config(family), AdapterConfig(), tok, seed=0)
    assert packing_refusal(model, tok.pad_token_id) is None
    assert check_packing_isolation(model, len(tok)) == 0.0


@pytest.mark.parametrize("family", ["qwen3_vl", "mistral3"])
def test_a_family_not_shown_to_pack_is_refused(family):
    """A supported family without a packing proof (VLM_PACKED) is refused, never packed on trust."""
    tok = load_tokenizer(tokenizer_config(family), model_config(family))
    model = load_model(model_config(family), AdapterConfig(), tok, seed=0)
    why = packing_refusal(model, tok.pad_token_id)
    assert why and why.startswith(f"data.packing: {family} is a vision-language model") and "not checked yet" in why
