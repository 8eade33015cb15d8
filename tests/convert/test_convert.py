"""`finetune convert axolotl`: golden conversions of hand-written Axolotl configs (tests/fixtures/axolotl), every
problem at once, approximations only with --allow-approx, Axolotl's defaults written out, every schema key in
exactly one table and every mapped key read by a rule, strict reading, never a traceback, the CLI, and the
generated docs/migrating-from-axolotl.md."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

from finetune import __version__
from finetune.cli import main
from finetune.convert import axolotl as converter
from finetune.convert import convert_axolotl
from finetune.convert.keys import (
    APPROXIMATED,
    DATASET_DROPPED,
    DATASET_MAPPED,
    DATASET_REFUSED,
    DROPPED,
    MAPPED,
    OUTSIDE_SCHEMA,
    REFUSED,
)
from finetune.errors import UserError
from finetune.recipe import validate

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "axolotl"
CONFIGS = sorted((FIXTURES / "configs").glob("*.yml"))


def _convert(tmp_path: Path, text: str, allow_approx: bool = False):
    config = tmp_path / "config.yml"
    config.write_text(text, encoding="utf-8")
    return convert_axolotl(config, allow_approx=allow_approx)


def _error(tmp_path: Path, text: str, allow_approx: bool = False) -> str:
    with pytest.raises(UserError) as e:
        _convert(tmp_path, text, allow_approx)
    return str(e.value)


MINIMAL = "base_model: org/model\ndatasets:\n  - {path: data.jsonl, type: alpaca}\n"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_golden_conversions(config, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # the header names the config as given: relative, so the expected text is stable
    relative = config.relative_to(REPO_ROOT)
    expected_recipe = FIXTURES / "expected" / f"{config.stem}.yaml"
    if expected_recipe.exists():
        text = convert_axolotl(relative, allow_approx=config.stem.startswith("approx")).text
        assert text.replace(f"(finetune {__version__})", "(finetune VERSION)") == expected_recipe.read_text("utf-8")
        validate(yaml.safe_load(text))  # what `finetune validate` checks, local data files aside
    else:
        with pytest.raises(UserError) as e:
            convert_axolotl(relative, allow_approx=True)
        expected = (FIXTURES / "expected" / f"{config.stem}.txt").read_text(encoding="utf-8")
        assert f"error: {e.value}\n" == expected


def test_every_problem_at_once_and_approximations_only_when_allowed(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    approx = Path("tests/fixtures/axolotl/configs/approx-8bit-completion.yml")
    with pytest.raises(UserError) as e:
        convert_axolotl(approx)
    lines = str(e.value).splitlines()
    assert lines[0] == f"{approx}: 4 problems converting the Axolotl config:"
    assert all(line.startswith("  - ") and "(--allow-approx accepts it)" in line for line in lines[1:])
    keys = ["tokenizer_type", "load_in_8bit", "optimizer", "datasets.0.type"]
    assert [line[4:].split(":")[0] for line in lines[1:]] == keys
    result = convert_axolotl(approx, allow_approx=True)
    assert [a.split(":")[1].strip() for a in result.announcements] == keys  # each announced, nothing else
    # An approximation does not excuse a refusal: both kinds are listed, the refusal stays with --allow-approx.
    message = _error(tmp_path, MINIMAL + "load_in_8bit: true\nadapter: lora\nlora_target_linear: true\nrl: kto\n",
                     allow_approx=True)
    assert "1 problem" in message and "rl: kto" in message and "load_in_8bit" not in message


def test_a_minimal_config_resolves_to_axolotls_defaults(tmp_path):
    recipe = yaml.safe_load(_convert(tmp_path, MINIMAL + "val_set_size: 0.1\n").text)
    assert recipe["seed"] == 42 and recipe["output_dir"] == "./model-out"
    assert recipe["data"] == {"max_seq_len": 512, "packing": False, "truncation": "drop", "val_fraction": 0.1}
    assert recipe["train"] == {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "lr": 5e-05,
                               "warmup_ratio": 0.03, "warmup_max_steps": 100, "warmup_from_zero": True}
    assert recipe["checkpoint"] == {"keep_last": 4}
    assert recipe["eval"] == {"at_start": False}  # no cadence: Axolotl never evaluates
    assert recipe["model"]["dtype"] == "bfloat16"  # bf16: auto on the GPUs Axolotl targets
    assert recipe["datasets"] == [{"path": "data.jsonl", "format": "alpaca", "prompt_template": "alpaca"}]


def _schema_names() -> dict[str, list[str]]:
    names: dict[str, list[str]] = {}
    section = None
    for line in (FIXTURES / "schema_keys.txt").read_text(encoding="utf-8").splitlines():
        if line.startswith("[") and line.endswith("]"):
            section = names.setdefault(line[1:-1], [])
        elif line.strip() and not line.startswith("#"):
            section.append(line.strip())
    return names


def test_every_axolotl_schema_field_is_in_exactly_one_table():
    names = _schema_names()
    assert len(names["top"]) > 450 and len(names["datasets"]) > 35
    for level, tables in (("top", (MAPPED, DROPPED, APPROXIMATED, REFUSED)),
                          ("datasets", (DATASET_MAPPED, DATASET_DROPPED, DATASET_REFUSED))):
        for name in names[level]:
            assert sum(name in table for table in tables) == 1, f"{level}: {name}"
        extra = set().union(*tables) - set(names[level]) - set(OUTSIDE_SCHEMA)
        assert not extra, f"{level}: keys that are no Axolotl field: {extra}"
    # Keys Axolotl ignores because its schema lacks them: one that became a field again must be placed by its use.
    assert set(OUTSIDE_SCHEMA) <= set(DROPPED) and not set(OUTSIDE_SCHEMA) & set(names["top"])


class _Recording(dict):
    """A config that remembers which keys the rules looked up."""

    read: set[str] = set()

    def get(self, key, default=None):
        _Recording.read.add(key)
        return super().get(key, default)


@pytest.mark.parametrize("extra", ["", "rl: dpo\n", "rl: orpo\n", "tokens: [x]\n",
                                   "adapter: lora\nlora_target_linear: true\n"])
def test_every_mapped_key_is_read_by_a_rule(tmp_path, monkeypatch, extra):
    real = converter.read_config
    monkeypatch.setattr(converter, "read_config", lambda path: _Recording(real(path)))
    text = MINIMAL.replace("type: alpaca", "type: chat_template.default" if "rl" in extra else "type: alpaca")
    _convert(tmp_path, text + extra)
    if extra.startswith("adapter"):  # the last case: by now every rule has run in some configuration
        assert set(MAPPED) - _Recording.read == set()


GRPO = ("base_model: org/model\nrl: grpo\ntrl:\n  beta: 0.04\n  num_generations: 8\n  max_completion_length: 256\n"
        "  loss_type: dr_grpo\n  scale_rewards: false\n  reward_funcs: [rewards.accuracy, rewards.format]\n"
        "  reward_weights: [1.0, 0.5]\n  use_vllm: true\n")


def test_grpo_and_its_trl_block_convert(tmp_path):
    """rl: grpo's trl: block becomes the grpo: section (TRL's loss types to normalize); bnpo is only approximate;
    an Axolotl GRPO dataset's transform is not run (said in the notes: the rows are read as prompt rows); a TRL key
    we lack is refused by name."""
    converted = _convert(tmp_path, GRPO + "datasets:\n  - {path: gsm8k, type: gsm8k.transform}\n")
    recipe = yaml.safe_load(converted.text)
    assert recipe["datasets"] == [{"path": "gsm8k", "format": "prompt"}]
    assert any("gsm8k.transform is not run" in n for n in converted.conversion.notes)
    assert recipe["train"]["objective"] == "grpo" and recipe["data"]["packing"] is False
    g = recipe["grpo"]
    assert (g["beta"], g["num_generations"], g["max_new_tokens"], g["normalize"], g["scale_rewards"]) == (
        0.04, 8, 256, "constant", "none")
    assert g["rewards"] == [{"function": "rewards:accuracy", "weight": 1.0}, {"function": "rewards:format", "weight": 0.5}]
    assert "only approximately: bnpo" in _error(tmp_path, GRPO.replace("dr_grpo", "bnpo"))
    assert "trl.delta: not supported" in _error(tmp_path, GRPO + "  delta: 2.0\n")
    assert "trl: TRL trainer options are read with rl: grpo only" in _error(tmp_path, MINIMAL + "trl: {beta: 1}\n")


GRPO_DATA = "datasets:\n  - {path: prompts.jsonl, type: gsm8k.transform}\n"


@pytest.mark.parametrize(("loss_type", "normalize"), [("dapo", "tokens"), ("grpo", "sequences"),
                                                      ("dr_grpo", "constant"), (None, "tokens")])
def test_trl_loss_types_map_to_normalize(tmp_path, loss_type, normalize):
    """TRL's loss types whose normalizer is exact under any split carry over as they are (docs/rl.md's table);
    no loss_type is TRL 1.x's default, dapo. Nothing is approximated."""
    text = GRPO.replace("  loss_type: dr_grpo\n", f"  loss_type: {loss_type}\n" if loss_type else "")
    converted = _convert(tmp_path, text + GRPO_DATA)
    assert yaml.safe_load(converted.text)["grpo"]["normalize"] == normalize
    assert converted.conversion.approximations == [] and "Approximations" not in converted.text


