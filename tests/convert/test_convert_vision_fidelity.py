"""A converted vision-language recipe trains the tokens Axolotl's multimodal collator trains, through finetune's own
data code (row -> example -> sample), on the tiny Qwen2-VL tokenizer of tests/vision_fixtures.py.

Axolotl's rules, written out from its processing_strategies.py (commit 067b021c8): with chat_template qwen2_vl
(Qwen2VLProcessingStrategy) a trained role's tokens run from after `<|im_start|>{role}\\n` through `<|im_end|>`;
with a template without role markers (the base strategy) every token is trained; both then mask padding and
`<|image_pad|>`."""

from __future__ import annotations

import json

import pytest
import yaml
from vision_fixtures import model_config, tokenizer_config, write_images

from finetune.convert import convert_axolotl
from finetune.data.samples import row_example
from finetune.data.sources import RawRow
from finetune.data.tokenize import tokenize_example
from finetune.labels import IGNORE_INDEX
from finetune.recipe import Recipe, validate

ROW = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "image", "path": "images/red.png"}, {"type": "text", "text": "Color?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Red."}]},
    {"role": "user", "content": "And this?"},
    {"role": "assistant", "content": "Still red."},
]}


@pytest.fixture(scope="module")
def tok():
    from finetune.model.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_config(), model_config())


def _sample(tmp_path, tok, template_line: str) -> dict:
    write_images(tmp_path / "images")
    data = tmp_path / "vqa.jsonl"
    data.write_text(json.dumps(ROW) + "\n", encoding="utf-8")
    config = tmp_path / "config.yml"
    config.write_text(f"base_model: Qwen/Qwen2-VL-2B-Instruct\nprocessor_type: AutoProcessor\n{template_line}"
                      f"datasets:\n  - {{path: {data}, type: chat_template}}\nadapter: lora\n"
                      "lora_target_modules: '.*(q|v)_proj'\n", encoding="utf-8")
    recipe = yaml.safe_load(convert_axolotl(config).text)
    validate(recipe)
    dataset = Recipe.model_validate(recipe).datasets[0]
    return tokenize_example(row_example(RawRow(ROW, "vqa.jsonl:1"), dataset), tok)


def _axolotl_keep(ids: list[int], tok, roles: tuple[str, ...] | None) -> list[bool]:
    """Axolotl's keep mask: every token (roles None), or the roles' spans found by their markers; never the pad or
    image token."""
    if roles is None:
        keep = [True] * len(ids)
    else:
        keep = [False] * len(ids)
        end = tok.encode("<|im_end|>", add_special_tokens=False)
        starts = [tok.encode(f"<|im_start|>{role}\n", add_special_tokens=False) for role in roles]
        i = 0
        while i < len(ids):
            start = next((s for s in starts if ids[i:i + len(s)] == s), None)
            if start is None:
                i += 1
                continue
            j = i + len(start)
            while j < len(ids) and ids[j:j + len(end)] != end:
                keep[j] = True
                j += 1
            keep[j:j + len(end)] = [True] * len(ids[j:j + len(end)])
            i = j + len(end)
    masked = {tok.pad_token_id, tok.convert_tokens_to_ids("<|image_pad|>")}
    return [k and t not in masked for k, t in zip(keep, ids)]


def test_qwen2_vl_template_trains_the_assistant_spans_axolotl_trains(tmp_path, tok):
    sample = _sample(tmp_path, tok, "chat_template: qwen2_vl\n")
    ours = [label != IGNORE_INDEX for label in sample["labels"]]
    assert ours == _axolotl_keep(sample["input_ids"], tok, ("assistant",))
    assert tok.decode([t for t, k in zip(sample["input_ids"], ours) if k]) == "Red.<|im_end|>Still red.<|im_end|>"


def test_no_role_markers_trains_every_token_but_the_images(tmp_path, tok):
    """The base strategy (no chat_template named): every token, as train_on_inputs: true trains them; the only
    difference is the image's marker tokens, which finetune never trains."""
    sample = _sample(tmp_path, tok, "")
    ids = sample["input_ids"]
    ours = [label != IGNORE_INDEX for label in sample["labels"]]
    theirs = _axolotl_keep(ids, tok, None)
    markers = set(tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"]))
    # Position 0 differs too, but its label never enters the loss: nothing before the first token predicts it.
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert differ == [0] + [i for i, t in enumerate(ids) if t in markers]
    assert sum(t in markers for t in ids) == 2 and sum(ours) > len(ids) // 2
