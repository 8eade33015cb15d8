"""`finetune convert axolotl` over Axolotl's whole examples folder (slow; needs a checkout).

    AXOLOTL_EXAMPLES=/path/to/axolotl/examples .venv/bin/python -m pytest -m slow tests/convert/test_convert_corpus.py -s

Every example config (*.yml, *.yaml, but the cloud/ launcher files) either converts to a recipe that validates or
is refused with its reasons (a UserError naming each key); none crashes, and none is refused for a key Axolotl itself
ignores (keys.OUTSIDE_SCHEMA: stale keys its examples still set are dropped, so a config is never refused for them).
The figures (converted / total, exactly and with --allow-approx, for all configs and for the vision-language ones:
processor_type set) are printed; README.md quotes them for Axolotl at commit 067b021c8 (192 of its 250 with
--allow-approx, 84 without; 132 before Axolotl's ignored keys were dropped; 22 of its 29 vision-language ones).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

from finetune.convert import convert_axolotl
from finetune.convert.keys import OUTSIDE_SCHEMA
from finetune.errors import UserError
from finetune.recipe import validate

EXAMPLES = os.environ.get("AXOLOTL_EXAMPLES")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not EXAMPLES, reason="set AXOLOTL_EXAMPLES to an Axolotl checkout's examples/")]


def _configs(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".yml", ".yaml") and p.relative_to(root).parts[0] != "cloud")


def test_the_examples_convert_or_are_refused_with_reasons():
    root = Path(EXAMPLES)
    configs = _configs(root)
    counts, reasons, ignored = Counter(), Counter(), []
    vision = {c for c in configs if (yaml.safe_load(c.read_text(encoding="utf-8")) or {}).get("processor_type")}
    for config in configs:
        for approx in (False, True):
            try:
                recipe = yaml.safe_load(convert_axolotl(config, allow_approx=approx).text)
            except UserError as e:
                lines = str(e).splitlines()
                assert lines[0].endswith("converting the Axolotl config:") and len(lines) > 1, config
                assert all(re.match(r"  - [\w.\[\]: -]+: \S", line) for line in lines[1:]), (config, lines)
                if approx:
                    keys = [re.sub(r"\.\d+\.", ".N.", line[4:].split(":")[0]) for line in lines[1:]]
                    reasons.update(keys)
                    ignored += [(config.name, key) for key in keys if key in OUTSIDE_SCHEMA]
                continue
            validate(recipe)  # the recipe `finetune validate` accepts (local data files aside)
            counts[approx] += 1
            counts["vision", approx] += config in vision
    print(f"\n{counts[False]}/{len(configs)} convert exactly, {counts[True]}/{len(configs)} with --allow-approx")
    print(f"vision-language (processor_type): {counts['vision', False]}/{len(vision)} exactly, "
          f"{counts['vision', True]}/{len(vision)} with --allow-approx")
    print("refusals (with --allow-approx), by key:", ", ".join(f"{k} {n}" for k, n in reasons.most_common(25)))
    assert not ignored, f"refused for keys Axolotl ignores: {ignored}"
    assert counts[True] >= 192 and counts["vision", True] >= 22