def test_bnpo_becomes_tokens_only_with_allow_approx_and_the_header_says_so(tmp_path):
    text = GRPO.replace("dr_grpo", "bnpo") + GRPO_DATA
    assert "trl.loss_type: only approximately: bnpo normalizes each micro-batch" in _error(tmp_path, text)
    converted = _convert(tmp_path, text, allow_approx=True)
    assert yaml.safe_load(converted.text)["grpo"]["normalize"] == "tokens"
    header = converted.text.split("\noutput_dir:")[0]
    assert "# Approximations (accepted with --allow-approx):\n#   trl.loss_type: bnpo normalizes each" in header
    assert "normalize: tokens is the same over the whole step" in header


def test_strict_reading(tmp_path):
    assert "duplicate key 'learning_rate'" in _error(tmp_path, MINIMAL + "learning_rate: 1e-4\nlearning_rate: 2e-4\n")
    train = yaml.safe_load(_convert(tmp_path, MINIMAL + "learning_rate: 1e-4\n").text)["train"]
    assert train["lr"] == 1e-4  # a number, as YAML 1.2 reads it
    assert yaml.safe_load(_convert(tmp_path, MINIMAL + "learning_rate: '2e-5'\n").text)["train"]["lr"] == 2e-5
    assert "micro_batch_size: got '2'; Axolotl expects a whole number" in _error(tmp_path, MINIMAL +
                                                                                 "micro_batch_size: '2'\n")
    assert "an Axolotl config is a mapping of keys" in _error(tmp_path, "- just\n- a list\n")
    assert "output_dir: null: Axolotl expects a string" in _error(tmp_path, MINIMAL + "output_dir:\n")
    assert "seed: 42" in _convert(tmp_path, MINIMAL + "seed:\n").text  # any other null is unset, as in Axolotl
    assert "no such Axolotl config" in str(pytest.raises(UserError, convert_axolotl, tmp_path / "nope.yml").value)


