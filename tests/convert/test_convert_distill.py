"""`finetune convert axolotl` on Axolotl's knowledge distillation (its KD plugin, read at commit 067b021c8):
kd_trainer becomes train.objective: distill with the teacher stored in the rows; the weights, temperature and beta
carry over (the loss scale with max_grad_norm and adam_eps); the differences are approximations or notes; what
cannot be carried over is refused, saying why. Then the loss itself: finetune's stored-teacher divergence against
Axolotl's top-k loss written out from its source (kd/kernels/liger.py), and AdamW's step under the scaling."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from finetune.cli import main
from finetune.convert import convert_axolotl
from finetune.errors import UserError
from finetune.loss.distill import distill_stored_loss
from finetune.recipe import validate

KD = """base_model: org/model
plugins:
  - axolotl.integrations.kd.KDPlugin
  - axolotl.integrations.liger.LigerPlugin
kd_trainer: true
kd_ce_alpha: 0.1
kd_alpha: 0.8
kd_temperature: 2.0
chat_template: chatml
datasets:
  - path: kd.jsonl
    type: axolotl.integrations.kd.chat_template
    field_messages: conversation
    logprobs_field: teacher_lp
    temperature: 2.0
sequence_len: 1024
sample_packing: true
max_grad_norm: 0.5
"""

# One row in Axolotl's first layout: the teacher's top-2 per token ("token_id:N", log-probability).
ROW = {"conversation": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
       "teacher_lp": [[{"token": "token_id:5", "logprob": -0.1}, {"token": "token_id:9", "logprob": -2.5}]]}


def _convert(tmp_path: Path, text: str, allow_approx: bool = True):
    config = tmp_path / "config.yml"
    config.write_text(text, encoding="utf-8")
    return convert_axolotl(config, allow_approx=allow_approx)


def _error(tmp_path: Path, text: str, allow_approx: bool = True) -> str:
    with pytest.raises(UserError) as e:
        _convert(tmp_path, text, allow_approx)
    return str(e.value)


def test_a_kd_config_becomes_offline_distillation(tmp_path):
    converted = _convert(tmp_path, KD)
    recipe = yaml.safe_load(converted.text)
    assert recipe["train"]["objective"] == "distill"
    assert recipe["distill"] == {"teacher_logprobs": "teacher_lp", "beta": 0.0, "temperature": 2.0,
                                 "sft_weight": pytest.approx(0.1 / 0.8)}
    # The loss is Axolotl's / kd_alpha: clipping and AdamW's eps scaled with it, so the steps are Axolotl's.
    assert recipe["train"]["max_grad_norm"] == pytest.approx(0.5 / 0.8)
    assert recipe["train"]["adam_eps"] == pytest.approx(1e-8 / 0.8)
    # A KD dataset is a chat dataset read as chat_template's (its fields, Axolotl's role names and system column).
    assert recipe["datasets"] == [{"path": "kd.jsonl", "format": "chat", "messages_field": "conversation",
                                   "role_map": {"human": "user", "gpt": "assistant"}, "system_field": "system"}]
    assert recipe["data"]["packing"] is True
    c = converted.conversion
    assert [a.split(":")[0] for a in c.approximations] == ["kd_trainer"]
    assert "renormalizes the stored top-k to sum to 1" in c.approximations[0]
    assert any(n.startswith("kd_alpha 0.8: finetune's loss is") for n in c.notes)
    assert any(n.startswith("kd_temperature 2: Axolotl logs its KD term times kd_temperature^2") for n in c.notes)
    assert any("its prediction of token t + 1" in n for n in c.notes)
    dropped = dict(c.dropped)  # the KD plugin is what kd_trainer converts: not "dropped"; Liger is
    assert "plugins: axolotl.integrations.liger.LigerPlugin" in dropped
    assert not any("kd" in key for key in dropped)
    validate(recipe)


def test_the_kd_recipe_validates_through_the_cli(tmp_path, capsys):
    (tmp_path / "kd.jsonl").write_text(json.dumps(ROW) + "\n", encoding="utf-8")
    config = tmp_path / "config.yml"
    config.write_text(KD, encoding="utf-8")
    out = tmp_path / "recipe.yaml"
    assert main(["convert", "axolotl", str(config), "-o", str(out)]) == 2  # the teacher's tail: an approximation
    assert "kd_trainer: only approximately" in capsys.readouterr().err
    assert main(["convert", "axolotl", str(config), "--allow-approx", "-o", str(out)]) == 0
    assert "approximation: kd_trainer" in capsys.readouterr().err
    assert main(["validate", str(out)]) == 0
    assert "teacher_logprobs: teacher_lp" in capsys.readouterr().out


def test_kd_defaults_legacy_layout_beta_and_normalize_topk(tmp_path):
    """load_legacy is a KD type too; logprobs_field defaults to Axolotl's "logprobs"; kd_alpha 1 scales nothing;
    kd_beta carries over as distill.beta (Axolotl's convention is ours) but above 0 is approximated, as is
    kd_normalize_topk."""
    text = (KD.replace("kd_alpha: 0.8", "kd_alpha: 1").replace("    logprobs_field: teacher_lp\n", "")
            .replace("type: axolotl.integrations.kd.chat_template", "type: axolotl.integrations.kd.chat_template"
                     ".load_legacy") + "kd_beta: 0.5\nkd_normalize_topk: true\n")
    converted = _convert(tmp_path, text)
    recipe = yaml.safe_load(converted.text)
    assert recipe["distill"] == {"teacher_logprobs": "logprobs", "beta": 0.5, "temperature": 2.0, "sft_weight": 0.1}
    assert recipe["train"]["max_grad_norm"] == 0.5 and "adam_eps" not in recipe["train"]
    assert not any(n.startswith("kd_alpha") for n in converted.conversion.notes)
    assert [a.split(":")[0] for a in converted.conversion.approximations] == ["kd_beta", "kd_normalize_topk",
                                                                             "kd_trainer"]
    problems = _error(tmp_path, text, allow_approx=False)
    assert "3 problems" in problems and "kd_beta: only approximately: 0.5" in problems
    # kd_ce_alpha 0: no cross-entropy term; max_grad_norm 0 (no clipping) stays off.
    text = KD.replace("kd_ce_alpha: 0.1", "kd_ce_alpha: 0").replace("max_grad_norm: 0.5", "max_grad_norm: 0")
    recipe = yaml.safe_load(_convert(tmp_path, text).text)
    assert "sft_weight" not in recipe["distill"] and recipe["train"]["max_grad_norm"] is None
    assert recipe["train"]["adam_eps"] == pytest.approx(1.25e-8)


@pytest.mark.parametrize(("change", "message"), [
    (("  - axolotl.integrations.kd.KDPlugin\n", ""),
     "kd_trainer: Axolotl reads the kd_ keys only with its distillation plugin"),
    (("kd_trainer: true\n", "kd_trainer: true\nrl: dpo\n"), "kd_trainer: not with rl"),
    (("kd_alpha: 0.8", "kd_alpha: 0"), "kd_alpha: 0: Axolotl then computes no KD loss"),
    (("kd_alpha: 0.8\n", ""), "kd_alpha: required with kd_trainer"),
    (("kd_ce_alpha: 0.1\n", ""), "kd_ce_alpha: required with kd_trainer"),
    (("kd_ce_alpha: 0.1", "kd_ce_alpha: 1.5"), "kd_ce_alpha: 1.5: Axolotl expects the weight of its cross-entropy, "
                                               "from 0 to 1"),
    (("kd_temperature: 2.0\n", ""), "kd_temperature: required with kd_trainer"),
    (("kd_trainer: true\n", "kd_trainer: true\nkd_beta: 2\n"), "kd_beta: got 2; Axolotl expects a number from 0"),
    (("    temperature: 2.0\n", ""), "datasets.0.temperature: the log-probabilities were made at temperature 1 (the "
                                   "dataset sets no temperature) and kd_temperature is 2: Axolotl rescales them"),
    (("    temperature: 2.0\n", "    temperature: 0.7\n"), "datasets.0.temperature: the log-probabilities were made "
                                                          "at temperature 0.7 and kd_temperature is 2"),
    (("max_grad_norm: 0.5\n", "max_grad_norm: 0.5\ntest_datasets:\n  - {path: e.jsonl, type: "
      "axolotl.integrations.kd.chat_template, temperature: 2.0}\n"),
     "test_datasets.0.logprobs_field: 'logprobs': finetune reads the teacher from one field in every dataset"),
    (("max_grad_norm: 0.5\n", "max_grad_norm: 0.5\ntest_datasets:\n  - {path: e.jsonl, type: chat_template}\n"),
     "test_datasets.0.type: chat_template: with kd_trainer every dataset holds the teacher's log-probabilities"),
    (("kd_trainer: true\n", "kd_trainer: true\nkd_online_server_base_url: http://localhost:8000\n"),
     "kd_online_server_base_url: a teacher served over HTTP (vLLM, SGLang) is not supported"),
    (("kd_trainer: true\n", "kd_trainer: true\nprocessor_type: AutoProcessor\n"),
     "kd_trainer: distillation with images (processor_type) is not supported"),
    (("kd_trainer: true", "kd_trainer: yes please"), "kd_trainer: got 'yes please'; Axolotl expects true or false"),
])
def test_what_cannot_be_carried_over_is_refused_saying_why(tmp_path, change, message):
    assert change[0] in KD
    assert message in _error(tmp_path, KD.replace(*change))


def test_a_kd_type_without_kd_trainer_is_refused_and_unused_kd_keys_are_dropped(tmp_path):
    no_trainer = KD.replace("kd_trainer: true\n", "")
    assert "datasets.0.type: axolotl.integrations.kd.chat_template: a distillation type, read only with " \
           "kd_trainer" in _error(tmp_path, no_trainer)
    # kd_ keys, the plugin, a KD dataset's keys on another type and the online teacher's options: no effect.
    text = (no_trainer.replace("type: axolotl.integrations.kd.chat_template", "type: chat_template")
            + "kd_temperature_min: 0.5\nkd_online_topk: 64\nkd_beta: 0.3\n")
    converted = _convert(tmp_path, text, allow_approx=False)
    recipe = yaml.safe_load(converted.text)
    assert "objective" not in recipe["train"] and "distill" not in recipe
    assert recipe["train"]["max_grad_norm"] == 0.5 and "adam_eps" not in recipe["train"]
    dropped = dict(converted.conversion.dropped)
    for key in ("kd_ce_alpha", "kd_alpha", "kd_temperature", "kd_beta"):
        assert dropped[key] == "read only with kd_trainer"
    assert dropped["plugins: axolotl.integrations.kd.KDPlugin"].startswith("Axolotl's distillation plugin without")
    assert dropped["datasets.0.logprobs_field"] == dropped["datasets.0.temperature"]
    assert dropped["datasets.0.temperature"].startswith("read only by Axolotl's distillation dataset types")
    assert dropped["kd_temperature_min"].startswith("only with kd_online_server_base_url, which is refused")
    assert dropped["kd_online_topk"] == "only with kd_online_server_base_url, which is refused"


# --- the loss ------------------------------------------------------------------------------------------------------


def _axolotl_kd_loss(h, w, ids, stored, labels, kd_alpha, kd_ce_alpha, temperature, beta=0.0):
    """Axolotl's offline KD step loss, written out from its source (kd/chat_template.py: each token's stored top-k
    renormalized to sum to 1, the generation temperature equal to kd_temperature; kd/kernels/liger.py
    distillation_loss_fn with normalize_topk off: the divergence summed over the top-k entries only, the student's
    logits / kd_temperature; the cross-entropy at temperature 1; kd/trainer.py: / the trained tokens). The
    gradient is of this (the T^2 Axolotl multiplies into its logged KD term is not in its gradient)."""
    teacher = stored.exp() / stored.exp().sum(dim=1, keepdim=True)
    t_log = teacher.log()
    logits = h @ w.T
    s_log = torch.log_softmax(logits / temperature, dim=1).gather(1, ids)
    if beta == 0:
        kd = (teacher * (t_log - s_log)).sum()
    else:
        m = ((1 - beta) * s_log.exp() + beta * teacher).log()
        kd = beta * (teacher * (t_log - m)).sum() + (1 - beta) * (s_log.exp() * (s_log - m)).sum()
    ce = F.cross_entropy(logits, labels, reduction="sum")
    return (kd_alpha * kd + kd_ce_alpha * ce) / len(labels)


def _finetune_loss(h, w, ids, stored, labels, sft_weight, temperature, beta=0.0):
    div = distill_stored_loss(h, w, None, ids, stored, beta=beta, temperature=temperature).loss
    return (div + sft_weight * F.cross_entropy(h @ w.T, labels, reduction="sum")) / len(labels)


def _case(normalized: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, d, vocab, k = 12, 16, 40, 6
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, d, generator=g, dtype=torch.float64) * 0.5
    teacher = torch.log_softmax(torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2, dim=1)
    stored, ids = teacher.topk(k, dim=1)  # descending, as finetune keeps them
    if normalized:  # stored already summing to 1 (Axolotl's own renormalization applied to the data)
        stored = stored - stored.logsumexp(dim=1, keepdim=True)
    labels = torch.randint(0, vocab, (n,), generator=g)
    return h, w, ids, stored, labels


@pytest.mark.parametrize(("kd_alpha", "kd_ce_alpha", "temperature"), [(0.8, 0.1, 2.0), (1.0, 0.0, 1.0),
                                                                       (0.5, 0.5, 0.7)])
def test_the_converted_loss_is_axolotls_over_kd_alpha_when_the_stored_top_k_sum_to_1(kd_alpha, kd_ce_alpha,
                                                                                        temperature):
    """kd_beta 0 (forward KL), kd_normalize_topk off: with the stored top-k summing to 1, finetune's loss with
    sft_weight = kd_ce_alpha / kd_alpha is Axolotl's / kd_alpha, value and gradient."""
    h, w, ids, stored, labels = _case(normalized=True)
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    ours = _finetune_loss(hs, ws, ids, stored, labels, kd_ce_alpha / kd_alpha, temperature)
    ours.backward()
    ha, wa = h.clone().requires_grad_(), w.clone().requires_grad_()
    theirs = _axolotl_kd_loss(ha, wa, ids, stored, labels, kd_alpha, kd_ce_alpha, temperature)
    theirs.backward()
    torch.testing.assert_close(ours * kd_alpha, theirs, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(hs.grad * kd_alpha, ha.grad, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(ws.grad * kd_alpha, wa.grad, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize(("normalized", "beta"), [(False, 0.0), (True, 0.5), (True, 1.0)])
def test_what_is_approximated_differs(normalized, beta):
    """The approximations are real: stored top-k that do not sum to 1 (Axolotl renormalizes them; finetune keeps
    the rest as a tail bucket), and kd_beta above 0 (finetune's student side counts its mass outside the top-k)."""
    h, w, ids, stored, labels = _case(normalized=normalized, seed=1)
    hs, ha = h.clone().requires_grad_(), h.clone().requires_grad_()
    _finetune_loss(hs, w, ids, stored, labels, 0.0, 1.0, beta).backward()
    _axolotl_kd_loss(ha, w, ids, stored, labels, 1.0, 0.0, 1.0, beta).backward()
    assert (hs.grad - ha.grad).norm() > 0.05 * ha.grad.norm()


@pytest.mark.parametrize("clip", [0.05, 100.0])  # clipping every step, or never
def test_scaling_max_grad_norm_and_adam_eps_with_the_loss_gives_adamws_steps(clip):
    """The loss / kd_alpha with max_grad_norm / kd_alpha and eps / kd_alpha: AdamW takes the same steps (up to the
    1e-6 clip_grad_norm_ adds to the norm), so the recipe trains as Axolotl's config does; with the loss scaled
    alone, the steps differ where clipping does not hide the scale."""
    alpha, eps = 0.3, 0.05  # an eps large enough that not scaling it shows

    def run(loss_scale: float, scale: float) -> torch.Tensor:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4, dtype=torch.float64)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=eps / scale, weight_decay=0.1)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(16, 8, generator=g, dtype=torch.float64)
            loss = model(x).pow(2).mean() / loss_scale
            opt.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip / scale)
            assert (norm > clip / scale) == (clip < 1)
            opt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    axolotl = run(1.0, 1.0)
    torch.testing.assert_close(run(alpha, alpha), axolotl, rtol=1e-5, atol=1e-9)
    if clip > 1:
        assert (run(alpha, 1.0) - axolotl).abs().max() > 1e-4


_WEIRD = ({"a": 1}, [1, "x"], "text", -3, 2.5, True, False, 0, [], None)


def test_never_a_traceback_whatever_the_kd_values(tmp_path):
    """Every KD key, and a KD dataset's keys, with values of the wrong kinds: a recipe or a UserError."""
    base = yaml.safe_load(KD)
    for key in ("kd_trainer", "kd_alpha", "kd_ce_alpha", "kd_temperature", "kd_beta", "kd_normalize_topk",
                "plugins", "logprobs_field", "temperature", "type"):
        for value in _WEIRD:
            config = {**base, "datasets": [dict(base["datasets"][0])]}
            (config["datasets"][0] if key in ("logprobs_field", "temperature", "type") else config)[key] = value
            with contextlib.suppress(UserError):
                _convert(tmp_path, yaml.safe_dump(config))
