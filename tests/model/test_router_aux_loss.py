"""The MoE router's load-balancing loss (output_router_logits: true) as part of the loss
(finetune/model/router_loss.py).

One micro-batch: the fused loss and its gradients are the model's own
`model(..., labels=..., output_router_logits=True)` (mean cross-entropy + router_aux_loss_coef x the load-balancing
loss), fp32 <= 1e-5, on every architecture it is added for. Several: the step's loss adds each micro-batch's value
weighted by its share of the step's target tokens, and logs that weighted value as router_aux_loss; `finetune
verify` checks the cross-entropy and reports the router loss both ways; the eval loss is the cross-entropy alone.
The coefficient is set to 0.5 (the models' default 0.001 or 0.01 would hide a missing term in the noise).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import QUICKSTART, TINY, one_thread
from tiny_configs import StubTokenizer, tiny_kwargs

from finetune import dist
from finetune.data.collate import collate_flat, collate_packed, collate_padded
from finetune.errors import UserError
from finetune.model.loading import load_model
from finetune.model.router_loss import SUPPORTED, router_loss
from finetune.model.with_loss import CausalLMWithLoss
from finetune.objectives.preference import DPO
from finetune.objectives.sft import SFT
from finetune.recipe import AdapterConfig, ModelConfig
from finetune.train.parts import check_router_loss
from finetune.train.step import forward_backward, read_step, step_counts

COEF = 0.5
CPU = torch.device("cpu")
# The tests' tiny Qwen3-MoE as recipe overrides of the quickstart (with helpers.TINY's sizes).
MOE_OVERRIDES = ["model.config.model_type=qwen3_moe", "model.config.num_experts=4",
                 "model.config.num_experts_per_tok=2", "model.config.moe_intermediate_size=16",
                 "model.config.output_router_logits=true", f"model.config.router_aux_loss_coef={COEF}"]


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():  # tiny models: one reduction order, and a fair share of a shared machine
        yield


def _model(model_type: str, **config) -> torch.nn.Module:
    values = {"model_type": model_type, **tiny_kwargs(model_type), "output_router_logits": True,
              "router_aux_loss_coef": COEF, **config}
    if model_type == "dbrx":  # its coefficient is ffn_config.moe_loss_weight
        values["ffn_config"] = {**values["ffn_config"], "moe_loss_weight": COEF}
    return load_model(ModelConfig(init="random", config=values), AdapterConfig(), StubTokenizer(), seed=0).train()


def _samples(*lengths: int, seed: int = 0) -> list[dict]:
    """Samples of random ids whose every token but the first is a target."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        ids = torch.randint(3, 200, (n,), generator=g).tolist()
        samples.append({"input_ids": ids, "labels": [-100, *ids[1:]]})
    return samples