def test_unknown_keys_get_the_closest_axolotl_key(tmp_path):
    message = _error(tmp_path, MINIMAL + "lerning_rate: 1e-4\nzzyzx: true\nadam_eps: 1e-8\n")
    assert "lerning_rate: not an Axolotl key (Axolotl ignores it silently); did you mean 'learning_rate'?" in message
    assert "zzyzx: not an Axolotl key (Axolotl ignores it silently); remove it" in message
    assert "adam_eps: not an Axolotl key (Axolotl ignores it silently); did you mean 'adam_epsilon'?" in message
    message = _error(tmp_path, MINIMAL.replace("type: alpaca", "type: alpaca, feild: text"))
    assert "datasets.0.feild: not an Axolotl dataset key (Axolotl ignores it silently); did you mean 'field'?" in message


def test_keys_outside_axolotls_schema_are_dropped_with_why(tmp_path):
    """Stale keys Axolotl's own examples still set (Axolotl ignores them: its schema lacks them) convert, each listed
    in the header with its reason; set to null they are unset, as any key."""
    stale = "debug: true\ngptq_groupsize: 128\ngptq_model_v1: false\neta_min: 7e-7\nfull_finetune: true\n" \
            "test_value: true\ntorch_dtype: bfloat16\n"
    converted = _convert(tmp_path, MINIMAL + stale)
    assert yaml.safe_load(converted.text) == yaml.safe_load(_convert(tmp_path, MINIMAL).text)  # the same training
    dropped = dict(converted.conversion.dropped)
    assert set(dropped) == set(yaml.safe_load(stale)) and all("Axolotl ignores it" in why for why in dropped.values())
    header = converted.text.split("\noutput_dir:")[0]
    assert "#   gptq_groupsize, gptq_model_v1: not in Axolotl's config schema, so Axolotl ignores it" in header
    converted = _convert(tmp_path, MINIMAL + "gptq_groupsize:\ngptq_model_v1:\n")
    assert converted.conversion.unset == ["gptq_groupsize", "gptq_model_v1"] and not converted.conversion.dropped


