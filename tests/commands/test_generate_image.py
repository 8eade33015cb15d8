"""`finetune generate RUN --image PATH --prompt TEXT` on tiny random Qwen2-VL and LLaVA runs (one training step each,
in-process).

Generation from a model trained to answer about images would take minutes; what is checked instead is that the
images reach the model as training gave them: the prompt's token ids and image inputs equal what transformers' own
processor makes of the same rendering and images (Qwen2VLProcessor's rule, LlavaProcessor itself), `complete` gives
token for token what a hand-built `model.generate` call on the processor's output gives, and two images of the same
size (the same token ids) but different pixels change the model's next-token logits. Bad inputs are UserErrors.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import run_cli
from PIL import Image
from vision_fixtures import bomb_png, recipe_yaml, write_data

from finetune.commands.generate import (
    GenerationOptions,
    complete,
    generate,
    load_for_inference,
    render_prompt,
)
from finetune.commands.image_prompt import prompt_inputs, user_content
from finetune.data.images import layout_for
from finetune.errors import UserError
from finetune.recipe import load_recipe

PROMPT = "What color is this?"
GREEDY = GenerationOptions(max_new_tokens=6, min_new_tokens=6)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from finetune.train.loop import train

    folder = tmp_path_factory.mktemp("vlm-gen")
    data = write_data(folder / "data", n=4)
    (folder / "vlm.yaml").write_text(recipe_yaml(data))
    train(load_recipe(folder / "vlm.yaml", [f"output_dir={folder / 'run'}", "train.max_steps=1"]))
    return folder / "run"


@pytest.fixture(scope="module")
def loaded(run_dir):
    return load_for_inference(str(run_dir))


@pytest.fixture(scope="module")
def images(run_dir):
    return run_dir.parent / "data" / "images"


def _messages(n_images: int) -> list[dict]:
    return [{"role": "user", "content": user_content(PROMPT, n_images)}]


def _processor_inputs(tokenizer, rendered: str, paths) -> dict:
    """What transformers' Qwen2VLProcessor makes of the rendering and images, around the run's image processor: its
    image processor's output, each <|image_pad|> replaced by Qwen2VLProcessor.replace_image_token (its own rule), the
    text tokenized, mm_token_type_ids 1 at image tokens. Built by hand because the processor's constructor wants a
    video processor, which needs torchvision (not installed)."""
    from types import SimpleNamespace

    from transformers import Qwen2VLProcessor

    image_processor = layout_for(tokenizer).processor
    out = image_processor(images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
    this = SimpleNamespace(image_processor=image_processor, image_token="<|image_pad|>")
    text = rendered
    for k in range(len(paths)):
        text = text.replace("<|image_pad|>", "\0" * int(Qwen2VLProcessor.replace_image_token(this, out, k).count(
            "<|image_pad|>")), 1)
    ids = tokenizer(text.replace("\0", "<|image_pad|>"), add_special_tokens=False, return_tensors="pt")["input_ids"]
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"], "mm_token_type_ids": (ids == image_id).to(torch.int32)}


def test_image_prompt_equals_the_processors_own_and_generates_the_same(loaded, images):
    """Two images of different sizes, then the text: the rendering holds the images first; input ids, pixel values,
    grids and mm_token_type_ids equal those Qwen2VLProcessor's rule makes exactly, and greedy `complete` equals model.generate on the
    processor's output, token for token."""
    model, tokenizer = loaded
    paths = [str(images / "green.png"), str(images / "blue.png")]
    rendered = render_prompt(tokenizer, _messages(2))
    assert rendered.index("<|vision_start|>") < rendered.index(PROMPT)
    assert rendered.count("<|image_pad|>") == 2
    ours = prompt_inputs(tokenizer, rendered, paths)
    theirs = _processor_inputs(tokenizer, rendered, paths)
    assert set(ours) == set(theirs) == {"input_ids", "attention_mask", "pixel_values", "image_grid_thw",
                                        "mm_token_type_ids"}
    for key in ours:
        assert torch.equal(ours[key], theirs[key].to(ours[key].dtype)), key
    assert int(ours["mm_token_type_ids"].sum()) > 2 * 4  # both images laid out, several tokens each

    reply = complete(model, tokenizer, _messages(2), GREEDY, stream=None, images=paths)
    with torch.inference_mode():
        out = model.generate(**theirs, max_new_tokens=6, min_new_tokens=6, do_sample=False, top_k=None,
                             top_p=None, temperature=None, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    assert reply.token_ids == tuple(out[0, theirs["input_ids"].shape[1]:].tolist())
    assert reply.new_tokens == 6


def test_the_images_pixels_reach_the_model(loaded, images, tmp_path):
    """The same prompt with two images of one size (the same token ids) but other pixels: the next-token logits
    differ (more than 1e-3 of their scale), while the same image twice gives them bit for bit."""
    model, tokenizer = loaded
    size = Image.open(images / "red.png").size
    Image.open(images / "green.png").convert("RGB").resize(size).save(tmp_path / "green-resized.png")
    rendered = render_prompt(tokenizer, _messages(1))

    def logits(path) -> torch.Tensor:
        inputs = prompt_inputs(tokenizer, rendered, [str(path)])
        with torch.inference_mode():
            return model(**inputs).logits[0, -1], inputs["input_ids"]

    red, red_ids = logits(images / "red.png")
    green, green_ids = logits(tmp_path / "green-resized.png")
    assert torch.equal(red_ids, green_ids)
    assert torch.equal(red, logits(images / "red.png")[0])
    assert (red - green).abs().max() > 1e-3 * red.abs().max()


def test_a_text_prompt_on_a_vision_language_run(loaded):
    """Without --image the prompt is text alone: no image inputs, and the model still answers."""
    model, tokenizer = loaded
    rendered = render_prompt(tokenizer, _messages(0))
    assert "<|vision_start|>" not in rendered and set(prompt_inputs(tokenizer, rendered, [])) == {"input_ids",
                                                                                                 "attention_mask"}
    assert len(complete(model, tokenizer, _messages(0), GREEDY, stream=None).token_ids) == 6


def test_bad_images_and_prompts_are_user_errors(run_dir, loaded, images, tmp_path):
    model, tokenizer = loaded
    with pytest.raises(UserError, match="--image .*missing.png: does not exist"):
        generate(str(run_dir), PROMPT, GREEDY, images=[str(tmp_path / "missing.png")])
    (tmp_path / "broken.png").write_text("not an image")
    with pytest.raises(UserError, match="broken.png cannot be read"):
        complete(model, tokenizer, _messages(1), GREEDY, stream=None, images=[str(tmp_path / "broken.png")])
    with pytest.raises(UserError, match=r"rendered 1 image placeholders .* for 0 images"):
        complete(model, tokenizer, [{"role": "user", "content": "spell <|image_pad|> here"}], GREEDY, stream=None)
    # 40 images of 12 tokens (100 x 90 pixels) and 2 markers each: past the 512 positions of the tiny language model.
    assert layout_for(tokenizer).tokens(90, 100) == 12
    many = [str(images / "green.png")] * 40
    with pytest.raises(UserError, match=r"the prompt has \d+ tokens \(480 of them for its images.*at most 512"):
        complete(model, tokenizer, _messages(40), GREEDY, stream=None, images=many)


def test_image_on_a_text_only_model_is_refused(images, tmp_path):
    from conftest import TINY_MODEL_CONFIG
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from vision_fixtures import TOKENIZER

    config = AutoConfig.for_model(**TINY_MODEL_CONFIG, vocab_size=512)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "text")
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(tmp_path / "text")
    with pytest.raises(UserError, match="--image: this model is text-only"):
        generate(str(tmp_path / "text"), PROMPT, GREEDY, images=[str(images / "red.png")])


