"""Structured configs: the schema (`schema`), the fixed sets a value is picked from (`choices`), and the rules
across fields (`checks`).

`configs/` holds the values; these modules hold the types, the defaults, what each field means and the checks.
This package imports no other megalm package but errors: everything imports it.
"""

from megalm.config.checks import (
    RECOMPUTE_MODES,
    blend_pairs,
    choice,
    is_hsdp,
    is_moe_layer,
    moe_layer_ids,
    override_value,
    pad_vocab,
    positive,
    process_group_minutes,
    ramp_batch_sizes,
    ramp_phases,
    ramp_values,
    recompute_modes,
    resolve_model_defaults,
    schema_default,
    set_away_from_default,
    validate,
    validate_model,
    window_within_samples,
    zero_bubble,
)
from megalm.config.choices import Choice
from megalm.config.schema import (
    DataConfig,
    LoggingConfig,
    MegalmConfig,
    ModelConfig,
    MoEConfig,
    OffloadConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    ProfilingConfig,
    SyntheticDataConfig,
    TrainerConfig,
    WandbConfig,
    config_to_dict,
    model_config,
    register_schema,
    schema_error_line,
    to_dataclass,
)

__all__ = [
    "Choice", "DataConfig", "LoggingConfig", "MegalmConfig", "ModelConfig", "MoEConfig", "OffloadConfig", "OptimConfig",
    "ParallelConfig", "PrecisionConfig", "ProfilingConfig", "SyntheticDataConfig", "TrainerConfig", "WandbConfig",
    "blend_pairs",
    "choice", "config_to_dict", "is_moe_layer", "model_config", "moe_layer_ids", "pad_vocab", "positive",
    "RECOMPUTE_MODES", "process_group_minutes", "ramp_batch_sizes", "ramp_phases", "ramp_values", "recompute_modes",
    "register_schema", "resolve_model_defaults", "schema_default", "schema_error_line",
    "override_value", "set_away_from_default", "to_dataclass",
    "validate", "validate_model", "window_within_samples", "zero_bubble", "is_hsdp",
]
