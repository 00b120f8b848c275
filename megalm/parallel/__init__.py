"""Parallelism applied from outside the model, one subpackage per parallelism, each readable alone:
tensor/ (TP + SP), data_parallel/ (gradient sums, ZeRO-1, DP slices), pipeline/ (stages, schedules as
data, runtime, ZB), context/ (zigzag sharding, ring and Ulysses attention), hdp/ (ByteScale's hybrid DP).
dims.py is the mesh; parallelism.py composes them into the one object the trainer talks to."""
