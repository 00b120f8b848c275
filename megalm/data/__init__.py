"""Data: tokenizers, indexed datasets, the demo corpus, sampling and the packed batch format."""
