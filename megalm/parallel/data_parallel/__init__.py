"""Data parallelism: reducer.py (bucketed gradient sums overlapped with backward), zero1.py (AdamW
with its state sharded over the DP group), slices.py (each DP rank's share of a step's samples)."""
