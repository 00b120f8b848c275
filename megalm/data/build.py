"""`build_datasets`: the train and validation samplers and the tokenizer a run's `data` config describes
(demo corpus, an indexed dataset in megalm's or Megatron-LM's format, a blend of them, or synthetic documents)."""

from __future__ import annotations

import logging

from megalm.config import MegalmConfig
from megalm.config.checks import demo_tokenizer_refusal
from megalm.data import demo
from megalm.data.blend import build_blend
from megalm.data.dataset import DataBundle, DocumentSource, check_vocab, indexed_tokenizer, split_samplers
from megalm.data.indexed import IndexedDataset
from megalm.data.synthetic import SyntheticDocuments
from megalm.data.tokenizer import ByteTokenizer, Tokenizer
from megalm.errors import DataError

log = logging.getLogger(__name__)


def build_datasets(cfg: MegalmConfig) -> DataBundle:
    """Source, split and sampler from `cfg.data` (a `MegalmConfig` or its Hydra DictConfig)."""
    d = cfg.data
    if d.name == "indexed" and d.blend is not None:
        bundle = build_blend(cfg)
        log.info("%s", bundle.summary())
        return bundle
    source: DocumentSource
    tokenizer: Tokenizer | None
    if d.name == "demo":
        if refusal := demo_tokenizer_refusal(d.tokenizer):  # (validate says it first, for a run)
            raise DataError(refusal)
        source = IndexedDataset(demo.demo_corpus(d.cache_dir))
        tokenizer = ByteTokenizer()
    elif d.name == "indexed":
        if not d.path:
            raise DataError("data=indexed needs data.path=PREFIX (of PREFIX.bin/.idx written by "
                            "megalm-preprocess)")
        source = IndexedDataset(d.path, tokenizer=d.tokenizer)
        tokenizer = indexed_tokenizer(source, d.tokenizer)
    elif d.name == "synthetic":
        if d.tokenizer != "byte":
            raise DataError(f"data=synthetic draws token ids, with no text to tokenize: data.tokenizer={d.tokenizer} "
                            "would not be read; drop it, or use data=indexed")
        s = d.synthetic
        source = SyntheticDocuments(s.num_docs, cfg.model.vocab_size, s.mean_doc_length, s.fixed_doc_length,
                                    seed=cfg.seed)
        tokenizer = None
    else:
        raise DataError(f"data={d.name} is not one of demo|indexed|synthetic; pick one of those")

    check_vocab(source, tokenizer, cfg.model.vocab_size)
    train, valid = split_samplers(source, cfg, f"data={d.name}")
    bundle = DataBundle(train, valid, tokenizer, source)
    log.info("%s", bundle.summary())
    return bundle