@pytest.mark.parametrize(("keys", "checkpoint"), [
    ("saves_per_epoch: 4\n", {"every_epochs": 0.25}),
    ("saves_per_epoch: 2\nnum_epochs: 3\n", {"every_epochs": 0.5}),
    ("saves_per_epoch: 1\nnum_epochs: 3\n", {"every_epochs": 1}),
    ("saves_per_epoch: 4\nmax_steps: 100\n", {"every_steps": 25}),
    ("saves_per_epoch: 2\nnum_epochs: 3\nmax_steps: 100\n", {"every_steps": 17}),  # ceil(100 / 6)
    ("saves_per_epoch: 1\nmax_steps: 100\n", {"every_epochs": 1}),  # Axolotl's default: each epoch's end
    ("saves_per_epoch: 1\n", {}),  # one save at the one epoch's end: the final model
])
def test_saves_per_epoch_becomes_the_checkpoint_cadence(tmp_path, keys, checkpoint):
    """Axolotl's save_steps = 1 / (saves_per_epoch x num_epochs) when below 1 (a fraction of the run), else its
    default, a save at each epoch's end: the same recipe as without saves_per_epoch."""
    recipe = yaml.safe_load(_convert(tmp_path, MINIMAL + keys).text)
    assert {k: v for k, v in recipe["checkpoint"].items() if k != "keep_last"} == checkpoint
    if keys.startswith("saves_per_epoch: 1\n"):
        unset = yaml.safe_load(_convert(tmp_path, MINIMAL + keys.replace("saves_per_epoch: 1\n", "")).text)
        assert recipe == unset


_WEIRD = ({"a": 1}, [1, "x"], "text", -3, 2.5, True, [])


def test_never_a_traceback_whatever_the_values(tmp_path):
    """Every key of every table with values of the wrong kinds: a recipe or a UserError, nothing else."""
    keys = [*MAPPED, *DROPPED, *APPROXIMATED, *REFUSED]
    for i, key in enumerate(keys):
        value = _WEIRD[i % len(_WEIRD)]
        for text in (MINIMAL + yaml.safe_dump({key: value}), MINIMAL.replace(
                "type: alpaca", f"type: chat_template, {list(DATASET_MAPPED)[i % len(DATASET_MAPPED)]}: "
                                f"{yaml.safe_dump(value, default_flow_style=True).strip()}") + "rl: dpo\n"):
            with contextlib.suppress(UserError):
                _convert(tmp_path, text, allow_approx=True)


