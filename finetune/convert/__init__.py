"""Converting other tools' configs into recipes: `finetune convert axolotl` (axolotl.py). A plain re-export."""

from finetune.convert.axolotl import Converted, convert_axolotl

__all__ = ["Converted", "convert_axolotl"]
