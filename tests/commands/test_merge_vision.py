"""`finetune merge` of a vision-language LoRA run (tiny random Qwen2-VL, 3 steps in-process): the merged directory
loads as an image-text-to-text model with its image processor, gives the adapter's loss on rows with images, and
`finetune generate` on it answers as on the run."""

from __future__ import annotations

import json

import pytest
from vision_fixtures import recipe_yaml, write_data

from finetune.commands.generate import GenerationOptions, complete, load_for_inference
from finetune.commands.image_prompt import user_content
from finetune.commands.merge import merge_run
from finetune.data.collate import collate
from finetune.data.formats import MessageFields, to_example
from finetune.data.images import layout_for
from finetune.data.sources import RawRow
from finetune.data.tokenize import tokenize_example
from finetune.recipe import DataConfig, load_recipe

# float32 throughout: W + s * B @ A (merged) against W x + s * B (A x) (adapter) differ by float rounding only.
LOSS_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from finetune.train.loop import train

    folder = tmp_path_factory.mktemp("vlm-merge")
    data = write_data(folder / "data", n=8)
    (folder / "vlm.yaml").write_text(recipe_yaml(data))
    # lr 1e-2 so that 3 steps move the adapter well past the tolerance: the comparison is not of the base with itself.
    recipe = load_recipe(folder / "vlm.yaml", [f"output_dir={folder / 'run'}", "train.max_steps=3", "train.lr=1e-2",
                                               "adapter.type=lora", "adapter.r=4"])
    train(recipe)
    return folder, recipe


def _loss(model, tokenizer, folder) -> float:
    """The model's own loss on a padded batch of the 8 rows (0, 1 or 2 images each, four sizes)."""
    import torch

    rows = [json.loads(line) for line in (folder / "data" / "train.jsonl").read_text().splitlines()]
    samples = [tokenize_example(to_example(RawRow(row, f"t.jsonl:{i}"), "chat",
                                           fields=MessageFields(image_root=str(folder / "data"))), tokenizer)
               for i, row in enumerate(rows)]
    batch = collate(samples, DataConfig(packing=False), tokenizer.pad_token_id)
    assert batch.vision is not None and batch.vision.images > 4
    with torch.inference_mode():
        return float(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels,
                           **batch.vision.inputs).loss)


def test_merged_vlm_loads_as_image_text_to_text_with_the_adapters_loss(run):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from finetune.model.loading import load_base
    from finetune.run.trained import load_trained

    folder, recipe = run
    merged = merge_run(str(folder / "run"))
    adapted, tokenizer = load_trained(folder / "run")
    model = AutoModelForImageTextToText.from_pretrained(str(merged)).eval()
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    saved = AutoImageProcessor.from_pretrained(str(merged), backend="pil")
    assert saved.to_dict() == layout_for(tokenizer).processor.to_dict()  # the training run's, min/max_pixels too
    assert saved.size["longest_edge"] == 4096 and saved.patch_size == 8  # model.image_processor, the config

    want = _loss(adapted, tokenizer, folder)
    got = _loss(model, tokenizer, folder)
    base = _loss(load_base(recipe.model, tokenizer, recipe.seed), tokenizer, folder)
    assert abs(got - want) <= LOSS_TOLERANCE * want, (got, want)
    assert abs(base - want) > 1e-3 * want, (base, want)  # the adapter changed the loss: the check has teeth


def test_generate_on_the_merged_directory_answers_as_the_run(run):
    folder, _ = run
    merged = folder / "run" / "merged"
    if not merged.is_dir():
        merge_run(str(folder / "run"), str(merged))
    image = str(folder / "data" / "images" / "green.png")
    messages = [{"role": "user", "content": user_content("What color is this?", 1)}]
    options = GenerationOptions(max_new_tokens=6, min_new_tokens=6)
    replies = []
    for path in (folder / "run", merged):
        model, tokenizer = load_for_inference(str(path))
        assert layout_for(tokenizer) is not None  # the merged directory's image processor, attached
        replies.append(complete(model, tokenizer, messages, options, stream=None, images=[image]))
    assert replies[0].prompt == replies[1].prompt
    assert replies[0].token_ids == replies[1].token_ids and len(replies[0].token_ids) == 6
