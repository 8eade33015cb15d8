"""`finetune convert axolotl CONFIG [-o RECIPE] [--allow-approx]`: an Axolotl config in, a finetune recipe out.

Every key is looked up in the tables of keys.py: refused and approximated keys that are set become problems (an
approximation is accepted with --allow-approx, and announced), dropped keys go to the recipe's header with their
reason, mapped keys are carried over by the rules (rules_*.py, datasets.py, schedule.py), and a key in no table
is an error with the closest Axolotl key. Axolotl's defaults that differ from finetune's are written out. Every
problem is collected and reported at once, in the format of recipe errors; the recipe is validated before it is
written, so a conversion that succeeds gives a recipe `finetune validate` accepts.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.convert.context import Conversion, is_off
from finetune.convert.datasets import dataset_rules
from finetune.convert.keys import APPROXIMATED, DROPPED, MAPPED, REFUSED
from finetune.convert.reading import read_config
from finetune.convert.rules_distill import distill_rules, distill_scale
from finetune.convert.rules_model import (
    adapter_rules,
    attention_rules,
    model_rules,
    precision_rules,
    qat_rules,
    router_loss_rules,
    unfrozen_rules,
)
from finetune.convert.rules_tokens import chat_template_rules, token_rules
from finetune.convert.rules_train import batch_rules, data_rules, lr_rules, objective_rules, optimizer_rules
from finetune.convert.rules_vision import vision_rules
from finetune.convert.schedule import cadence_rules, parallel_rules, run_rules
from finetune.convert.streaming import streaming_rules
from finetune.convert.writing import recipe_text
from finetune.errors import UserError
from finetune.recipe import validate

# Refused keys set to Axolotl's own default are unset all the same.
_REFUSED_DEFAULTS: dict[str, Any] = {"lisa_layers_attribute": "model.layers", "eaft_alpha": 1.0, "eaft_k": 20}
# Keys whose schema type takes no null: Axolotl refuses `output_dir:` left empty.
_NOT_NULL = ("output_dir",)
# What an accepted approximation writes into the recipe (the others only change nothing or are rules' business).
_APPROXIMATION_EFFECTS: dict[str, tuple[str, Any]] = {"dataloader_drop_last": ("data.drop_last", True)}


@dataclass(frozen=True)
class Converted:
    """A successful conversion: the recipe's text and what the user should be told (approximations, notes)."""

    text: str
    conversion: Conversion

    @property
    def announcements(self) -> list[str]:
        return [f"approximation: {a}" for a in self.conversion.approximations] + \
               [f"note: {n}" for n in self.conversion.notes]


def convert_axolotl(path: str | Path, allow_approx: bool = False, allow_template_path: bool = False) -> Converted:
    """Convert the Axolotl config at `path`; a UserError listing every problem when it cannot be done faithfully.

    `allow_template_path`: read chat_template_jinja from a file outside the config's folder too."""
    file = Path(path).expanduser()
    c = Conversion(read_config(file), allow_approx=allow_approx, allow_template_path=allow_template_path)
    check_keys(c)
    apply_rules(c, file.parent)
    if not c.problems:
        c.problems += recipe_problems(c.recipe)
    if c.problems:
        noun = "problem" if len(c.problems) == 1 else "problems"
        raise UserError(f"{file}: {len(c.problems)} {noun} converting the Axolotl config:\n"
                        + "\n".join(f"  - {p}" for p in c.problems))
    return Converted(recipe_text(c, str(path)), c)


def check_keys(c: Conversion) -> None:
    """Each top-level key by its table: unknown, refused and approximated ones now; mapped ones by the rules."""
    known = {*MAPPED, *DROPPED, *APPROXIMATED, *REFUSED}
    unset = []
    for key, value in c.config.items():
        if key not in known:
            guess = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            c.refuse(key, "not an Axolotl key (Axolotl ignores it silently)"
                     + (f"; did you mean '{guess[0]}'?" if guess else "; remove it"))
        elif value is None and key in _NOT_NULL:
            c.refuse(key, "null: Axolotl expects a string here (it rejects this config itself)")
        elif value is None:
            unset.append(key)
        elif key in REFUSED and not is_off(value) and value != _REFUSED_DEFAULTS.get(key):
            c.refuse(key, REFUSED[key])
        elif key in APPROXIMATED and not is_off(value):
            c.approximate(key, APPROXIMATED[key])
            if key in _APPROXIMATION_EFFECTS:
                c.put(*_APPROXIMATION_EFFECTS[key])
        elif key in DROPPED:
            c.drop(key, DROPPED[key])
    c.unset += unset


def apply_rules(c: Conversion, base: Path) -> None:
    """The mapped keys, in dependency order (the objective before the datasets, the datasets before the chat
    template, the precision before the adapter, the optimizer before distillation's scaling of it)."""
    model_rules(c)
    precision_rules(c)
    attention_rules(c)
    objective_rules(c)
    distill_rules(c)
    adapter_rules(c)
    unfrozen_rules(c)
    vision_rules(c)
    batch_rules(c)
    router_loss_rules(c)
    qat_rules(c)
    lr_rules(c)
    optimizer_rules(c)
    distill_scale(c)
    data_rules(c)
    templates = dataset_rules(c, "datasets", "datasets") + dataset_rules(c, "test_datasets", "eval_datasets")
    streaming_rules(c)
    if not c.recipe.get("datasets") and not c.problems:
        c.refuse("datasets", "required: at least one training dataset")
    chat_template_rules(c, templates, base)
    token_rules(c)
    has_eval = bool(c.recipe.get("eval_datasets")) or bool(c.peek("data.val_fraction"))
    cadence_rules(c, has_eval)
    run_rules(c)
    parallel_rules(c, base)


def recipe_problems(recipe: dict[str, Any]) -> list[str]:
    """What `finetune validate` would say about the recipe (its lines, as problems of the conversion)."""
    try:
        validate(recipe, source="recipe")
    except UserError as e:
        return [f"recipe {line.strip()[2:]}" for line in str(e).splitlines()[1:]]
    return []
