"""The support matrix (tests/model_matrix.py): every decoder-only causal LM architecture of the pinned transformers,
built tiny, through the fused loss, packing, LoRA all-linear and one real trainer step; and docs/models.md, its
record. Plus the fixes it led to, each tested on its own: head transforms (logit scaling in both directions),
what is refused at load, and packing refused from a model's structure.

Each architecture is evaluated once (all its checks, ~0.2 s) and the four tests below read the cached result.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from conftest import REPO_ROOT
from helpers import one_thread
from model_matrix import TOLERANCE, architectures, evaluate, problems
from tiny_configs import StubTokenizer, tiny_kwargs

from finetune.errors import UserError
from finetune.model.isolation import check_packing_isolation
from finetune.model.loading import load_model
from finetune.model.with_loss import CausalLMWithLoss
from finetune.recipe import AdapterConfig, ModelConfig

ARCHITECTURES = architectures()


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():  # tiny models: on a shared 2-core machine, threads only cost
        yield


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_fused_loss_is_the_models_own_or_refused_at_load(model_type):
    row = evaluate(model_type)
    assert row.load_error is None, row.load_error
    if row.refused:
        assert row.refused.startswith(("model_type", "model.config")), row.refused
        return
    assert "loss" not in problems(row), problems(row)["loss"]
    assert all(max(diffs) <= TOLERANCE for diffs in row.loss.values())


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_packing_isolated_or_refused_for_a_shown_reason(model_type):
    row = evaluate(model_type)
    if row.refused or row.load_error:
        pytest.skip("refused at load")
    assert "packing" not in problems(row), problems(row)["packing"]
    if row.packing_refused:
        assert "data.packing: false" in row.packing_refused


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_lora_all_linear_finds_layers_and_trains(model_type):
    row = evaluate(model_type)
    if row.refused or row.load_error:
        pytest.skip("refused at load")
    assert "lora" not in problems(row), problems(row)["lora"]


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_one_real_trainer_step(model_type):
    row = evaluate(model_type)
    if row.refused or row.load_error:
        pytest.skip("refused at load")
    assert "trainer" not in problems(row), problems(row)["trainer"]
    assert row.trainer_packed == (row.packing_refused is None)


# --- the fixes, one by one -------------------------------------------------------------------------------------

def _tiny(model_type: str, **config) -> torch.nn.Module:
    return load_model(ModelConfig(init="random", config={"model_type": model_type, **tiny_kwargs(model_type),
                                                         **config}), AdapterConfig(), StubTokenizer(), seed=0)


def _losses(model: torch.nn.Module) -> tuple[float, float, float]:
    """(the fused loss, the model's own loss, the fused loss without the head transform) on one batch."""
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        net = CausalLMWithLoss(model, "chunked", 16, 0.0, None)
        fused = net(input_ids=ids, labels=ids)
        own = model(input_ids=ids, labels=ids, use_cache=False).loss
        net.head = type(net.head)()  # what the loss computed before: the output layer's weight alone
        plain = net(input_ids=ids, labels=ids)
    return float(fused[0] / fused[1]), float(own), float(plain[0] / plain[1])


@pytest.mark.parametrize(("model_type", "key"), [("granite", "logits_scaling"), ("hyperclovax", "logits_scaling"),
                                                  ("cohere", "logit_scale")])
def test_fused_loss_honours_logit_scaling_in_both_directions(model_type, key):
    # Granite divides its logits by logits_scaling, HyperCLOVAX multiplies by an attribute of the same name,
    # Cohere multiplies by logit_scale. The fused loss used the output layer alone: off by 1e-3 to 1e-2.
    fused, own, plain = _losses(_tiny(model_type, **{key: 3.0}))
    assert abs(fused - own) <= TOLERANCE * abs(own)
    assert abs(plain - own) > 1e-3 * abs(own)  # the check has power: ignoring the scale is visibly wrong


def test_losses_the_fused_loss_does_not_add_are_refused_at_load():
    # The model's own loss would add router_aux_loss_coef x the load-balancing loss, which the fused loss adds only
    # for the architectures checked against their own loss (tests/model/test_router_aux_loss.py; JetMoE names its
    # coefficient otherwise): refused with the key to set, instead of training on another objective.
    with pytest.raises(UserError, match=r"output_router_logits: false"):
        _tiny("jetmoe", output_router_logits=True)
    with pytest.raises(UserError, match=r"z_loss_coefficient"):
        _tiny("bamba", z_loss_coefficient=0.1)


def test_unpadded_vocabulary_smaller_than_the_tokenizer_is_refused():
    class Large(StubTokenizer):
        def __len__(self) -> int:
            return 250

    config = ModelConfig(init="random", config={"model_type": "inkling_text", **tiny_kwargs("inkling_text")})
    with pytest.raises(UserError, match=r"unpadded_vocab_size 200 is smaller than the tokenizer's 250"):
        load_model(config, AdapterConfig(), Large(), seed=0)


def test_isolation_tolerance_catches_the_short_convolution_leak_it_used_to_pass():
    # LFM2-MoE's short convolution leaks ~1e-4 at random init, under the former fp32 tolerance of 1e-4. Packing
    # is refused for it from its structure anyway; the numeric check alone now catches it too.
    model = _tiny("lfm2_moe")
    leak = check_packing_isolation(model, 200, tolerance=math.inf)
    assert 1e-5 < leak < 1e-3
    with pytest.raises(UserError, match="leaking"):
        check_packing_isolation(model, 200)


def _stateful_recipe(tmp_path, *overrides: str):
    from finetune.recipe import load_recipe

    recipe = load_recipe(REPO_ROOT / "examples" / "yaml" / "quickstart.yaml", [
        f"output_dir={tmp_path / 'run'}", "datasets.0.max_rows=8", "eval_datasets.0.max_rows=4", "train.max_steps=1",
        *overrides])
    recipe.model.config = {"model_type": "qwen3_next", **{k: v for k, v in tiny_kwargs("qwen3_next", 1024).items()
                                                          if not k.endswith("token_id")}}
    return recipe


def test_trainer_refuses_packing_a_stateful_model_even_without_the_check(tmp_path):
    import io

    from rich.console import Console

    from finetune.train import loop as trainer

    with pytest.raises(UserError) as info:
        trainer.train(_stateful_recipe(tmp_path, "data.packing_check=false"), console=Console(file=io.StringIO()))
    message = str(info.value)
    assert "Qwen3NextGatedDeltaNet" in message and "data.packing: false" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_eval_refuses_packing_a_stateful_model(tmp_path):
    from finetune.train.evaluate import run_eval

    with pytest.raises(UserError, match="data.packing: false"):
        run_eval(_stateful_recipe(tmp_path))
    result = run_eval(_stateful_recipe(tmp_path, "data.packing=false"))
    assert math.isfinite(result.loss) and result.counts["tokens"] > 0


# --- docs/models.md --------------------------------------------------------------------------------------------

def test_models_doc_and_readme_are_current():
    """docs/models.md and README's models line are what scripts/gen_models_doc.py writes from this run."""
    spec = importlib.util.spec_from_file_location("gen_models_doc", REPO_ROOT / "scripts" / "gen_models_doc.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    rows = [evaluate(mt) for mt in ARCHITECTURES]
    hint = "out of date: run python scripts/gen_models_doc.py"
    assert gen.DOC.read_text() == gen.render_doc(rows), f"docs/models.md is {hint}"
    assert gen.README.read_text() == gen.render_readme(gen.README.read_text(), rows), f"README.md is {hint}"
