"""The recipe: the strict schema, loading (`extends:`, paths, overrides), validation, and its identity.

A plain re-export: schema.py holds the sections, loading.py reads files, validation.py checks them and words
the errors, identity.py says what a recipe is (YAML, features, the keys that define its training), names.py
finds a recipe by name and repos.py manages recipe repositories. Nothing here imports torch: `finetune
validate` answers in well under a second.
"""

from finetune.recipe.identity import (
    HARMLESS_KEYS,
    default_training_keys,
    features,
    flatten,
    recipe_hash,
    to_yaml,
    training_keys,
)
from finetune.recipe.loading import (
    apply_override,
    deep_merge,
    load_raw,
    load_recipe,
    parse_yaml,
    resolve_recipe,
)
from finetune.recipe.rl import GRPOConfig, RewardConfig
from finetune.recipe.schema import (
    DATASET_LISTS,
    AdapterConfig,
    CheckpointConfig,
    DataConfig,
    DatasetConfig,
    DistributedConfig,
    DPOConfig,
    EvalConfig,
    LoggingConfig,
    LossConfig,
    ModelConfig,
    ORPOConfig,
    Recipe,
    Section,
    TokenizerConfig,
    TrainConfig,
)
from finetune.recipe.validation import (
    LOCAL_SUFFIXES,
    cross_checks,
    data_file_not_found,
    local_data_path,
    missing_inputs,
    validate,
)

__all__ = [
    "DATASET_LISTS", "HARMLESS_KEYS", "LOCAL_SUFFIXES", "AdapterConfig", "CheckpointConfig", "DataConfig",
    "DatasetConfig", "DPOConfig", "DistributedConfig", "EvalConfig", "GRPOConfig", "LoggingConfig", "LossConfig", "ModelConfig", "ORPOConfig", "Recipe",
    "RewardConfig", "Section", "TokenizerConfig", "TrainConfig", "apply_override", "cross_checks", "data_file_not_found",
    "deep_merge", "default_training_keys", "features", "flatten", "load_raw", "load_recipe", "local_data_path", "missing_inputs",
    "parse_yaml", "recipe_hash", "resolve_recipe", "to_yaml", "training_keys", "validate",
]