def _grads(lm: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad(set_to_none=True)
    return grads


def _relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """||got - want|| / ||want|| over every gradient (tests/model_matrix.py's measure: a tiny gradient's float noise
    does not count as much as a wrong one)."""
    assert got.keys() == want.keys()
    num = sum(float((got[n].double() - want[n].double()).norm()) ** 2 for n in want)
    return (num / sum(float(want[n].double().norm()) ** 2 for n in want)) ** 0.5


def _routers(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3-MoE's routers' weight gradients (mlp.gate)."""
    return {n: g for n, g in grads.items() if ".mlp.gate." in n}


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_one_micro_batch_is_the_models_own_loss_and_gradient(model_type):
    """Padded rows with an attention mask (the second row padded): the fused loss over the micro-batch's targets,
    and its gradients, equal the model's own loss with its router loss (fp32, 1e-5), and the router loss is large
    enough that leaving it out would fail both checks."""
    lm = _model(model_type)
    net = CausalLMWithLoss(lm, "chunked", 16, 0.0, None)
    assert net.router is not None and net.router.coef == COEF
    batch = collate_padded(_samples(12, 8), pad_token_id=0).to(CPU)
    losses, grads = [], []
    for off in (False, True):
        with net.router_loss_off() if off else contextlib.nullcontext():
            loss_sum, n = net(**batch.model_inputs())
        (loss_sum / n).backward()
        losses.append(float(loss_sum / n))
        grads.append(_grads(lm))
    own = lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels,
             output_router_logits=True, use_cache=False)
    own.loss.backward()
    theirs = _grads(lm)
    assert abs(losses[0] - float(own.loss)) <= 1e-5 * float(own.loss)
    assert _relative(grads[0], theirs) <= 1e-5
    # The check has power: without the router term, the loss and the gradients are visibly off.
    assert abs(losses[1] - float(own.loss)) > 0.1 and _relative(grads[1], theirs) > 1e-3


def test_found_through_a_lora_adapter():
    """Under PEFT's wrapper the model's own settings are found (its coefficient, experts, top-k), and the loss is the
    adapted model's own (1e-5)."""
    config = {"model_type": "mixtral", **tiny_kwargs("mixtral"), "output_router_logits": True,
              "router_aux_loss_coef": COEF}
    lm = load_model(ModelConfig(init="random", config=config), AdapterConfig(type="lora", r=4, alpha=8),
                    StubTokenizer(), seed=0)
    net = CausalLMWithLoss(lm, "chunked", 16, 0.0, None)
    assert (net.router.coef, net.router.num_experts, net.router.top_k) == (COEF, 4, 2)
    batch = collate_padded(_samples(12, 8), pad_token_id=0).to(CPU)
    with torch.no_grad():
        loss_sum, n = net(**batch.model_inputs())
        own = lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels,
                 output_router_logits=True, use_cache=False).loss
    assert abs(float(loss_sum / n) - float(own)) <= 1e-5 * float(own)


def test_the_router_loss_reaches_the_routers_and_survives_gradient_checkpointing():
    """Left out (router_loss_off), the routers get another gradient; with non-reentrant checkpointing (the router
    logits recomputed in the backward) the gradients are the same as without."""
    batch = collate_padded(_samples(12, 8), pad_token_id=0).to(CPU)
    grads = {}
    for checkpointing in (False, True):
        lm = load_model(ModelConfig(init="random", gradient_checkpointing=checkpointing, config={
            "model_type": "qwen3_moe", **tiny_kwargs("qwen3_moe"), "output_router_logits": True,
            "router_aux_loss_coef": COEF}), AdapterConfig(), StubTokenizer(), seed=0).train()
        net = CausalLMWithLoss(lm, "chunked", 16, 0.0, None)
        loss_sum, n = net(**batch.model_inputs())
        (loss_sum / n).backward()
        grads[checkpointing] = _grads(lm)
        with net.router_loss_off():
            loss_sum, n = net(**batch.model_inputs())
        (loss_sum / n).backward()
        without = _routers(_grads(lm))
        assert without and max(float((grads[checkpointing][k] - g).abs().max()) for k, g in without.items()) > 1e-4
    assert _relative(grads[True], grads[False]) <= 1e-6


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_packed_rows_count_every_position_as_the_model_does_without_a_mask(model_type):
    """Packed rows carry no attention mask: every position counts, the padding at the end of a shorter row included,
    as transformers counts them without a mask (the model's own loss on the same packed tensors, 1e-5). Padding-free
    rows have no padding: their router loss is the padded rows' with the mask (1e-5)."""
    lm = _model(model_type)
    net = CausalLMWithLoss(lm, "chunked", 16, 0.0, None)
    samples = _samples(6, 5, 7, seed=1)
    row = {"input_ids": [t for s in samples[:2] for t in s["input_ids"]],
           "labels": [t for s in samples[:2] for t in s["labels"]], "position_ids": [*range(6), *range(5)]}
    short = {**samples[2], "position_ids": list(range(7))}
    packed = collate_packed([row, short], pad_token_id=0).to(CPU)  # the second row padded by 4
    with torch.no_grad():
        loss_sum, n = net(**packed.model_inputs())
        own = lm(input_ids=packed.input_ids, position_ids=packed.position_ids, labels=packed.labels,
                 output_router_logits=True, use_cache=False)
        assert abs(float(loss_sum / n) - float(own.loss)) <= 1e-5 * float(own.loss)
        _, flat = net(**collate_flat(samples, 0).to(CPU).model_inputs(), metrics=True)
        padded = collate_padded(samples, 0).to(CPU)
        _, with_mask = net(**padded.model_inputs(), metrics=True)
    per_target = [float(m["router_aux_loss"]) / padded.targets for m in (flat, with_mask)]
    assert abs(per_target[0] - per_target[1]) <= 1e-5 * per_target[1]


def test_a_step_weighs_each_micro_batch_by_its_target_tokens():
    """The trainer's step over two micro-batches of 3 and 12 target tokens: loss = the summed cross-entropy over the
    step's targets + coef x (3 aux_1 + 12 aux_2) / 15, router_aux_loss = (3 aux_1 + 12 aux_2) / 15, each aux the
    model's own for that micro-batch (1e-5); one micro-batch: the model's own loss and aux."""
    lm = _model("qwen3_moe").eval()  # no dropout: the model's own passes below see the same network
    net, objective = CausalLMWithLoss(lm, "chunked", 16, 0.0, None), SFT()
    objective.prepare({}, lm, None)
    assert objective.metrics == {"router_aux_loss": "tokens"}
    micro = [collate_padded(s, 0).to(CPU) for s in (_samples(4, seed=2), _samples(9, 5, seed=3))]
    own = []
    with torch.no_grad():
        for b in micro:
            out = lm(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels,
                     output_router_logits=True, use_cache=False)
            own.append((float(out.loss - COEF * out.aux_loss) * b.targets, float(out.aux_loss), b.targets))
    for batches, expected in ((micro, own), (micro[:1], own[:1])):
        counts = step_counts(objective, batches, dist.World(), CPU).counts
        sums = forward_backward(net, objective, batches, counts, dist.World(), CPU)
        figures = read_step(objective, sums, torch.zeros(()), counts)
        tokens = sum(n for _, _, n in expected)
        assert counts["tokens"] == tokens
        aux = sum(a * n for _, a, n in expected) / tokens
        assert abs(figures.metrics["router_aux_loss"] - aux) <= 1e-5 * aux
        want = sum(ce for ce, _, _ in expected) / tokens + COEF * aux
        assert abs(figures.loss - want) <= 1e-5 * want
    lm.zero_grad(set_to_none=True)


def test_refused_where_it_is_not_added():
    """An architecture not checked against its own loss (JetMoE: another coefficient's name), and an objective whose
    loss does not add it, are refused with the key to set; SFT adds it."""
    with pytest.raises(UserError, match=r"jetmoe would add its router load-balancing loss.*"
                                        r"output_router_logits: false"):
        _model("jetmoe")
    lm = _model("qwen3_moe")
    with pytest.raises(UserError, match=r"train.objective dpo does not add the router's load-balancing loss"):
        check_router_loss(lm, DPO(0.1, "sigmoid", 0.0))
    check_router_loss(lm, SFT())
    assert router_loss(_model("qwen3_moe", output_router_logits=False)) is None


def test_verify_checks_the_cross_entropy_and_reports_the_router_loss_both_ways():
    """`finetune verify` on a tiny Qwen3-MoE: the configured gradients (router loss left out) equal one batch's
    (1e-5); the router loss is reported as configured and as one batch: equal with one micro-batch (1e-6), not with
    four (a product of means is not a sum)."""
    from finetune.commands.verify import verify
    from finetune.recipe import load_recipe

    results = {}
    for micro, accumulation in ((4, 1), (1, 4)):
        recipe = load_recipe(QUICKSTART, [*TINY, *MOE_OVERRIDES, f"train.micro_batch_size={micro}",
                                          f"train.gradient_accumulation_steps={accumulation}"])
        results[micro] = verify(recipe)
        assert results[micro].passed and results[micro].configured_max <= 1e-5, results[micro].groups
    configured, reference = results[4].router_aux
    assert abs(configured - reference) <= 1e-6 * reference
    configured, reference = results[1].router_aux
    assert configured != reference and abs(configured - reference) <= 0.1 * reference


@pytest.mark.parametrize("packing", [True, False])
def test_the_eval_loss_is_the_cross_entropy_whatever_the_cut(packing):
    """The eval loss stays the same number whatever the eval micro-batch size (1e-5): the router loss, which depends
    on the cut (shown: its value differs), is reported beside it (eval_router_aux_loss), not in it."""
    from finetune.recipe import load_recipe
    from finetune.train.evaluate import evaluate_loss

    recipe = load_recipe(QUICKSTART, [*TINY, *MOE_OVERRIDES, f"data.packing={packing}", "data.max_seq_len=16"])
    lm = _model("qwen3_moe")
    net, objective = CausalLMWithLoss(lm, "chunked", 16, 0.0, None), SFT()
    objective.prepare({}, lm, None)
    samples = _samples(9, 4, 12, 6, 7, seed=4)
    results = [evaluate_loss(objective, net, samples, recipe, micro, 0, dist.World(), CPU) for micro in (1, 5)]
    assert abs(results[0].loss - results[1].loss) <= 1e-5 * results[1].loss
    routed = [r.metrics["router_aux_loss"] for r in results]
    assert abs(routed[0] - routed[1]) > 1e-6 and all(1.0 < r < 4.0 for r in routed)
    assert results[0].record(0)["eval_router_aux_loss"] == routed[0]
