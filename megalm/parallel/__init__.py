"""Parallelism applied from outside the model (TP/PP/CP/DP, HDP). Single-process only so far."""
