"""Images in chat rows (finetune/data/images.py, pixels.py): parts, the token layout against the image processor's
own, exact masks, truncation that never cuts an image, and pixels made in collate."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image
from vision_fixtures import IMAGES, VISION_TOKENS, model_config, tokenizer_config, write_data, write_images

from finetune.data.collate import collate
from finetune.data.formats import MessageFields, to_example
from finetune.data.report import print_sample
from finetune.data.samples import tokenize_examples
from finetune.data.sources import BadRow, RawRow
from finetune.data.stats import DataStats
from finetune.data.tokenize import tokenize_example
from finetune.errors import UserError
from finetune.labels import IGNORE_INDEX
from finetune.model.tokenizer import load_tokenizer
from finetune.recipe import DataConfig, ModelConfig, TokenizerConfig


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tokenizer_config(), model_config())


@pytest.fixture
def folder(tmp_path):
    write_images(tmp_path / "images")
    return tmp_path


def _example(row, folder, origin="data/t.jsonl:7", **kwargs):
    return to_example(RawRow(row, origin), "chat", fields=MessageFields(image_root=str(folder)), **kwargs)


def _row(*user_parts, answer="It is red."):
    return {"messages": [{"role": "user", "content": list(user_parts)}, {"role": "assistant", "content": answer}]}


def _image(name):
    return {"type": "image", "path": f"images/{name}"}


def _text(text):
    return {"type": "text", "text": text}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_layout_is_the_image_processors_own(family, folder):
    """Each image becomes exactly the tokens the processor's own rule writes for it (Qwen2VLProcessor's and
    Qwen3VLProcessor's replace_image_token, transformers' own functions, applied to the image processor's output for
    the pixels: one <|image_pad|> per grid_t x grid_h x grid_w / merge_size**2; the processor classes themselves need
    a video processor, which needs torchvision), here counted from the file's size alone; the whole token sequence
    equals the processor's text tokenized; the image processor is the one the model's config gives (Qwen3-VL: its
    [-1, 1] normalization); the pixels and mm_token_type_ids collate gives are the processor's."""
    from types import SimpleNamespace

    from transformers import Qwen2VLProcessor, Qwen3VLProcessor
    from transformers.image_utils import OPENAI_CLIP_MEAN

    from finetune.data.images import layout_for

    tok = load_tokenizer(tokenizer_config(family), model_config(family))
    layout = layout_for(tok)
    assert list(layout.processor.image_mean) == ([0.5] * 3 if family == "qwen3_vl" else list(OPENAI_CLIP_MEAN))
    rule = {"qwen2_vl": Qwen2VLProcessor, "qwen3_vl": Qwen3VLProcessor}[family].replace_image_token
    as_processor = SimpleNamespace(image_processor=layout.processor, image_token="<|image_pad|>")
    for names in (["red.png"], ["blue.png", "green.png"], ["yellow.png", "red.png", "green.png"]):
        row = _row(_text("Look:"), *[_image(n) for n in names], _text("what colors?"))
        sample = tokenize_example(_example(row, folder), tok)
        out = layout.processor(images=[Image.open(folder / "images" / n).convert("RGB") for n in names],
                               return_tensors="pt")
        rendered = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                                                         *[{"type": "image"}] * len(names),
                                                                         {"type": "text", "text": "what colors?"}]},
                                            {"role": "assistant", "content": "It is red."}], tokenize=False)
        for k in range(len(names)):  # the processor's replace_image_token, in order
            rendered = rendered.replace("<|image_pad|>", "\0" + rule(as_processor, out, k).replace("<|image_pad|>", "\1"), 1)
        expected = tok(rendered.replace("\0", "").replace("\1", "<|image_pad|>"), add_special_tokens=False)["input_ids"]
        assert sample["input_ids"] == expected
        grids = out["image_grid_thw"]
        items = sample["images"]["items"]
        assert [item["features"] for item in items] == [t * h * w // 4 for t, h, w in grids.tolist()]
        for item in items:  # <|vision_start|>, the image tokens, <|vision_end|>
            span = sample["input_ids"][item["start"]:item["start"] + item["length"]]
            assert tok.convert_ids_to_tokens([span[0], span[-1]]) == ["<|vision_start|>", "<|vision_end|>"]
            assert len(span) == item["features"] + 2
        batch = collate([sample], DataConfig(packing=False), tok.pad_token_id)
        assert torch.equal(batch.vision.inputs["pixel_values"], out["pixel_values"])
        assert torch.equal(batch.vision.inputs["image_grid_thw"], grids)
        image_id = tok.convert_tokens_to_ids("<|image_pad|>")
        assert batch.vision.inputs["mm_token_type_ids"].tolist() == [[int(t == image_id) for t in expected]]


def test_llava_layout_is_llava_processors_own(folder):
    """LLaVA: the whole token sequence equals LlavaProcessor's (transformers' own processor, built offline around
    the same tokenizer and image processor), for images of different sizes; the image tokens never trained."""
    from transformers import LlavaProcessor

    from finetune.data.images import layout_for

    tok = load_tokenizer(tokenizer_config("llava"), model_config("llava"))
    layout = layout_for(tok)
    processor = LlavaProcessor(image_processor=layout.processor, tokenizer=tok, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    image_id = tok.convert_tokens_to_ids("<image>")
    for names in (["red.png"], ["blue.png", "green.png", "yellow.png"]):
        row = _row(_text("Look:"), *[_image(n) for n in names], _text("what colors?"))
        sample = tokenize_example(_example(row, folder), tok)
        rendered = tok.apply_chat_template(_example(row, folder).messages, tokenize=False)
        images = [Image.open(folder / "images" / n) for n in names]
        expected = processor(text=[rendered], images=images)["input_ids"][0]
        assert sample["input_ids"] == list(expected)
        assert [item["features"] for item in sample["images"]["items"]] == [16] * len(names)
        assert not any(t == image_id for t, label in zip(sample["input_ids"], sample["labels"]) if label != -100)


@pytest.fixture(scope="module")
def gemma3_tok():
    return load_tokenizer(tokenizer_config("gemma3"), model_config("gemma3"))


def _gemma3_processor(tok, tmp_path):
    """transformers' own Gemma3Processor around the same tokenizer (reloaded with the boi/eoi/image token attributes
    the processor reads; the same ids) and image processor."""
    from transformers import AutoTokenizer, Gemma3Processor

    from finetune.data.images import layout_for

    tok.save_pretrained(tmp_path / "tok")
    named = AutoTokenizer.from_pretrained(tmp_path / "tok", extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    return Gemma3Processor(image_processor=layout_for(tok).processor, tokenizer=named, image_seq_length=4)


def test_gemma3_layout_is_gemma3_processors_own(gemma3_tok, folder):
    """Gemma 3: the whole token sequence equals Gemma3Processor's ("\n\n<start_of_image>", mm_tokens_per_image
    <image_soft_token>, "<end_of_image>\n\n" per image), for images of different sizes, with the shipped gemma3
    template; the token_type_ids collate gives the model (its bidirectional image blocks) are the processor's; an
    image's extent is <start_of_image> to <end_of_image>; no image or vision token is trained, even in a trained
    message or with train_on_inputs."""
    tok = gemma3_tok
    processor = _gemma3_processor(tok, folder)
    vision_ids = set(tok.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"]))
    for names in (["red.png"], ["blue.png", "green.png", "yellow.png"]):
        row = _row(_text("Look:"), *[_image(n) for n in names], _text("what colors?"))
        example = _example(row, folder)
        sample = tokenize_example(example, tok)
        rendered = tok.apply_chat_template(example.messages, tokenize=False)
        expected = processor(text=[rendered], images=[[Image.open(folder / "images" / n) for n in names]],
                             return_tensors="pt")
        assert sample["input_ids"] == expected["input_ids"][0].tolist()
        batch = collate([sample], DataConfig(packing=False), tok.pad_token_id)
        assert torch.equal(batch.vision.inputs["token_type_ids"], expected["token_type_ids"])
        assert torch.equal(batch.vision.inputs["pixel_values"], expected["pixel_values"])
        for item in sample["images"]["items"]:
            span = sample["input_ids"][item["start"]:item["start"] + item["length"]]
            assert tok.convert_ids_to_tokens(span) == ["<start_of_image>", *["<image_soft_token>"] * 4,
                                                       "<end_of_image>"] and item["features"] == 4
    row = _row(_text("Draw it."), answer=[_text("Here:"), _image("red.png"), _text("done")])
    for train_on_inputs in (False, True):
        sample = tokenize_example(_example(row, folder, train_on_inputs=train_on_inputs), tok)
        trained = [t for t, label in zip(sample["input_ids"], sample["labels"]) if label != IGNORE_INDEX]
        assert not vision_ids & set(trained) and "done" in tok.decode(trained)
        assert sum(t in vision_ids for t in sample["input_ids"]) == 6


def _assert_cut_only_outside_the_image(tok, folder) -> None:
    """A max_seq_len that ends inside the image's tokens drops the sample (saying why); at either edge it is kept."""
    row = _row(_text("Hi"), _image("green.png"), _text("what color is this one?"))
    item = tokenize_example(_example(row, folder), tok)["images"]["items"][0]
    for length, kept in ((item["start"] + 1, False), (item["start"] + item["length"] - 1, False),
                         (item["start"], True), (item["start"] + item["length"], True)):
        stats = DataStats()
        samples = tokenize_examples([_example(row, folder)], tok, DataConfig(max_seq_len=length), stats)
        assert bool(samples) == kept, length
        if not kept:
            assert "inside the tokens of image 0" in stats.dropped_examples[0]


def _assert_a_flipped_image_is_refused(tok, folder, message: str) -> None:
    """yellow.png (16 x 48) replaced by a 48 x 16 image after tokenizing: as many features, the grid the other way;
    collate refuses the sample rather than feed it pixels of another layout."""
    sample = tokenize_example(_example(_row(_image("yellow.png")), folder), tok)
    Image.new("RGB", (48, 16), "yellow").save(folder / "images" / "yellow.png")
    with pytest.raises(UserError, match=message):
        collate([sample], DataConfig(packing=False), tok.pad_token_id)


def test_gemma3_cut_inside_an_image_drops_the_sample(gemma3_tok, folder):
    _assert_cut_only_outside_the_image(gemma3_tok, folder)


def test_gemma3_processor_settings_it_cannot_lay_out_are_refused(folder):
    row = _row(_image("red.png"), _text("color?"))
    for overrides, message in (({"do_pan_and_scan": True}, "do_pan_and_scan is not supported for gemma3"),
                               ({"size": {"height": 64, "width": 64}}, "takes 32x32 images")):
        tok = load_tokenizer(tokenizer_config("gemma3"), model_config("gemma3").model_copy(
            update={"image_processor": overrides}))
        with pytest.raises(UserError, match=message):
            tokenize_example(_example(row, folder), tok)


@pytest.fixture(scope="module")
def smolvlm_tok():
    return load_tokenizer(tokenizer_config("smolvlm"), model_config("smolvlm"))


# (width, height): portrait, landscape, one tile, just over one, odd sizes, far over the longest edge.
_SMOL_SIZES = [(1, 1), (32, 32), (33, 32), (31, 33), (40, 30), (64, 20), (20, 64), (100, 90), (17, 300), (300, 17),
               (129, 65), (1000, 700)]


def test_smolvlm_grid_is_the_image_processors_own():
    """Each image's tile grid (rows x cols), computed from its size alone, is the one SmolVLMImageProcessorPil makes
    of its pixels, for sizes around and far over the tiles, with splitting on (the test's longest edge 64, and 4 x
    the tile, the default) and off."""
    from finetune.data.images import layout_for

    for overrides in ({"size": {"longest_edge": 64}}, {}, {"do_image_splitting": False}):
        tok = load_tokenizer(tokenizer_config("smolvlm"), model_config("smolvlm").model_copy(
            update={"image_processor": overrides}))
        layout = layout_for(tok)
        for width, height in _SMOL_SIZES:
            out = layout.processor(images=[Image.new("RGB", (width, height), "red")])
            grid = layout.grid(height, width)
            assert [out["rows"][0][0], out["cols"][0][0]] == grid, (overrides, width, height)
            assert layout.tokens(height, width) == 4 * (grid[0] * grid[1] + 1)


def test_smolvlm_layout_is_smolvlm_processors_own(smolvlm_tok, folder):
    """SmolVLM: the whole token sequence equals what SmolVLMProcessor writes: each <image> replaced by
    get_image_prompt_string of the grid the image processor returns for the pixels (its replace_image_token; the
    processor class itself needs num2words, not installed here), tokenized; the tile markers and newlines between
    them are the image's and never trained; the pixel values are the processor's."""
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    from finetune.data.images import layout_for

    tok, processor = smolvlm_tok, layout_for(smolvlm_tok).processor
    for names in (["red.png"], ["blue.png", "green.png", "yellow.png"]):
        row = _row(_text("Look:"), *[_image(n) for n in names], _text("what colors?"))
        example = _example(row, folder)
        sample = tokenize_example(example, tok)
        rendered = tok.apply_chat_template(example.messages, tokenize=False)
        out = processor(images=[Image.open(folder / "images" / n).convert("RGB") for n in names], return_tensors="pt")
        for rows, cols in zip(out["rows"][0], out["cols"][0]):
            rendered = rendered.replace("<image>", "\0" + get_image_prompt_string(
                rows, cols, 4, "<fake_token_around_image>", "<image>", "<global-img>").replace("<image>", "\1"), 1)
        expected = tok(rendered.replace("\0", "").replace("\1", "<image>"), add_special_tokens=False)["input_ids"]
        assert sample["input_ids"] == expected
        batch = collate([sample], DataConfig(packing=False), tok.pad_token_id)
        assert torch.equal(batch.vision.inputs["pixel_values"], out["pixel_values"])
        for item, rows, cols in zip(sample["images"]["items"], out["rows"][0], out["cols"][0]):
            span = sample["input_ids"][item["start"]:item["start"] + item["length"]]
            assert item["grid"] == [rows, cols] and span.count(layout_for(tok).image_id) == item["features"]
            assert tok.convert_ids_to_tokens([span[0], span[-1]]) == ["<fake_token_around_image>"] * 2
            assert all(label == IGNORE_INDEX for label in
                       sample["labels"][item["start"]:item["start"] + item["length"]])


def test_smolvlm_cuts_changed_images_and_settings_it_cannot_lay_out(smolvlm_tok, folder):
    _assert_cut_only_outside_the_image(smolvlm_tok, folder)
    # yellow.png: 2 x 1 tiles, then 1 x 2
    _assert_a_flipped_image_is_refused(smolvlm_tok, folder,
                                       "yellow.png is split into a 1x2 grid and its sample was laid out for 2x1")
    for overrides, message in (({"max_image_size": {"longest_edge": 64}}, "takes 32x32 tiles"),
                               ({"size": {"height": 64, "width": 64}}, "size must be {longest_edge: N}")):
        tok = load_tokenizer(tokenizer_config("smolvlm"), model_config("smolvlm").model_copy(
            update={"image_processor": overrides}))
        with pytest.raises(UserError, match=message):
            tokenize_example(_example(_row(_image("red.png")), folder), tok)


def _pixtral_rule(out, image_idx, patch_size=8, spatial_merge_size=2):
    """PixtralProcessor.replace_image_token of transformers 5.23.0, line for line (processing_pixtral.py cannot be
    imported without torchvision)."""
    patch_size = patch_size * spatial_merge_size
    height, width = out["image_sizes"][image_idx]
    num_height_tokens = height // patch_size
    num_width_tokens = width // patch_size
    replace_tokens = [["[IMG]"] * num_width_tokens + ["[IMG_BREAK]"]] * num_height_tokens
    replace_tokens = [item for sublist in replace_tokens for item in sublist]
    replace_tokens[-1] = "[IMG_END]"
    return "".join(replace_tokens)


@pytest.fixture(scope="module")
def mistral3_tok():
    return load_tokenizer(tokenizer_config("mistral3"), model_config("mistral3"))


def test_mistral3_layout_is_pixtral_processors_own(mistral3_tok, folder):
    """Mistral 3: each image's grid of merged patches, computed from its size alone, is the one
    PixtralImageProcessorPil makes of its pixels (called with patch_size x spatial_merge_size, as PixtralProcessor
    calls it) for sizes around and far over the bound; the whole token sequence equals PixtralProcessor's
    replace_image_token rule (_pixtral_rule: its module imports torchvision, so it is reproduced here) applied to the
    image processor's output, tokenized; the pixels and image_sizes collate gives are the processor's; every [IMG],
    [IMG_BREAK] and [IMG_END] of an image is in its span and untrained, even inside a trained message."""
    from finetune.data.images import layout_for

    tok, processor = mistral3_tok, layout_for(mistral3_tok).processor
    for width, height in [*_SMOL_SIZES, (3, 40), (40, 3), (64, 64), (65, 64), (48, 16)]:
        out = processor(images=[Image.new("RGB", (width, height), "red")], patch_size=16)
        grid = layout_for(tok).grid(height, width)
        assert [n // 16 for n in out["image_sizes"][0]] == grid, (width, height)
        assert layout_for(tok).tokens(height, width) == grid[0] * grid[1]
    vision_ids = set(tok.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"]))
    for names in (["red.png"], ["blue.png", "green.png", "yellow.png"]):
        row = _row(_text("Look:"), *[_image(n) for n in names], answer=[_text("Here:"), _image("red.png"), _text("ok")])
        example = _example(row, folder)
        sample = tokenize_example(example, tok)
        rendered = tok.apply_chat_template(example.messages, tokenize=False)
        images = [Image.open(folder / "images" / n).convert("RGB") for n in [*names, "red.png"]]
        out = processor(images=images, patch_size=16, return_tensors="pt")
        for k in range(len(images)):
            rendered = rendered.replace("[IMG]", "\0" + _pixtral_rule(out, k)
                                        .replace("[IMG]", "\1"), 1)
        expected = tok(rendered.replace("\0", "").replace("\1", "[IMG]"), add_special_tokens=False)["input_ids"]
        assert sample["input_ids"] == expected
        batch = collate([sample], DataConfig(packing=False), tok.pad_token_id)
        assert torch.equal(batch.vision.inputs["pixel_values"], out["pixel_values"])
        assert torch.equal(batch.vision.inputs["image_sizes"], out["image_sizes"])
        for item in sample["images"]["items"]:
            span = sample["input_ids"][item["start"]:item["start"] + item["length"]]
            assert tok.convert_ids_to_tokens([span[0], span[-1]]) == ["[IMG]", "[IMG_END]"]
            assert span.count(layout_for(tok).image_id) == item["features"] == item["grid"][0] * item["grid"][1]
            assert span.count(tok.convert_tokens_to_ids("[IMG_BREAK]")) == item["grid"][0] - 1
        trained = [t for t, label in zip(sample["input_ids"], sample["labels"]) if label != IGNORE_INDEX]
        assert not vision_ids & set(trained) and tok.decode(trained) == "Here:ok<|im_end|>"


def test_mistral3_cuts_changed_images_and_settings_it_cannot_lay_out(mistral3_tok, folder):
    _assert_cut_only_outside_the_image(mistral3_tok, folder)
    # yellow.png: 3 x 1 merged patches, then 1 x 3
    _assert_a_flipped_image_is_refused(mistral3_tok, folder,
                                       "yellow.png is split into a 1x3 grid and its sample was laid out for 3x1")
    for overrides, message in (({"do_resize": False}, "laid out for do_resize: true"),
                               ({"size": {"shortest_edge": 64}}, "size must be {longest_edge: N}"),
                               ({"patch_size": {"height": 8, "width": 8}}, "patch_size: mistral3's layout needs")):
        with pytest.raises(UserError, match=message):
            tok = load_tokenizer(tokenizer_config("mistral3"), model_config("mistral3").model_copy(
                update={"image_processor": overrides}))
            tokenize_example(_example(_row(_image("red.png")), folder), tok)


def test_only_the_trained_messages_text_is_trained(tok, folder):
    vision_ids = set(tok.convert_tokens_to_ids(VISION_TOKENS))
    row = _row(_image("green.png"), _text("What color?"), answer=[_text("It is green.")])
    sample = tokenize_example(_example(row, folder), tok)
    trained = [t for t, label in zip(sample["input_ids"], sample["labels"]) if label != IGNORE_INDEX]
    assert tok.decode(trained) == "It is green.<|im_end|>"
    # train_on_inputs: the prompt's text is trained too, and still no image or vision token
    sample = tokenize_example(_example(row, folder, train_on_inputs=True), tok)
    labelled = [t for t, label in zip(sample["input_ids"], sample["labels"]) if label != IGNORE_INDEX]
    assert "What color?" in tok.decode(labelled)
    assert not vision_ids & set(labelled)
    assert sum(t in vision_ids for t in sample["input_ids"]) == 2 + sample["images"]["items"][0]["features"]
    # an image in the trained message itself: its tokens stay untrained, the text around them is trained
    row = _row(_text("Draw it."), answer=[_text("Here:"), _image("red.png"), _text("done")])
    sample = tokenize_example(_example(row, folder), tok)
    trained = [t for t, label in zip(sample["input_ids"], sample["labels"]) if label != IGNORE_INDEX]
    assert tok.decode(trained) == "Here:done<|im_end|>" and not vision_ids & set(trained)


def test_a_cut_inside_an_image_drops_the_sample_and_names_it(tok, folder):
    row = _row(_text("Hi"), _image("green.png"), _text("what color is this one?"))
    full = tokenize_example(_example(row, folder), tok)
    item = full["images"]["items"][0]
    cases = {"inside": item["start"] + 3, "after": item["start"] + item["length"] + 2, "before": item["start"]}
    for where, length in cases.items():
        stats = DataStats()
        samples = tokenize_examples([_example(row, folder)], tok, DataConfig(max_seq_len=length), stats)
        if where == "inside":
            assert samples == [] and stats.dropped_too_long == 1 and stats.dropped_tokens == len(full["input_ids"])
            assert stats.dropped_examples[0].startswith("data/t.jsonl:7: data.max_seq_len")
            assert "inside the tokens of image 0" in stats.dropped_examples[0]
        else:
            (sample,) = samples
            assert len(sample["input_ids"]) == length and stats.truncated == 1
            assert ("images" in sample) == (where == "after")


def test_bad_image_parts_are_bad_rows_naming_the_row(tok, folder):
    cases = [
        ({"type": "video", "path": "v.mp4"}, "part 0 is 'video'"),
        ({"type": "image"}, "part 0 (image) needs a 'path'"),
        ({"type": "image", "path": "images/missing.png"}, "'images/missing.png' is not a file"),
        ({"type": "image", "path": "https://example.com/a.png"}, "remote images are not supported"),
        ({"type": "image", "path": "images/red.png", "detail": "high"}, "has 'detail'"),
        ({"type": "text", "text": 3}, "needs a string 'text'"),
    ]
    for part, message in cases:
        with pytest.raises(BadRow, match="data/t.jsonl:7: message 0, part 0") as e:
            _example(_row(part), folder)
        assert message in str(e.value)
    (folder / "images" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(BadRow, match="data/t.jsonl:7: the image .*broken.png cannot be read"):
        tokenize_example(_example(_row(_image("broken.png")), folder), tok)


def test_images_need_a_vision_model_and_a_template_that_renders_them(tok, folder):
    text_only = load_tokenizer(TokenizerConfig(path=tokenizer_config().path), ModelConfig(init="random"))
    with pytest.raises(UserError, match="data/t.jsonl:7: this row has images, and the model is not a vision"):
        tokenize_example(_example(_row(_image("red.png")), folder), text_only)
    chatml = load_tokenizer(tokenizer_config().model_copy(update={"chat_template": "chatml"}), model_config())
    with pytest.raises(BadRow, match="refused this conversation: .*content parts need a template that renders them"):
        tokenize_example(_example(_row(_image("red.png")), folder), chatml)
    as_text = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"  # the list's repr
    printed = load_tokenizer(tokenizer_config().model_copy(update={"chat_template": as_text}), model_config())
    with pytest.raises(BadRow, match="rendered 0 image placeholders .* for 1 images"):
        tokenize_example(_example(_row(_image("red.png")), folder), printed)
    # text that spells the placeholder would shift every image after it: refused
    with pytest.raises(BadRow, match="rendered 2 image placeholders"):
        tokenize_example(_example(_row(_text("<|image_pad|>"), _image("red.png")), folder), tok)


def test_collate_makes_the_pixels_and_refuses_a_changed_image(tok, tmp_path):
    data = write_data(tmp_path, n=4)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    samples = [tokenize_example(_example(row, tmp_path), tok) for row in rows]
    batch = collate(samples, DataConfig(packing=False), tok.pad_token_id)
    items = [item for s in samples if "images" in s for item in s["images"]["items"]]
    assert batch.vision is not None and batch.vision.images == len(items) == 4
    grid = batch.vision.inputs["image_grid_thw"]
    assert grid.prod(-1).sum() == batch.vision.inputs["pixel_values"].shape[0]
    assert int(batch.vision.inputs["mm_token_type_ids"].sum()) == sum(item["features"] for item in items)
    assert collate(samples[3:], DataConfig(packing=False), tok.pad_token_id).vision is None  # no image in it
    Image.new("RGB", (160, 160), "red").save(tmp_path / "images" / IMAGES[0][0])  # replaced by a larger image
    with pytest.raises(UserError, match="red.png gives 16 image features and its sample was laid out for 4"):
        collate(samples, DataConfig(packing=False), tok.pad_token_id)


def test_preprocess_show_marks_the_images(tok, folder):
    from rich.console import Console

    sample = tokenize_example(_example(_row(_image("blue.png"), _text("What color?"), answer="blue"), folder), tok)
    out = io.StringIO()
    print_sample(Console(file=out, width=200), tok, sample, "sample 0")
    text = out.getvalue()
    assert "1 images" in text and "<<image blue.png 64x20: 6 tokens, 4 features>>What color?" in text
    assert "[[blue<|im_end|>]]" in text and "<|image_pad|>" not in text


def test_rows_with_images_are_counted_like_any(tok, folder):
    """The token accounting balances with images: input = kept + truncated + dropped."""
    rows = [_row(_image(name), _text("color?")) for name, _, _ in IMAGES]
    stats = DataStats()
    samples = tokenize_examples([_example(r, folder, f"d.jsonl:{i}") for i, r in enumerate(rows)], tok,
                                DataConfig(max_seq_len=40), stats)
    assert stats.input_tokens == stats.tokens + stats.truncated_tokens + stats.dropped_tokens
    assert stats.samples == len(samples) and stats.samples + stats.dropped_too_long == len(rows)
    assert all(len(s["input_ids"]) <= 40 for s in samples)
    assert torch.tensor([s["labels"][0] for s in samples]).eq(IGNORE_INDEX).all()


def test_the_shapes_example_data_regenerates_byte_for_byte(tmp_path):
    """examples/data/shapes is what scripts/make_shapes_data.py writes, rows and images."""
    import subprocess
    import sys

    from vision_fixtures import ROOT

    shipped = ROOT / "examples" / "data" / "shapes"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_shapes_data.py"), "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert made == sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file())
    assert all((tmp_path / p).read_bytes() == (shipped / p).read_bytes() for p in made)
    rows = [json.loads(line) for line in (shipped / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 600 and all(len(r["messages"]) == 6 for r in rows)