def test_decompression_bombs_are_refused_unread(run_dir, loaded, tmp_path):
    """An image whose header says more pixels than data.max_image_pixels' default is a UserError naming it, before
    the model loads and before any pixel is decoded: never PIL's DecompressionBombError (a traceback) or warning."""
    model, tokenizer = loaded
    for side in (20000, 12000):  # over twice PIL's Image.MAX_IMAGE_PIXELS (it raises), over it (it warns)
        (tmp_path / f"bomb{side}.png").write_bytes(bomb_png(side, side))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(UserError, match=r"--image .*bomb20000\.png: the image is 20000x20000 \(400,000,000 "
                                            r"pixels\), over data\.max_image_pixels' default \(50,000,000\); resize it"):
            generate(str(tmp_path / "no-run-needed"), PROMPT, GREEDY, images=[str(tmp_path / "bomb20000.png")])
        with pytest.raises(UserError, match=r"bomb12000\.png: the image is 12000x12000 \(144,000,000 pixels\)"):
            complete(model, tokenizer, _messages(1), GREEDY, stream=None, images=[str(tmp_path / "bomb12000.png")])
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    result = run_cli("generate", str(run_dir), "--image", str(tmp_path / "bomb20000.png"), "--prompt", PROMPT)
    assert result.returncode == 2 and "bomb20000.png: the image is 20000x20000 (400,000,000 pixels)" in result.stderr
    assert "Traceback" not in result.stderr and "DecompressionBomb" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_cli_generate_with_images(run_dir, images):
    result = run_cli("generate", str(run_dir), "--image", str(images / "red.png"), "--image",
                     str(images / "yellow.png"), "--prompt", PROMPT, "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.endswith("\n")
    result = run_cli("generate", str(run_dir), "--image", "nowhere.png", "--prompt", PROMPT)
    assert result.returncode == 2 and "--image nowhere.png: does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_llava_image_prompt_equals_llava_processors_own(tmp_path):
    """LLaVA (a tiny random run, its final/ loaded as an HF model directory): the prompt's input ids and pixel values
    equal transformers' own LlavaProcessor's, and greedy `complete` equals model.generate on the processor's output."""
    from transformers import LlavaProcessor

    from finetune.train.loop import train

    data = write_data(tmp_path / "data", n=4)
    (tmp_path / "llava.yaml").write_text(recipe_yaml(data, "llava"))
    train(load_recipe(tmp_path / "llava.yaml", [f"output_dir={tmp_path / 'run'}", "train.max_steps=1"]))
    model, tokenizer = load_for_inference(str(tmp_path / "run" / "final"))
    paths = [str(tmp_path / "data" / "images" / name) for name in ("green.png", "yellow.png")]
    rendered = render_prompt(tokenizer, _messages(2))
    ours = prompt_inputs(tokenizer, rendered, paths)
    processor = LlavaProcessor(image_processor=layout_for(tokenizer).processor, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    theirs = dict(processor(text=[rendered], images=[Image.open(p).convert("RGB") for p in paths],
                            return_tensors="pt"))
    assert set(ours) == {"input_ids", "attention_mask", "pixel_values"}
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    reply = complete(model, tokenizer, _messages(2), GREEDY, stream=None, images=paths)
    with torch.inference_mode():
        out = model.generate(**{k: theirs[k] for k in ours}, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             top_k=None, top_p=None, temperature=None, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    assert reply.token_ids == tuple(out[0, theirs["input_ids"].shape[1]:].tolist())


@pytest.mark.parametrize("family", ["gemma3", "smolvlm"])
def test_generate_on_the_other_families_reaches_their_image_inputs(family, tmp_path):
    """Gemma 3 (token_type_ids) and SmolVLM (tiles): a one-step run answers with an image, and two images of one size
    but other pixels give other next-token logits (the same image twice: bit for bit)."""
    from finetune.train.loop import train

    data = write_data(tmp_path / "data", n=4)
    (tmp_path / "vlm.yaml").write_text(recipe_yaml(data, family))
    train(load_recipe(tmp_path / "vlm.yaml", [f"output_dir={tmp_path / 'run'}", "train.max_steps=1"]))
    model, tokenizer = load_for_inference(str(tmp_path / "run"))
    images = tmp_path / "data" / "images"
    size = Image.open(images / "red.png").size
    Image.open(images / "green.png").convert("RGB").resize(size).save(tmp_path / "green-resized.png")
    rendered = render_prompt(tokenizer, _messages(1))

    def logits(path) -> torch.Tensor:
        with torch.inference_mode():
            return model(**prompt_inputs(tokenizer, rendered, [str(path)])).logits[0, -1]

    red = logits(images / "red.png")
    assert torch.equal(red, logits(images / "red.png"))
    diff = (red - logits(tmp_path / "green-resized.png")).abs().max() / red.abs().max()
    assert diff > 1e-3  # measured: gemma3 1.2e-2, smolvlm 0.75
    reply = complete(model, tokenizer, _messages(1), GREEDY, stream=None, images=[str(images / "red.png")])
    assert reply.new_tokens == 6
