"""Pipeline parallelism: stages.py (which layers each rank holds), schedules.py (1F1B, interleaved, ZB-H1 as
per-rank action lists, validated as data), p2p.py (shape-first sends), weight_grad.py (ZB's B/W split),
runtime.py (runs one rank's action list)."""
