"""Context parallelism: zigzag.py (sharding packed documents over a ring), ring.py (ring attention over an
ordered list of global ranks, one opaque op), ring_kernels.py (its per-block kernels), ulysses.py (all-to-all
over heads), attention.py (`RingContext`, what a sharded micro-batch carries to the model's attention), split.py
(static CP: each micro-batch sharded over the rank's ring)."""
