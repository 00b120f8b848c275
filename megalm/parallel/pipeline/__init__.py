"""Pipeline parallelism: stages.py (which layers each rank holds), actions.py (a schedule's data: per-rank
action lists), schedules.py (1F1B, interleaved, ZB-H1 generated and validated as data), rendezvous.py (SEND/RECV
under NCCL's rules), p2p.py (shape-first sends), weight_grad.py (ZB's B/W split), runtime.py (runs one rank's
action list)."""
