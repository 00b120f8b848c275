"""megalm-train's run dir: the checks before Hydra makes it (a path the run could not write in, another program's
files, a checkpoint of another model), and the one dir every rank of a torchrun job (and every restart attempt of
it) shares, whatever each process's clock made of Hydra's default outputs/DATE/TIME."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from megalm.config import MegalmConfig, config_to_dict, process_group_minutes
from megalm.errors import ConfigError

log = logging.getLogger("megalm")
RUN_DIR_KEY = "megalm_run_dir"  # in torchrun's agent store: the first attempt's run dir


def check_creatable(run_dir: Path, what: str, fix: str = "choose a run dir you may write to (hydra.run.dir=PATH)"
                    ) -> None:
    """Refuse a run dir (or another output directory: `fix` then names its flag) the run could not make or write in
    (Hydra would fail with a traceback): its nearest existing ancestor must be a directory this process can write
    in."""
    existing = run_dir.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{what}: {existing} is a file, so the directory cannot be made there; choose another path")
    try:  # a real write (os.access passes root on a read-only file system): an empty directory, removed at once
        os.rmdir(tempfile.mkdtemp(prefix=".megalm-write-check-", dir=existing))
    except OSError as e:
        raise ConfigError(f"{what}: cannot write in {existing} ({e.strerror}); {fix}") from None


def check_run_dir(run_dir: Path) -> None:
    """Refuse a run dir that is a checkpoint or holds another program's config.yaml or metrics.jsonl: a run would
    overwrite the config.yaml and append to the metrics. A megalm run's config.yaml is a mapping with model and
    trainer sections."""
    config, metrics = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    if (run_dir / "state.json").exists() or any(run_dir.glob("shard-*.safetensors")):
        # a checkpoint (a run dir holds its own in checkpoints/step_*): its config.yaml has model and trainer sections
        # too, and a run would write its own over it, leaving the weights unreadable
        raise ConfigError(f"{run_dir} is a checkpoint, and a run there would overwrite its config.yaml; continue from "
                          f"it with trainer.resume={run_dir} (or start from its weights with model.init_from="
                          f"{run_dir}) in a new hydra.run.dir")
    if config.exists():
        try:
            saved = OmegaConf.to_container(OmegaConf.load(config))
        except Exception:  # any unreadable YAML: not a run's
            saved = None
        if not (isinstance(saved, dict) and {"model", "trainer"} <= saved.keys()):
            raise ConfigError(f"{config} is not a megalm run's config.yaml, and a run would overwrite it; choose a "
                              "new or empty run dir (hydra.run.dir; hydra.sweep.dir under -m)")
    elif metrics.exists():
        raise ConfigError(f"{metrics} exists without the config.yaml of the run that wrote it, and a run would add "
                          "to it; choose a new or empty run dir (hydra.run.dir; hydra.sweep.dir under -m)")


def check_own_checkpoints(run_dir: Path, config: MegalmConfig) -> None:
    """What the trainer refuses of a run dir's own latest checkpoint that a glance at it shows (another model's shapes,
    a step past trainer.max_steps, or trainer.resume=never), refused before Hydra rewrites the dir's
    .hydra/ and config.yaml with this command (the record of the command that wrote the checkpoints was lost)."""
    from megalm.config.checks import resolve_model_defaults
    from megalm.training import checkpoint as ckpt

    latest = ckpt.latest_unless_never(run_dir, config.trainer.resume)
    if latest is None or config.trainer.resume != "auto":  # a PATH: the trainer's to resolve
        return
    step = latest.name.removeprefix("step_")
    if step.isdigit():  # (the trainer says what it only notes)
        ckpt.check_resume_target(latest, int(step), config.trainer, run_dir, False, note=False)
    try:
        saved = OmegaConf.to_container(OmegaConf.load(latest / "config.yaml"))
    except Exception:  # any unreadable config: the trainer's checks name the damage
        return
    if isinstance(saved, dict) and isinstance(saved.get("model"), dict):
        current = config_to_dict(resolve_model_defaults(config.model))
        ckpt.check_model_config(saved["model"], current, latest)


def shared_run_dir(own_dir: Path, config: MegalmConfig, sweep_job: int | None = None) -> tuple[Path, int]:
    """Under torchrun every rank composes its own Hydra run dir (from its own clock); all ranks take rank 0's, and a
    rank whose dir differs removes the empty one Hydra made for it. A restarted attempt's rank 0 takes the job's
    first attempt's (`first_attempt_run_dir`; `sweep_job`: the job's number in a sweep, None outside one), and every
    rank's train.log follows it there."""
    from megalm.parallel.dims import init_distributed
    from megalm.training.device import select_device

    rank, world_size = init_distributed(select_device(config.trainer.device), process_group_minutes(config),
                                        config.parallel.fsdp_cpu_offload)
    chosen = first_attempt_run_dir(own_dir, config.trainer.resume, sweep_job) if rank == 0 else own_dir
    if world_size > 1:
        import torch.distributed as dist

        shared = [str(chosen)]
        dist.broadcast_object_list(shared, src=0)
        chosen = Path(shared[0])
    if chosen != own_dir:
        log_in(chosen, own_dir)
        remove_unused_run_dir(own_dir)
    return chosen, rank