def test_cli_converts_and_the_recipe_validates(tmp_path, capsys):
    config = FIXTURES / "configs" / "llama-lora-alpaca.yml"
    out = tmp_path / "recipe.yaml"
    assert main(["convert", "axolotl", str(config), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    assert main(["validate", str(out)]) == 0
    assert "prompt_template: alpaca" in capsys.readouterr().out
    assert main(["convert", "axolotl", str(FIXTURES / "configs" / "refused-many.yml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "7 problems converting the Axolotl config" in err and "Traceback" not in err


def test_migration_doc_is_current():
    spec = importlib.util.spec_from_file_location("gen_migrating_doc", REPO_ROOT / "scripts" / "gen_migrating_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.DOC.read_text(encoding="utf-8") == module.render(), \
        "docs/migrating-from-axolotl.md is stale: run python scripts/gen_migrating_doc.py"


def test_deduplication_and_model_config_overrides_convert(tmp_path):
    """dataset_exact_deduplication -> data.deduplicate: exact (approximated where Axolotl's preference path also drops
    eval rows equal to training rows); model_config (overrides_of_model_config) -> model.config_overrides."""
    text = MINIMAL + "dataset_exact_deduplication: true\nmodel_config:\n  attention_dropout: 0.1\n"
    recipe = yaml.safe_load(_convert(tmp_path, text).text)
    assert recipe["data"]["deduplicate"] == "exact"
    assert recipe["model"]["config_overrides"] == {"attention_dropout": 0.1}
    same = yaml.safe_load(_convert(tmp_path, MINIMAL + "overrides_of_model_config: {rope_theta: 1.0e6}\n").text)
    assert same["model"]["config_overrides"] == {"rope_theta": 1.0e6}
    dpo = (MINIMAL.replace("type: alpaca", "type: chat_template.default") + "rl: dpo\ndataset_exact_deduplication: "
           "true\ntest_datasets:\n  - {path: eval.jsonl, type: chat_template.default}\n")
    assert "dataset_exact_deduplication: only approximately: eval rows equal to training rows" in _error(tmp_path, dpo)
    assert yaml.safe_load(_convert(tmp_path, dpo, allow_approx=True).text)["data"]["deduplicate"] == "exact"
    assert "overrides_of_model_config: model_config is its other name" in \
        _error(tmp_path, MINIMAL + "model_config: {a: 1}\noverrides_of_model_config: {a: 2}\n")


def test_context_parallel_size_converts():
    """context_parallel_size (sequence_parallel_degree, its older name) -> distributed.context_parallel; 1 is the
    default and writes nothing."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        for key in ("context_parallel_size", "sequence_parallel_degree"):
            recipe = yaml.safe_load(_convert(Path(tmp), MINIMAL + f"{key}: 4\n").text)
            assert recipe["distributed"]["context_parallel"] == 4
            assert recipe["distributed"]["context_parallel_method"] == "ring"  # as Axolotl's: any head count
        plain = yaml.safe_load(_convert(Path(tmp), MINIMAL + "context_parallel_size: 1\n").text)
        assert "context_parallel" not in (plain.get("distributed") or {})


def test_lora_target_parameters_carry_over_to_the_fused_experts(tmp_path):
    text = _convert(tmp_path, MINIMAL + "adapter: lora\nlora_target_linear: true\n"
                    "lora_target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]\n").text
    recipe = yaml.safe_load(text)
    assert recipe["adapter"]["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    validate(recipe)


def test_the_moe_router_loss_converts_with_its_weight_said(tmp_path):
    """model_config: {output_router_logits: true} -> model.config_overrides (finetune adds the router's load-balancing
    loss): with one micro-batch a step a note (Axolotl's weighs it N times on N GPUs); with gradient accumulation an
    approximation (Axolotl's sums the micro-batches' values, finetune takes their mean); refused with rl."""
    moe = MINIMAL + "model_config: {output_router_logits: true, router_aux_loss_coef: 0.02}\n"
    converted = _convert(tmp_path, moe)
    assert yaml.safe_load(converted.text)["model"]["config_overrides"] == {"output_router_logits": True,
                                                                          "router_aux_loss_coef": 0.02}
    assert any(n.startswith("model_config: output_router_logits: true: the MoE router's load-balancing loss is added")
               and n.endswith("N times less (docs/models.md)") for n in converted.conversion.notes)
    accumulated = moe + "gradient_accumulation_steps: 4\n"
    assert "model_config: only approximately: output_router_logits: true: a step of Axolotl (transformers' Trainer) " \
           "adds router_aux_loss_coef x the sum of its 4 micro-batches'" in _error(tmp_path, accumulated)
    approximations = _convert(tmp_path, accumulated, allow_approx=True).conversion.approximations
    assert len(approximations) == 1 and "router_aux_loss_coef: 4 x the model's" in approximations[0]
    dpo = moe.replace("type: alpaca", "type: chat_template.default") + "rl: dpo\n"
    assert "model_config: output_router_logits: true with train.objective dpo: finetune adds the MoE router's " \
           "load-balancing loss to supervised fine-tuning only" in _error(tmp_path, dpo)


def test_mistral_common_tokenizers_convert_text_only(tmp_path):
    """tokenizer_use_mistral_common -> tokenizer.backend: mistral_common; with processor_type (images through
    mistral-common's encoder, which finetune does not do) it is refused with the reason."""
    chat = MINIMAL.replace("type: alpaca", "type: chat_template") + "tokenizer_use_mistral_common: true\n"
    recipe = yaml.safe_load(_convert(tmp_path, chat).text)
    assert recipe["tokenizer"] == {"backend": "mistral_common"}
    validate(recipe)
    off = yaml.safe_load(_convert(tmp_path, chat.replace("true", "false")).text)
    assert "backend" not in off.get("tokenizer", {})
    assert "tokenizer_use_mistral_common: with processor_type: images through mistral-common" in \
        _error(tmp_path, chat + "processor_type: AutoProcessor\n", allow_approx=True)


def test_rslora_converts(tmp_path):
    recipe = yaml.safe_load(_convert(tmp_path, MINIMAL + "adapter: lora\nlora_target_linear: true\npeft_use_rslora: true\n").text)
    assert recipe["adapter"]["use_rslora"] is True


def test_drop_system_message_converts(tmp_path):
    text = MINIMAL.replace("type: alpaca}", "type: chat_template, drop_system_message: true}")
    recipe = yaml.safe_load(_convert(tmp_path, text).text)
    assert recipe["datasets"][0]["drop_system_message"] is True


def test_data_files_convert(tmp_path):
    text = MINIMAL.replace("path: data.jsonl", "path: org/corpus, data_files: a/b.json")
    assert yaml.safe_load(_convert(tmp_path, text).text)["datasets"][0]["data_files"] == ["a/b.json"]


def test_reward_models_convert(tmp_path):
    """reward_model: true (num_labels 1, AutoModelForSequenceClassification) -> train.objective: reward; Axolotl's
    bradley_terry.chat_template rows (system, input, chosen, rejected) -> a preference dataset reading them."""
    text = ("base_model: org/model\nmodel_type: AutoModelForSequenceClassification\nnum_labels: 1\nreward_model: true\n"
            "center_rewards_coefficient: 0.01\ndatasets:\n  - {path: pairs.jsonl, type: bradley_terry.chat_template}\n")
    recipe = yaml.safe_load(_convert(tmp_path, text).text)
    assert recipe["train"]["objective"] == "reward" and recipe["reward"] == {"center_coefficient": 0.01}
    assert recipe["datasets"][0] == {"path": "pairs.jsonl", "format": "preference", "prompt_field": "input",
                                     "system_field": "system"}
    assert "num_labels: 2: a reward model has one score" in _error(tmp_path, text.replace("num_labels: 1",
                                                                                         "num_labels: 2"))
    assert "with rl: dpo: a reward model trains by itself" in _error(tmp_path, text + "rl: dpo\n")


def test_early_stopping_converts_with_allow_approx(tmp_path):
    text = MINIMAL + "val_set_size: 0.1\neval_steps: 10\nearly_stopping_patience: 3\n"
    assert "early_stopping_patience: only approximately: final/ holds the weights" in _error(tmp_path, text)
    recipe = yaml.safe_load(_convert(tmp_path, text, allow_approx=True).text)
    assert recipe["eval"]["early_stopping_patience"] == 3 and recipe["eval"]["every_steps"] == 10


def test_streamed_corpora_convert(tmp_path):
    """pretraining_dataset -> completion datasets read as a stream (with --allow-approx: long texts are truncated,
    not cut in pieces); streaming: true -> data.streaming; the buffer size -> data.stream_buffer."""
    corpus = ("base_model: org/model\nmax_steps: 100\nsample_packing: true\nstreaming_multipack_buffer_size: 500\n"
              "pretraining_dataset:\n  - {path: org/web, name: en, split: train, type: pretrain, text_column: body}\n")
    assert "pretraining_dataset: only approximately: a text longer than sequence_len is truncated" in \
        _error(tmp_path, corpus)
    recipe = yaml.safe_load(_convert(tmp_path, corpus, allow_approx=True).text)
    assert recipe["datasets"] == [{"path": "org/web", "format": "completion", "name": "en", "split": "train",
                                   "text_field": "body"}]
    assert recipe["data"]["streaming"] is True and recipe["data"]["stream_buffer"] == 500
    assert recipe["data"]["truncation"] == "truncate"
    sft = yaml.safe_load(_convert(tmp_path, MINIMAL + "max_steps: 10\nstreaming: true\n").text)
    assert sft["data"]["streaming"] is True
    assert "pretraining_dataset: with datasets" in _error(tmp_path, MINIMAL + corpus.split("\n", 1)[1], True)
