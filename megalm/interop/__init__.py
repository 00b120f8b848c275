"""Interoperability with Hugging Face `transformers`: export a megalm checkpoint as a Llama / GPT-2 model
directory (`megalm-export`), import one as a megalm checkpoint (`megalm-import`), and start a run from
either (`model.init_from`). See docs/interop.md.

This package is the command-line side (on the CLI layer, with megalm.train and megalm.generate): the name and
layout mapping and the reading of a Hugging Face directory live in `megalm.model.hf` (model layer), and
`model.init_from` with the reading of a megalm checkpoint in `megalm.training.init_from` (training layer), so
the trainer never imports this package. Nothing here imports `transformers` (the files are written and read
with `safetensors` and `json` only), so export and import need no extra package. The tests load the exports
with `transformers` to prove the mapping.
"""
