"""Data parallelism: reducer.py (bucketed gradient sums overlapped with backward; fp32 accumulation of bf16
gradients), bucket_adamw.py (AdamW over the buckets: ZeRO-1's sharded state, fp32 main weights behind bf16 ones),
slices.py (each DP rank's share of a step's samples)."""
