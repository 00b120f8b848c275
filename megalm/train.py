"""`megalm-train` / `python -m megalm.train`: compose the Hydra config, then `Trainer(cfg).fit()`.

Every run writes its resolved config, `metrics.jsonl` and checkpoints into its Hydra run dir
(`hydra.run.dir=...` chooses it). User errors print as one line and exit with code 2; `debug=true`
keeps the traceback. A run stopped by a preemption signal exits with 75 after its checkpoint. torch and the
trainer (3 s of imports) are imported only when a run starts, so `--help`, `--cfg job` and a bad key or value answer
at once (a rule of the layout or the recipe after torch's import, still before Hydra makes the run dir).
"""

from __future__ import annotations

import gc
import logging
import os
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from megalm.config import (
    MegalmConfig,
    TrainerConfig,
    register_schema,
    schema_default,
    to_dataclass,
)
from megalm.config.compose import CONFIG_DIR, compose_config, register_help  # noqa: F401 (tools import them)
from megalm.errors import REQUEUE_EXIT_CODE, CheckpointError, ConfigError, MegalmError
from megalm.training.run_dir import (
    check_creatable,
    check_own_checkpoints,
    check_run_dir,
    shared_run_dir,
)

log = logging.getLogger("megalm")
# the signals megalm-train catches from its start (trainer.preempt_signals's default), until its config says which
_START_UP_SIGNALS = [signal.Signals[name] for name in schema_default(TrainerConfig, "preempt_signals")]
MULTIRUN_FLAGS = ("-m", "--multirun")  # Hydra's flag of a sweep


def fail(message: str) -> None:
    """Print a user error as one line and exit non-zero. One write with its newline: under torchrun every rank
    shares stderr, and print's separate write of the newline let two ranks' lines run together."""
    mark_failed()
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(2)


def _touch_marker(suffix: str) -> None:
    if marker := os.environ.get("MEGALM_REQUEUE_MARKER"):
        Path(f"{marker}.{suffix}").touch()


def mark_for_requeue() -> None:
    """Touch `$MEGALM_REQUEUE_MARKER.rank<RANK>-of-<WORLD_SIZE>` when MEGALM_REQUEUE_MARKER is set, before exiting
    with REQUEUE_EXIT_CODE: torchrun reports a worker's 75 as 1, so the Slurm templates look for these files
    (docs/slurm.md)."""
    _touch_marker(f"rank{os.environ.get('RANK', '0')}-of-{os.environ.get('WORLD_SIZE', '1')}")


def mark_failed() -> None:
    """Touch `$MEGALM_REQUEUE_MARKER.failed-rank<RANK>`: this process failed on its own (a user error, an exception
    while no preemption signal reached it). srun then SIGTERMs the job's other processes, and those still starting
    up exit 75 with a requeue marker: the Slurm templates requeue no job in which a process left this file (one rank's
    config error requeued the job, which failed again)."""
    _touch_marker(f"failed-rank{os.environ.get('RANK', '0')}")


def _stop_before_training(signum: int, frame: object) -> None:
    # a preemption, or torchrun stopping the other workers of a job whose one process failed (a config error: the
    # Slurm templates requeue no job that left a failure marker)
    sys.stderr.write(f"megalm-train: {signal.Signals(signum).name} before training began (a preemption, or the "
                     "launcher stopping this process after another one failed): exiting with "
                     f"{REQUEUE_EXIT_CODE} to be requeued (nothing to checkpoint yet)\n")
    mark_for_requeue()
    os._exit(REQUEUE_EXIT_CODE)  # now: a raised SystemExit could be swallowed, or wait inside a C call


def _stop_after_checkpoint(signum: int, frame: object) -> None:
    mark_for_requeue()  # again, first: the signal may have come before the shutdown's own mark
    sys.stderr.write(f"megalm-train: {signal.Signals(signum).name} again after the preempted run's checkpoint: exiting "
                     f"with {REQUEUE_EXIT_CODE} now\n")
    os._exit(REQUEUE_EXIT_CODE)


_REQUEUE_HANDLERS = (_stop_before_training, _stop_after_checkpoint)


def requeue_on(signals: list[signal.Signals], handler: Callable[[int, object], None] = _stop_before_training) -> None:
    """Until the trainer's own handlers take over (`Trainer.fit`), and from `main()` on: a preemption signal during
    start-up (imports, Hydra, the rendezvous, the checkpoint load: minutes at scale) ends the process with
    REQUEUE_EXIT_CODE and the requeue marker, as a preempted run does after its checkpoint. Nothing was trained yet
    that a checkpoint could keep; the signal's default action (death by it) left the job unrequeued. The signals
    it caught before and `signals` (`trainer.preempt_signals`, `[]`: none) no longer names get their default
    action back. `handler`: `_stop_after_checkpoint` once a preempted run saved and marked itself (its shutdown)."""
    caught = [s for s in signal.valid_signals() if signal.getsignal(s) in _REQUEUE_HANDLERS]
    for number in {*caught, *signals}:
        signal.signal(number, handler if number in signals else signal.SIG_DFL)


