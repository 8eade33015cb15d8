"""Run-level features with image rows (tiny random Qwen2-VL, the vision encoder training too): a run stopped after a
checkpoint and resumed equals the uninterrupted run bit for bit, and DDP and FSDP2 on 2 gloo ranks equal one
process within the tolerances of the text tests (tests/run/test_resume.py, tests/train/test_distributed.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import assert_same_steps, final_weights, rel_diff, run_ranks, train_lines
from vision_fixtures import recipe_yaml, write_data

from finetune.recipe import load_recipe

# 8 rows of 0, 1 or 2 images of four sizes, 2 rows a step: 4 steps, a checkpoint after step 2. Dropout in the
# language model's attention, so that the resume must restore the RNG too.
RESUME = ["model.freeze_vision=false", "model.config.text_config.attention_dropout=0.1", "train.max_steps=4",
          "checkpoint.every_steps=2", "checkpoint.keep_last=2"]


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm-runs")
    data = write_data(folder / "data", n=16)
    (folder / "vlm.yaml").write_text(recipe_yaml(data))
    return folder / "vlm.yaml"


def _train(recipe_file, out, *overrides: str) -> None:
    from finetune.train.loop import train

    train(load_recipe(recipe_file, [f"output_dir={out}", "datasets.0.max_rows=8", *overrides]))


@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_resume_with_images_is_bitwise_identical(recipe_file, tmp_path, capsys, adapter):
    """4 steps straight vs the same run stopped after its step-2 checkpoint and resumed (`resume: auto`): the same
    losses, grad norms and final weights, bit for bit (as for text)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(recipe_file, straight, *RESUME, f"adapter.type={adapter}")
    shutil.copytree(straight, resumed)
    # What a run stopped right after step 2 would have left.
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-4")
    capsys.readouterr()
    _train(recipe_file, resumed, *RESUME, f"adapter.type={adapter}", "resume=auto")
    out = capsys.readouterr().out
    assert "resumed from" in out and "step-2" in out, out[-2000:]
    a, b = train_lines(straight), train_lines(resumed)
    assert [(x["step"], x["loss"], x["grad_norm"]) for x in a] == [(x["step"], x["loss"], x["grad_norm"]) for x in b]
    assert [x["step"] for x in b] == [1, 2, 3, 4]
    wa, wb = final_weights(straight), final_weights(resumed)
    assert wa.keys() == wb.keys() and wa
    if adapter == "none":
        assert any(name.startswith("visual.blocks.") for name in wa)  # the vision encoder trained and is compared
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


# One process, micro 8 x accumulation 1, 2 steps of 16 rows; 2 ranks run micro 2 x accumulation 2.
DIST = ["model.freeze_vision=false", "train.max_steps=2"]


@pytest.fixture(scope="module")
def one_process(recipe_file, tmp_path_factory):
    from finetune.train.loop import train

    out = tmp_path_factory.mktemp("vlm-one") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FINETUNE_DEVICE", "cpu")  # where the gloo ranks compute, on a CUDA machine too
        train(load_recipe(recipe_file, [f"output_dir={out}", *DIST, "train.micro_batch_size=8",
                                        "train.gradient_accumulation_steps=1"]))
    return out


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_with_images_equal_one_process(recipe_file, one_process, tmp_path, strategy):
    """The same logged losses and grad norms (relative <= 1e-5) and final weights (||a - b|| / ||b|| <= 1e-5 per
    tensor, the vision encoder's included), as tests/train/test_distributed.py holds text runs to."""
    out = tmp_path / "run"
    r = run_ranks(2, "train", str(recipe_file), f"output_dir={out}", *DIST, "train.micro_batch_size=2",
                  "train.gradient_accumulation_steps=2", f"distributed.strategy={strategy}", env={"FINETUNE_DEVICE": "cpu"})
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "world size 2" in r.stdout
    ref = train_lines(one_process)
    assert [x["step"] for x in ref] == [1, 2]
    assert_same_steps(train_lines(out), ref, equal=("tokens", "seq_tokens"))
    got, want = final_weights(out), final_weights(one_process)
    assert set(got) == set(want) and any(name.startswith("visual.blocks.") for name in want)
    for name in want:
        assert rel_diff(got[name], want[name]) <= 1e-5, (name, rel_diff(got[name], want[name]))


def test_a_resume_after_an_image_changed_is_refused(tmp_path):
    """An image file rewritten under its own name (same size, other pixels) changes the training data, though no
    path or recipe key does: the data cache rebuilds its entry under the same key, and the resume must be refused
    as for changed text, not continue on other data."""
    from PIL import Image

    from finetune.errors import UserError
    from finetune.train.loop import train

    data = write_data(tmp_path / "data", n=8)
    (tmp_path / "vlm.yaml").write_text(recipe_yaml(data))
    args = [f"output_dir={tmp_path / 'run'}", "train.max_steps=4", "checkpoint.every_steps=2",
            f"data.cache_dir={tmp_path / 'cache'}"]
    train(load_recipe(tmp_path / "vlm.yaml", args))
    shutil.rmtree(tmp_path / "run" / "final")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-4")
    image = next((data.parent / "images").glob("*.png"))
    size = Image.open(image).size
    Image.new("RGB", size, "olive").save(image)
    with pytest.raises(UserError, match="the training images' bytes"):
        train(load_recipe(tmp_path / "vlm.yaml", [*args, "resume=auto"]))
