"""Interoperability with Hugging Face `transformers`: export a megalm checkpoint as a Llama / GPT-2 model
directory (`megalm-export`), import one as a megalm checkpoint (`megalm-import`), and start a run from
either (`model.init_from`). See docs/interop.md.

The name and layout mapping lives in `megalm.interop.hf_mapping`; nothing here imports `transformers`
(the files are written and read with `safetensors` and `json` only), so export and import need no extra
package. The tests load the exports with `transformers` to prove the mapping.
"""
