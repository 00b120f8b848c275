"""Checkpoints: atomic, self-describing, resharable, loaded without executing pickled code.

Layout of a run dir:

    checkpoints/
      step_00000100/
        shard-0000R-model-00001-of-00001.safetensors   # weights + optimizer state, per saving rank
        rng-rank0000R.safetensors                       # every rank's torch CPU (and CUDA) generator, and its
                                                        # fp8_delayed amax histories (this layout only)
        state.json        # step, consumed tokens, seed, batch size, optimizer hyper-parameters
        config.yaml       # the resolved run config (megalm-generate rebuilds the model from it)
      latest              # text file naming the newest complete checkpoint

Tensors go through torch.distributed.checkpoint (DCP) with its Hugging Face storage: safetensors
files whose JSON headers hold each shard's offsets, so loading reads no pickle (DCP's default
storage pickles its metadata). Every rank writes its own tensor-parallel shards (as DTensors over
the TP mesh; DCP writes a replicated tensor once), and a load into another layout reshards —
both handled by DCP. Optimizer state is keyed by parameter *name*, not position. Names are the
full model's (`canonical_named_parameters`), so a pipeline stage writes `layers.5.…` for the layers
it holds and every stage saves its own part of one checkpoint, which loads into any other layout.

A save writes into `.tmp-step_…`, fsyncs, renames the directory into place and only then replaces
`latest` (os.replace is atomic on POSIX). A crash at any point leaves the previous `latest`
pointing at a complete checkpoint; stale temporaries are removed by the next save.

The package, one job per module:

    layout.py   the run dir's names, atomic writes, finding `latest` and complete checkpoints
    tensors.py  weights and optimizer state <-> DCP's layout (by name, TP shards as DTensors, vocab padding)
    save.py     `Checkpointer`: one run's saves, synchronous or in the background, published atomically
    verify.py   reading and checking metadata and files before a resume (one-line errors naming the file)
    load.py     loading into a model and optimizer of any layout, or a whole model in one process
"""

from megalm.training.checkpoint.layout import (
    CHECKPOINTS,
    FILES,
    FORMAT_VERSION,
    LATEST,
    checkpoint_name,
    fsync_path,
    is_complete,
    latest_checkpoint,
    resolve_checkpoint_path,
    write_text_atomic,
)
from megalm.training.checkpoint.load import SavedModelParts, load_checkpoint, load_model_weights, load_saved_model
from megalm.training.checkpoint.save import Checkpointer, PendingCheckpoint, save_checkpoint
from megalm.training.checkpoint.tensors import (
    load_optimizer_tensors,
    optimizer_tensors,
    save_tensors,
    saved_vocab_rows,
)
from megalm.training.checkpoint.verify import (
    LoadedCheckpoint,
    check_model_config,
    check_resume_target,
    check_same_data_order,
    data_order,
    data_size,
    function_differences,
    latest_unless_never,
    note_data_change,
    note_function_change,
    note_precision_change,
    note_schedule_change,
    read_checkpoint_meta,
    resumable_checkpoint,
    resumes_as_named,
    saved_model_config,
    verify_checkpoint,
)

__all__ = [
    "CHECKPOINTS", "FILES", "FORMAT_VERSION", "LATEST", "Checkpointer", "LoadedCheckpoint", "PendingCheckpoint",
    "SavedModelParts",
    "check_model_config", "check_resume_target", "check_same_data_order", "checkpoint_name", "data_order", "data_size",
    "fsync_path", "is_complete", "latest_checkpoint", "latest_unless_never", "load_checkpoint", "load_model_weights",
    "load_optimizer_tensors", "function_differences", "note_data_change", "note_function_change",
    "note_precision_change", "note_schedule_change", "load_saved_model", "optimizer_tensors", "read_checkpoint_meta",
    "resolve_checkpoint_path", "resumable_checkpoint", "resumes_as_named", "save_checkpoint", "save_tensors",
    "saved_model_config", "saved_vocab_rows", "verify_checkpoint", "write_text_atomic",
]
