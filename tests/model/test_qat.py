"""Quantization-aware training (the recipe's qat: section, finetune/model/qat.py) on tiny Llamas.

The fake-quantized forward is torchao's own (the same logits, bit for bit, as torchao's QAT configured by hand), and
what is saved is what trained: the converted model's forward equals the fake-quantized one's. Through the CLI a QAT
run trains, records its scheme, switches fake quantization on at qat.fake_quant_after_n_steps and writes the
quantized model to final/, which `finetune eval` loads back with the run's last eval loss. The loss contract holds
with QAT on (finetune verify's check). Bad settings are refused: in the recipe, or when the model loads.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import TINY_MODEL_CONFIG
from helpers import QUICKSTART, TINY, eval_lines, one_thread, run_cli, train_lines

from finetune.errors import UserError
from finetune.model import qat
from finetune.model.loading import load_model
from finetune.recipe import AdapterConfig, ModelConfig, load_recipe
from finetune.recipe.qat import QATConfig

pytest.importorskip("torchao")
from torchao.quantization import quantize_  # noqa: E402
from torchao.quantization.qat import FakeQuantizedEmbedding, FakeQuantizedLinear, IntxFakeQuantizeConfig  # noqa: E402
from torchao.quantization.qat import QATConfig as TorchaoQAT  # noqa: E402

CPU = torch.device("cpu")
UNTIED = {**TINY_MODEL_CONFIG, "tie_word_embeddings": False}
QAT_8DA4W = ["qat.weight_dtype=int4", "qat.activation_dtype=int8"]


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _model(tokenizer, config: dict | None = None) -> torch.nn.Module:
    return load_model(ModelConfig(init="random", config=dict(config or TINY_MODEL_CONFIG)), AdapterConfig(),
                      tokenizer, seed=0)


def _ids() -> torch.Tensor:
    return torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(0))


def _logits(lm: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return lm(input_ids=ids).logits


def _by_hand(weights: str, acts: str | None, group: int) -> TorchaoQAT:
    """torchao's QAT configured by hand with its fake-quantization configs (its docs' int8-per-token-asymmetric
    activations, symmetric per-group weights), not through the post-training config finetune names."""
    act = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False) if acts else None
    return TorchaoQAT(activation_config=act, weight_config=IntxFakeQuantizeConfig(getattr(torch, weights),
                                                                                  group_size=group), step="prepare")


@pytest.mark.parametrize(("weights", "acts", "group"), [("int4", "int8", 32), ("int4", None, 16), ("int8", "int8", 32),
                                                        ("int8", None, 32)])
def test_the_fake_quantized_forward_is_torchaos_own(tokenizer, weights, acts, group):
    """The decoder's 14 linear layers (2 layers x q, k, v, o, gate, up, down) fake-quantized, the output layer not; the
    logits equal torchao's QAT configured by hand on the same weights exactly, and differ from the plain model's."""
    plain = _model(tokenizer)
    ours, theirs = copy.deepcopy(plain), copy.deepcopy(plain)
    qat.prepare(ours, QATConfig(weight_dtype=weights, activation_dtype=acts, group_size=group), CPU)
    quantize_(theirs.model, _by_hand(weights, acts, group))
    fake = [name for name, m in ours.named_modules() if isinstance(m, FakeQuantizedLinear)]
    assert len(fake) == 14 and all(name.startswith("model.layers.") for name in fake)
    assert type(ours.lm_head) is torch.nn.Linear
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in plain.named_parameters()]  # checkpoints as before
    ids = _ids()
    got = _logits(ours, ids)
    assert torch.equal(got, _logits(theirs, ids))
    assert (got - _logits(plain, ids)).abs().max() > 1e-3


def test_the_embedding_too_and_the_converted_model_computes_what_trained(tokenizer):
    """qat.quantize_embedding fake-quantizes the input embedding's weight (per group, no activations) as torchao does
    by hand; `convert` turns every fake-quantized layer into one holding torchao's quantized weight, and the converted
    model's logits are the fake-quantized model's (exactly), so what trained is what is saved."""
    plain = _model(tokenizer, UNTIED)
    ours, theirs = copy.deepcopy(plain), copy.deepcopy(plain)
    cfg = QATConfig(weight_dtype="int4", activation_dtype="int8", quantize_embedding=True)
    qat.prepare(ours, cfg, CPU)
    quantize_(theirs.model, _by_hand("int4", "int8", 32))
    quantize_(theirs.model, TorchaoQAT(weight_config=IntxFakeQuantizeConfig(torch.int4, group_size=32), step="prepare"),
              filter_fn=lambda m, _: isinstance(m, torch.nn.Embedding))
    assert isinstance(ours.model.embed_tokens, FakeQuantizedEmbedding)
    ids = _ids()
    trained = _logits(ours, ids)
    assert torch.equal(trained, _logits(theirs, ids))
    qat.convert(ours, cfg)
    assert not [m for m in ours.modules() if isinstance(m, (FakeQuantizedLinear, FakeQuantizedEmbedding))]
    quantized = {type(m.weight).__name__ for m in ours.model.modules() if isinstance(m, (torch.nn.Linear,
                                                                                          torch.nn.Embedding))}
    assert quantized == {"IntxUnpackedToInt8Tensor"} and type(ours.lm_head.weight) is torch.nn.Parameter
    assert torch.equal(_logits(ours, ids), trained)  # fp32 on a CPU: the same numbers, exactly
    assert ours.config.quantization_config.quant_method == "torchao"


def test_fake_quantization_switches_on_after_n_steps(tokenizer):
    """fake_quant_after_n_steps 2: after 0 or 1 steps the forward is the plain model's, after 2 the fake-quantized
    one's (torchao's switches, on the linear layers and the embedding)."""
    plain = _model(tokenizer, UNTIED)
    always, later = copy.deepcopy(plain), copy.deepcopy(plain)
    qat.prepare(always, QATConfig(weight_dtype="int4", quantize_embedding=True), CPU)
    cfg = QATConfig(weight_dtype="int4", quantize_embedding=True, fake_quant_after_n_steps=2)
    qat.prepare(later, cfg, CPU)
    ids = _ids()
    for steps, want in ((0, plain), (1, plain), (2, always), (5, always)):
        qat.at_step(later, cfg, steps)
        assert torch.equal(_logits(later, ids), _logits(want, ids)), steps


def test_the_loss_contract_holds_with_qat():
    """finetune verify on a QAT recipe (packed rows, micro-batch 2 x accumulation 2 x 2 ranks against one batch):
    the trainer's step gives one batch's gradient (fp32, 1e-5). Every fake quantization is per token or per weight,
    so no row's forward depends on another's."""
    from finetune.commands.verify import verify

    recipe = load_recipe(QUICKSTART, [*TINY, *QAT_8DA4W, "train.micro_batch_size=2",
                                      "train.gradient_accumulation_steps=2"])
    result = verify(recipe, world_size=2)
    assert result.passed and result.configured_max <= 1e-5, result.groups


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three runs of the tiny quickstart, the same seed and data: QAT from the first step, QAT from step 2, none."""
    root = tmp_path_factory.mktemp("qat")
    done = {}
    for name, extra in (("qat", [*QAT_8DA4W, "train.max_steps=2"]),
                        ("later", [*QAT_8DA4W, "qat.fake_quant_after_n_steps=1", "train.max_steps=2"]),
                        ("plain", ["train.max_steps=1"])):
        out = root / name
        result = run_cli("train", str(QUICKSTART), f"output_dir={out}", *TINY, "eval.at_start=true", *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        done[name] = (out, result)
    return done


def test_a_qat_run_trains_records_its_scheme_and_saves_the_quantized_model(runs):
    out, result = runs["qat"]
    lines = train_lines(out)
    assert [x["step"] for x in lines] == [1, 2]
    assert all(math.isfinite(x["loss"]) and x["update_ratio"] > 0 for x in lines), lines
    assert ("qat: int8 dynamic activations, int4 weights, groups of 32 (torchao's "
            "Int8DynamicActivationIntxWeightConfig) on 14 layers, fake-quantized from the first step") in result.stdout
    record = json.loads((out / "versions.json").read_text())["run"]["qat"]
    assert record == {"scheme": "int8 dynamic activations, int4 weights, groups of 32", "weight_dtype": "int4",
                      "activation_dtype": "int8", "group_size": 32, "quantize_embedding": False,
                      "fake_quant_from_step": 1, "layers": 14,
                      "torchao_config": "Int8DynamicActivationIntxWeightConfig"}
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "torchao"
    # final/ loads back quantized (transformers reads torchao's tensors), and its eval loss is the run's last one.
    from finetune.run.trained import load_trained

    lm, _ = load_trained(out)
    assert type(lm.model.layers[0].mlp.down_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    evaluated = run_cli("eval", str(out))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    last = eval_lines(out)[-1]["eval_loss"]
    assert f"eval_loss {last:.6f}" in evaluated.stdout, (last, evaluated.stdout)


def test_fake_quantization_starts_at_its_step_in_the_loop(runs):
    """fake_quant_after_n_steps 1: the eval before training and step 1 are the plain run's, exactly; step 2 and the
    evals after it differ from it as the QAT run's do (its step 1 already differs)."""
    plain, later, always = (train_lines(runs[n][0]) for n in ("plain", "later", "qat"))
    plain_eval, later_eval, always_eval = (eval_lines(runs[n][0]) for n in ("plain", "later", "qat"))
    assert later[0]["loss"] == plain[0]["loss"] and later_eval[0]["eval_loss"] == plain_eval[0]["eval_loss"]
    assert always[0]["loss"] != plain[0]["loss"] and always_eval[0]["eval_loss"] != plain_eval[0]["eval_loss"]
    assert "fake-quantized from step 2" in runs["later"][1].stdout


@pytest.mark.parametrize(("overrides", "message"), [
    (["qat.weight_dtype=fp8"], "qat.weight_dtype: got \"fp8\"; allowed: 'int4', 'int8', 'nvfp4' or 'mxfp4'"),
    (["qat.activation_dtype=int8"], "qat.activation_dtype: set, but qat.weight_dtype is null, which means no QAT"),
    (["qat.weight_dtype=int4", "qat.group_size=0"], "qat.group_size: got 0; input should be greater than 0"),
    (["qat.weight_dtype=nvfp4", "model.dtype=bfloat16"], "qat.activation_dtype: weight_dtype nvfp4 needs "
                                                          "activation_dtype nvfp4"),
    (["qat.weight_dtype=nvfp4", "qat.activation_dtype=nvfp4", "qat.group_size=32", "model.dtype=bfloat16"],
     "qat.group_size: nvfp4 quantizes blocks of 16 elements, its format's own; got 32"),
    (["qat.weight_dtype=mxfp4", "qat.activation_dtype=mxfp4"], "model.dtype: qat.weight_dtype mxfp4 computes in "
                                                                "bfloat16"),
    (["qat.weight_dtype=mxfp4", "qat.activation_dtype=mxfp4", "model.dtype=bfloat16",
      "qat.fake_quant_after_n_steps=3"], "qat.fake_quant_after_n_steps: torchao's mxfp4 layers cannot switch"),
    (["qat.weight_dtype=int4", "qat.activation_dtype=nvfp4"], "qat.activation_dtype: nvfp4 activations train with "
                                                               "weight_dtype nvfp4, not int4"),
    ([*QAT_8DA4W, "adapter.type=lora"], "adapter.type: lora with qat: QAT trains the weights that are quantized"),
    ([*QAT_8DA4W, "train.objective=grpo"], "train.objective: grpo with qat: its reference model is the policy as "
                                            "loaded, fake-quantized in a fresh run but loaded again without it"),
    ([*QAT_8DA4W, "qat.fake_quant_after_n_steps=-1"], "qat.fake_quant_after_n_steps: got -1; input should be greater "
                                                       "than or equal to 0"),
])
def test_bad_settings_are_refused_in_the_recipe(overrides, message):
    with pytest.raises(UserError) as e:
        load_recipe(QUICKSTART, [*TINY, *overrides])
    assert message in str(e.value), str(e.value)


def test_without_torchao_the_recipe_says_how_to_install_it(monkeypatch):
    """A QAT recipe needs torchao (the recipe's feature `qat`): missing, the CLI stops when the recipe loads with the
    pip line, before anything is read."""
    from finetune import versions
    from finetune.recipe import features

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: None if p == "torchao" else real(p))
    recipe = load_recipe(QUICKSTART, [*TINY, *QAT_8DA4W])
    assert "qat" in features(recipe) and "qat" not in features(load_recipe(QUICKSTART, TINY))
    with pytest.raises(UserError, match=r"torchao \(needed by 'qat'\): pip install 'torchao==0.18.0' \(or pip "
                                        r"install 'finetune\[qat\]'\)"):
        versions.require_packages(features(recipe))


def test_refused_when_the_model_loads(tokenizer):
    """What the recipe cannot know: the device (FP4 on a CPU), the layers' sizes, a tied embedding."""
    lm = _model(tokenizer)
    fp4 = QATConfig(weight_dtype="nvfp4", activation_dtype="nvfp4")
    with pytest.raises(UserError, match=r"qat.weight_dtype: nvfp4 trains on NVIDIA GPUs of compute capability 10.0 or "
                                        r"newer \(Blackwell\).*this run's device is cpu"):
        qat.prepare(lm, fp4, CPU)
    with pytest.raises(UserError, match=r"qat.group_size: 48 does not divide the input features of 14 linear layer\(s\), "
                                        r"e.g. layers.0.self_attn.q_proj \(32\); the layers' input sizes are 32, 64: "
                                        r"use a group size that divides each, e.g. 32"):
        qat.prepare(lm, QATConfig(weight_dtype="int4", group_size=48), CPU)
    with pytest.raises(UserError, match="qat.quantize_embedding: this model's output layer shares the input "
                                        "embedding's weight"):
        qat.prepare(lm, QATConfig(weight_dtype="int4", quantize_embedding=True), CPU)
    assert not [m for m in lm.modules() if isinstance(m, FakeQuantizedLinear)]  # refused before anything changed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", [QAT_8DA4W, ["qat.weight_dtype=nvfp4", "qat.activation_dtype=nvfp4"]],
                         ids=["int8-int4", "nvfp4"])
def test_bfloat16_qat_on_cuda(tmp_path, scheme):
    """The tiny quickstart in bfloat16 on a GPU: int8 activations with int4 weights train (finite losses) and final/
    loads back quantized; NVFP4 does the same on compute capability 10.0 or newer and is refused below it."""
    out = tmp_path / "run"
    r = run_cli("train", str(QUICKSTART), f"output_dir={out}", *TINY, "model.dtype=bfloat16", "train.max_steps=3",
                *scheme)
    if "nvfp4" in scheme[0] and torch.cuda.get_device_capability() < (10, 0):
        assert r.returncode == 2 and "qat.weight_dtype: nvfp4 trains on NVIDIA GPUs of compute capability 10.0" in \
            r.stderr, r.stderr[-3000:]
        return
    assert r.returncode == 0, r.stderr[-3000:]
    assert "device: cuda" in r.stdout
    assert all(math.isfinite(x["loss"]) for x in train_lines(out))
    evaluated = run_cli("eval", str(out))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