def first_attempt_run_dir(own_dir: Path, resume: str, sweep_job: int | None = None) -> Path:
    """The run dir of a restart: under `torchrun --max-restarts`, the dir of the job's first attempt, recorded in
    torchrun's agent store, which lives as long as the job (a sweep's jobs each under a key of their own). Hydra's
    default run dir is a new outputs/DATE/TIME per process, so a restarted attempt started over in a dir of its own,
    where `trainer.resume` found nothing to resume (TorchTitan's and Megatron's checkpoint dirs are fixed paths, and
    resume there). With a PATH the run continues from its own checkpoints once it has some (training/checkpoint), so
    it continues in the first dir too; with `trainer.resume=never` each attempt starts as a new run, in its own dir."""
    from megalm.parallel.dims import elastic_store
    from megalm.training.checkpoint import latest_checkpoint

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store = elastic_store()
    key = RUN_DIR_KEY if sweep_job is None else f"{RUN_DIR_KEY}_job{sweep_job}"
    if attempt > 0 and store is not None and store.check([key]):  # a restart: the record of the first attempt
        first = Path(store.get(key).decode())
        if resume == "never" or first == own_dir.absolute() or not first.is_dir():
            return own_dir
        log.info(f"torchrun's restart {attempt}: continuing in the first attempt's run dir {first}, from its latest "
                 "checkpoint")
        return first
    # the first attempt, or torchrun's restart without the store's record (an elastic job whose first node left, or
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), in a dir with nothing to resume (a named one resumes as it is)
    if attempt > 0 and resume != "never" and latest_checkpoint(own_dir) is None:
        log.warning(f"torchrun's restart {attempt}: the first attempt's run dir is unknown here, so this attempt "
                    f"starts in {own_dir}; name one run dir for every attempt (hydra.run.dir=PATH) to resume")
    if store is not None:
        store.set(key, str(own_dir.absolute()))
    return own_dir


def log_in(run_dir: Path, own_dir: Path) -> None:
    """Replace the log file handler Hydra opened in `own_dir` (its train.log) by one appending to `run_dir`'s."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == own_dir.absolute():
            moved = logging.FileHandler(run_dir.absolute() / Path(handler.baseFilename).name, mode="a",
                                        encoding=handler.encoding)
            moved.setLevel(handler.level)
            moved.setFormatter(handler.formatter)
            for kept in handler.filters:
                moved.addFilter(kept)
            root.removeHandler(handler)
            handler.close()
            root.addHandler(moved)


def remove_unused_run_dir(own_dir: Path) -> None:
    """Remove the run dir Hydra made for this rank when it holds nothing but Hydra's own files. Ranks of one node
    whose clocks gave them the same dir (not rank 0's) race to remove it: the one that finds it gone is done."""
    try:
        unused = all(p.name in (".hydra", "train.log") for p in own_dir.iterdir())
    except FileNotFoundError:
        return
    if unused:
        shutil.rmtree(own_dir, ignore_errors=True)
