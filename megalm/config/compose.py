"""configs/ composed with Hydra into a checked `MegalmConfig`: what `megalm-train` runs, and what every tool and the
estimator compose the same way (megalm.train re-exports it)."""

from __future__ import annotations

from pathlib import Path

from megalm.config.schema import MegalmConfig, register_schema, schema_error_line, to_dataclass
from megalm.errors import ConfigError

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")


def _one_line(exc: BaseException) -> str:
    """Condense a Hydra/OmegaConf composition error into one line that names the key and the fix."""
    cause = exc.__cause__ or exc
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    if any(ln.startswith("full_key:") for ln in lines):  # a key or a value against the schema
        return schema_error_line(cause)
    head = lines[0] if lines else type(cause).__name__
    if "Could not find" in head:
        options = []
        for ln in lines[1:]:
            if ln.startswith("Config search path"):
                break
            if not ln.startswith("Available options"):
                options.append(ln)
        return f"{head}; available: {', '.join(options)}" if options else head
    return head


def compose_config(overrides: list[str]) -> MegalmConfig:
    """configs/config.yaml with `overrides`, checked against the schema, as a MegalmConfig; a bad key or value
    is a one-line ConfigError (Hydra reports composition errors over several lines)."""
    from hydra import compose, initialize_config_dir

    register_schema()
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            return to_dataclass(compose(config_name="config", overrides=overrides))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any composition failure is a user error here
        raise ConfigError(_one_line(e)) from e