def precheck_overrides(argv: list[str]) -> None:
    """Compose once with the command-line overrides, and check a run's config against every rule at its world size,
    so that bad keys, values and layouts fail as a single line before Hydra starts the run (a refused run left its
    empty run dir behind, and took the trainer's imports and two more compositions to say so). A sweep (-m) is
    checked value by value (`sweep_variants`), before its first job trains: Hydra's own report of a bad key is
    several lines that advise a `+key` which would add it. Hydra's own flags are left to Hydra."""
    config_location = ("-cd", "-cp", "-cn", "--config-dir", "--config-path", "--config-name")
    if any(a.split("=")[0] in config_location for a in argv):
        return  # another config tree than megalm's configs/: Hydra's to check
    # Hydra's own flags (--cfg job, --help, --info ...) are Hydra's; the overrides beside them as Hydra's parser reads
    # them (a value of a flag is none: `--cfg job`; a word without `=` is one, which Hydra refuses in several lines)
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def refused(message: str) -> None:
        raise ValueError(message)

    parser.error = refused  # argparse's own: the usage, then exit 2
    try:
        overrides = parser.parse_args(argv).overrides
    except ValueError:
        try:  # Hydra takes its flags before the overrides only ("unrecognized arguments: <the overrides after>")
            overrides = parser.parse_intermixed_args(argv).overrides
        except ValueError:
            return  # a flag Hydra does not know: its usage and error, when it starts
        fail(f"Hydra's flags go before the overrides: {flags_first(argv, overrides)}")
    runs = not any(a.startswith("-") and a not in MULTIRUN_FLAGS for a in argv)  # --cfg job, --help: print
    if any(a in MULTIRUN_FLAGS for a in argv):
        if runs:
            precheck_sweep(overrides, debug="debug=true" in overrides)
        return
    try:
        config = compose_config(overrides)
        if runs:  # every rule at this process's world size, before Hydra makes a run dir a refused run would leave
            check_run(config)
        named = [override_value(o) for o in overrides if o.partition("=")[0].lstrip("+") == "hydra.run.dir"]
        if named and not named[-1].strip():  # an unset shell variable: Hydra ran in the current directory
            raise ConfigError("hydra.run.dir is empty; name the run's directory, or drop it for outputs/DATE/TIME")
        if named and named[-1].strip().startswith("~"):  # Hydra keeps it: the run went to ./~/..., unchecked
            raise ConfigError(f"hydra.run.dir={named[-1]}: Hydra does not expand ~ (the run would go to a directory "
                              "named '~' here); write the path out, e.g. hydra.run.dir=$HOME/...")
        if runs:  # the run dir, before Hydra makes it and its train.log there
            value = named[-1] if named else "outputs"  # configs/config.yaml: outputs/DATE/TIME
            what = f"hydra.run.dir={value}" if named else "outputs (the default run dir is outputs/DATE/TIME)"
            run_dir = Path(value)
            if run_dir.exists() and not run_dir.is_dir():
                raise ConfigError(f"{what} is a file; choose a directory (hydra.run.dir: new, or a run's to continue)")
            if named and run_dir.is_dir():
                check_run_dir(run_dir)
                if runs:
                    check_own_checkpoints(run_dir, config)
            check_creatable(run_dir, what)
    except (ConfigError, CheckpointError) as e:
        if "debug=true" in overrides:
            raise
        fail(str(e))


def flags_first(argv: list[str], overrides: list[str]) -> str:
    """The command with Hydra's flags (with their values: `--cfg job`) before the overrides, and the flag that came
    between overrides: the line a command gets whose flag came after an override (Hydra's parser takes the
    overrides after its flags only)."""
    left = list(overrides)
    flags, before, culprit, after = [], None, None, None
    for word in argv:
        if word in left:  # an override (Hydra's parser keeps their order)
            left.remove(word)
            if culprit is None:
                before = word
            elif after is None:
                after = word
        else:  # a flag or a flag's value
            flags.append(word)
            if before is not None and culprit is None and word.startswith("-"):
                culprit = word
    return f"megalm-train {' '.join([*flags, *overrides])} (here {culprit} came after {before}, before {after})"


