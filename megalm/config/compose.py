"""configs/ composed with Hydra into a checked `MegalmConfig`: what `megalm-train` runs, and what every tool and the
estimator compose the same way (megalm.train re-exports it).

A composition costs 0.3-0.6 s of CPU (Hydra merges the structured schema: OmegaConf deep copies), and a process
often composes the same overrides again (the estimator per candidate layout, the tests' ranks and fixtures: 174 of
the default suite's 650 compositions in its two pytest workers were repeats, 2026-12-02), so each process keeps the
configs it composed, keyed by the overrides and the state of configs/' files, and hands out deep copies (0.2 ms).
"""

from __future__ import annotations

import copy
import os
from functools import lru_cache
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
    if head.startswith("Error parsing override"):  # Hydra's next line is its grammar's ("missing EQUAL at '<EOF>'")
        reason = lines[1] if len(lines) > 1 else ""
        if reason.startswith("missing EQUAL") or not reason:  # a word without '=': what an override looks like
            return (f"{head}: an override is key=value (trainer.max_steps=100) or group=option (model=125m); "
                    "megalm-train --help lists both")
        return f"{head}: {reason}"  # the grammar's own reason ("extraneous input ')'"), which names the character
    if "Could not find" in head:
        options = []
        for ln in lines[1:]:
            if ln.startswith("Config search path"):
                break
            if not ln.startswith("Available options"):
                options.append(ln)
        return f"{head}; available: {', '.join(options)}" if options else head
    return head


def config_groups_help() -> str:
    """`megalm-train --help`'s configuration groups: those configs/config.yaml's defaults list picks from, each with
    its options. Hydra's own list names every folder of configs/, configs/hdp_cost too, whose files are
    `parallel.hdp_cost`'s values and no group (`hdp_cost=h100_7b` is refused): it is named as the key it is."""
    from omegaconf import OmegaConf

    config_dir = Path(CONFIG_DIR)
    defaults = OmegaConf.to_container(OmegaConf.load(config_dir / "config.yaml"))["defaults"]
    groups = sorted(name for entry in defaults if isinstance(entry, dict) for name in entry)
    lines = [f"{group}: {', '.join(sorted(f.stem for f in (config_dir / group).glob('*.yaml')))}" for group in groups]
    costs = ", ".join(sorted(f.stem for f in (config_dir / "hdp_cost").glob("*.yaml")))
    return "\n".join([*lines, "", f"and the key parallel.hdp_cost (HDP's cost model): {costs} (configs/hdp_cost/), "
                                   "a preset (1b, 7b, 13b, 70b) or a YAML file's path"])


def register_help() -> None:
    """The resolver configs/config.yaml's help template calls for its groups (`config_groups_help`)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("megalm_config_groups"):
        OmegaConf.register_new_resolver("megalm_config_groups", config_groups_help)


def compose_config(overrides: list[str]) -> MegalmConfig:
    """configs/config.yaml with `overrides`, checked against the schema, as a MegalmConfig of the caller's own; a
    bad key or value is a one-line ConfigError (Hydra reports composition errors over several lines)."""
    return copy.deepcopy(_composed(tuple(overrides), CONFIG_DIR, _files_state(CONFIG_DIR)))


def _files_state(config_dir: str) -> tuple[tuple[str, int, int], ...]:
    """(path, mtime, size) of every file under `config_dir`: a config edited while a process runs composes anew."""
    state = []
    for root, _, files in os.walk(config_dir):
        for name in files:
            info = os.stat(os.path.join(root, name))
            state.append((os.path.join(root, name), info.st_mtime_ns, info.st_size))
    return tuple(sorted(state))


@lru_cache(maxsize=128)
def _composed(overrides: tuple[str, ...], config_dir: str, files_state: tuple) -> MegalmConfig:
    """The composition itself, once per key (a refused one raises each time: lru_cache keeps no exception)."""
    from hydra import compose, initialize_config_dir

    register_schema()
    register_help()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            return to_dataclass(compose(config_name="config", overrides=list(overrides)))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any composition failure is a user error here
        raise ConfigError(_one_line(e)) from e