def precheck_sweep(overrides: list[str], debug: bool = False) -> None:
    """Every job config a sweep's values make, composed and checked against every rule at this process's world
    size, as one job's run is (`precheck_overrides`): a bad value in any position fails as one line before the
    sweep's first job trains, not after the jobs before it. The jobs' run dirs are checked in their own runs."""
    variants = sweep_variants(overrides)
    if variants is None:  # a sweep only its sweeper can enumerate (interval, glob): Hydra's to check
        if not any(o.lstrip("+~").startswith("hydra/sweeper=") for o in overrides):  # Hydra's basic sweeper's trace
            swept = [o for o in overrides if "interval(" in o]
            if swept:
                fail(f"{swept[0]}: Hydra's basic sweeper runs listed values only (a,b / range(...) / choice(...)); "
                     "an interval needs a sweeper plugin (pip install hydra-optuna-sweeper, then hydra/sweeper=optuna)")
        return
    variant: list[str] = []
    try:
        for variant in variants:
            check_run(compose_config(variant))
    except (ConfigError, CheckpointError) as e:
        if debug:
            raise
        fail(f"{e} (a job of the sweep: {' '.join(variant)})")


def sweep_variants(overrides: list[str]) -> list[list[str]] | None:
    """The job overrides that together hold every value of a sweep: each swept key's values in turn, the other swept
    keys at their first value (as many lists as values, not the product of the sweep). None where Hydra's parser
    cannot list a sweep's values without its sweeper (interval, glob)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    try:
        parsed = [parser.parse_override(o) for o in overrides]
    except HydraException:  # a malformed override (a word without '='): composing says so in one line
        return [overrides]
    try:
        values = [list(o.sweep_string_iterator()) if o.is_sweep_override() else None for o in parsed]
    except HydraException:
        return None
    first = [o if v is None else f"{p.get_key_element()}={v[0]}" for o, p, v in zip(overrides, parsed, values,
                                                                                    strict=True)]
    variants = [first]
    for i, (p, swept) in enumerate(zip(parsed, values, strict=True)):
        for value in (swept or [])[1:]:
            variants.append([*first[:i], f"{p.get_key_element()}={value}", *first[i + 1:]])
    return variants


def override_value(override: str) -> str:
    """The value of a key=value override as Hydra reads it, quoted ('/runs/7b,lr=3e-4', as the Slurm templates pass a
    job's run dir) or not, and as OmegaConf then resolves it (an escaped '\\${' is a literal '${')."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        value = str(OverridesParser.create().parse_override(override).value())
    except HydraException:  # Hydra refuses it itself, in its own words, when it starts
        return override.partition("=")[2]
    try:
        return str(OmegaConf.create({"value": value}).value)
    except OmegaConfBaseException:  # an interpolation of Hydra's config, resolved when it starts
        return value


def check_run(config: MegalmConfig) -> None:
    """Every rule of the run's config, at this process's world size and on its device (under torchrun its
    LOCAL_RANK's GPU, which the run binds once it joins the group): what the trainer checks again when it starts."""
    import torch  # the run imports it next anyway

    from megalm.training.device import select_device
    from megalm.training.validation import validate_run

    device = select_device(config.trainer.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    # its warnings are the trainer's to say, once, in the run's log (its rank 0's)
    validate_run(config, world_size=int(os.environ.get("WORLD_SIZE", "1")), device=device, warn=False)


def shutdown_distributed() -> None:
    """Free everything that holds the process group, then destroy it: left to the GC at interpreter
    exit, gloo threads can outlive Python and abort the process after a successful run."""
    import torch.distributed as dist

    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def run(cfg: DictConfig) -> float | None:
    """Train with a composed config; returns the last step's loss (what a Hydra sweeper minimises)."""
    from megalm.training.checkpoint import write_text_atomic
    from megalm.training.compile import resolve_auto_compile
    from megalm.training.device import resolve_auto_precision, select_device
    from megalm.training.preemption import signal_numbers
    from megalm.training.trainer import Trainer
    from megalm.training.watchdog import joining_watchdog

    debug = bool(cfg.get("debug", False))
    preemption = None  # the trainer's, once it exists: whether a preemption signal reached this process
    run_dir, own_dir, rank = None, None, int(os.environ.get("RANK", "0"))
    try:
        config = to_dataclass(cfg)
        requeue_on(signal_numbers(config.trainer.preempt_signals))  # the run's own signals from here on
        hydra_config = HydraConfig.get()
        own_dir = Path(hydra_config.runtime.output_dir)
        sweep_job = hydra_config.job.num if hydra_config.mode == RunMode.MULTIRUN else None
        with joining_watchdog(config.trainer.init_hang_minutes, own_dir):  # a stuck rendezvous is reported
            run_dir, rank = shared_run_dir(own_dir, config, sweep_job)
        if rank != 0:  # one voice: rank 0 logs, the others only warn
            log.setLevel(logging.WARNING)
        check_run_dir(run_dir)
        # precision=auto becomes the recipe of this device, and trainer.compile=null (auto) true or false, before
        # anything is written: config.yaml names them
        device = select_device(config.trainer.device)
        resolved = resolve_auto_precision(cfg, device) is not None
        if resolve_auto_compile(cfg, device) is not None or resolved:
            config = to_dataclass(cfg)
        trainer = Trainer(config, run_dir)  # validates the config and the checkpoint it resumes from
        preemption = trainer.preemption
        if rank == 0:  # only now: a run refused above leaves the run dir's config.yaml as it was
            write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        try:
            summary = trainer.fit()
        except BaseException:
            requeue_on([])  # a signal from now on has its default action
            raise
        if summary.preempted:
            # a second signal (Slurm's SIGTERM reaches the workers, and torchrun forwards its own) ends the shutdown
            # with the requeue code, where its default action had exited -15: caught from the moment the trainer's
            # own handlers are replaced, the marker's line included
            requeue_on(signal_numbers(config.trainer.preempt_signals), _stop_after_checkpoint)
            mark_for_requeue()  # saved: asked before the shutdown, which a rank stopped by torchrun may not finish
        else:
            requeue_on([])  # trained: a signal from now on has its default action (no requeue of a finished run)
        del trainer
        shutdown_distributed()
        if summary.preempted:  # the launcher requeues on this code (megalm/training/preemption.py)
            logging.shutdown()
            sys.exit(REQUEUE_EXIT_CODE)
        return summary.last_loss
    except KeyboardInterrupt:
        if debug:
            raise
        stop_on_interrupt(run_dir or own_dir, rank)  # own_dir: a Ctrl-C before the ranks agreed on one
    except MegalmError as e:
        if debug:
            mark_failed()
            raise
        fail(str(e))
    except Exception:  # a traceback: this process's own failure, unless a preemption signal stopped it mid-collective
        if preemption is None or preemption.received is None:
            mark_failed()
        raise
    return None


def stop_on_interrupt(run_dir: Path | None, rank: int) -> None:
    """Ctrl-C: one line, from rank 0, naming the checkpoint the same command (in the same run dir) resumes from, and
    exit 130 (the shell's code for SIGINT), where Python printed the traceback of whatever the step was doing (a
    hundred lines ending in the GEMM it stopped). Nothing is saved: a signal of `trainer.preempt_signals` finishes
    the step and saves."""
    from megalm.training.checkpoint import latest_checkpoint

    # a terminal's Ctrl-C reaches torchrun too, which sends each worker a SIGINT of its own: ignored on the way out
    # (a second KeyboardInterrupt in the exit's callbacks printed a traceback)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    mark_failed()  # stopped by its user: no requeue
    if rank == 0:
        latest = latest_checkpoint(run_dir) if run_dir is not None else None
        argv = sys.argv[1:]
        named = any(a.startswith(("hydra.run.dir=", "+hydra.run.dir=")) for a in argv)
        if latest is None:
            where = "no checkpoint was saved yet"
        elif any(a in MULTIRUN_FLAGS for a in argv):  # a sweep's job: the sweep again makes a new sweep dir
            where = (f"this sweep job's checkpoint is {latest}: run the job alone (without -m) with "
                     f"{shlex.quote(f'hydra.run.dir={run_dir}')} to resume it")
        elif named:
            where = f"the same command resumes from {latest}"
        else:  # the default run dir is a new outputs/DATE/TIME each time: the same command would start afresh
            where = f"the same command with {shlex.quote(f'hydra.run.dir={run_dir}')} resumes from {latest}"
        sys.stderr.write(f"megalm-train: interrupted (Ctrl-C); {where}. To save on Ctrl-C first, add SIGINT to "
                         "trainer.preempt_signals\n")
        sys.stderr.flush()
    sys.exit(130)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def hydra_main(cfg: DictConfig) -> float | None:
    return run(cfg)


def main() -> None:
    if not Path(CONFIG_DIR).is_dir():
        fail(f"megalm's configs/ is not at {CONFIG_DIR}; install megalm from its checkout with pip install -e .")
    requeue_on(_START_UP_SIGNALS)  # first: a preemption during start-up requeues the job
    register_schema()  # here, not at import: importing megalm registers nothing anywhere
    register_help()
    precheck_overrides(sys.argv[1:])
    hydra_main()


if __name__ == "__main__":
    main()
