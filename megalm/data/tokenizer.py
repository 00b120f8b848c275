"""Tokenizers: bytes by default, any Hugging Face `tokenizer.json` otherwise.

Training only ever sees token ids, so the tokenizer matters at two moments: when text is turned
into an indexed dataset (`megalm-preprocess`) and when ids are turned back into text (samples,
generation). A tokenizer is therefore described by a short `spec` string ("byte" or a path) that
is stored in the dataset's .idx, so the trainer can rebuild the very tokenizer the data was made
with. The byte tokenizer needs no files, which keeps the CPU demo free of downloads.
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

from megalm.errors import DataError

# Tried in this order when looking for a Hugging Face tokenizer's end-of-document token.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What megalm needs from a tokenizer. `spec` rebuilds it with `build_tokenizer(spec)`."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod_id(self) -> int: ...

    @property
    def spec(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def prompt_start(self) -> list[int]:
        """The special ids the tokenizer itself puts before a text (a bos), which `encode` leaves out."""
        ...


class ByteTokenizer:
    """UTF-8 bytes are the tokens 0..255; `<eod>` is 256. Lossless, file-free, vocab 257."""

    vocab_size = 257
    eod_id = 256
    spec = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def prompt_start(self) -> list[int]:
        return []

    def decode(self, ids: list[int]) -> str:
        # Decode runs of bytes together (a character may span several bytes); show eod as "<eod>"
        # and ids outside the byte range (a model's padded vocab) as U+FFFD.
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            parts.append("<eod>" if i == self.eod_id else "\ufffd")
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from its tokenizer.json (no network, no transformers)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _HF

        path = os.path.abspath(os.path.expanduser(path))
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise DataError(f"tokenizer file {path} not found; pass 'byte' or the path of a Hugging Face "
                            "tokenizer.json (--tokenizer / data.tokenizer)")
        try:
            self._tok = _HF.from_file(path)
        except Exception as e:  # the Rust side raises plain Exceptions with multi-line messages
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"tokenizer file {path} is not a valid Hugging Face tokenizer.json ({reason}); "
                            "pass a file saved with tokenizers' Tokenizer.save, or 'byte'") from None
        self._path = path
        self._start: list[int] | None = None  # prompt_start's, once probed
        # A document's text is text: a literal "<|endoftext|>" in it (scraped code, ML papers) is encoded as its
        # characters, not as the special token, which put an end-of-document id inside one document
        self._tok.encode_special_tokens = True
        # ids may skip numbers: the rows an id needs, not the count of entries (a gap refused the eod id)
        self._vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True),
                               max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1)
        for name in EOD_CANDIDATES:
            eod = self._tok.token_to_id(name)
            if eod is not None:
                self._eod_id = int(eod)
                self.eod_token = name
                break
        else:
            raise DataError(f"tokenizer {path} has none of the end-of-document tokens "
                            f"{', '.join(EOD_CANDIDATES)}; add one of them to its vocabulary "
                            "(e.g. as a special token)")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod_id(self) -> int:
        return self._eod_id

    @property
    def spec(self) -> str:
        return self._path

    def token_ids(self) -> dict[str, int]:
        """Every token and its id, added tokens too: two files with the same are the same vocabulary (the file's
        bytes differ between versions of the tokenizers library that saved it)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def token_of(self, token_id: int) -> str | None:
        """The token of `token_id` (None: no token has it)."""
        return self._tok.id_to_token(int(token_id))

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS from the tokenizer's post-processor: the dataset writer appends eod itself.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many documents at once (the Rust side spreads them over threads)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def prompt_start(self) -> list[int]:
        """What the post-processor puts before a text: Llama's <s> (<|begin_of_text|>), which Hugging Face's
        tokenizer adds by default; none for GPT-2's or Qwen's. Probed once (preprocess asks for every batch)."""
        if self._start is None:
            self._start = []
            for probe in ("a", "0", " ", "the"):  # a text the vocabulary encodes (no <unk>: maybe not "a")
                plain = self._tok.encode(probe, add_special_tokens=False).ids
                if plain:
                    marked = self._tok.encode(probe, add_special_tokens=True).ids
                    self._start = next((marked[:i] for i in range(len(marked) - len(plain) + 1)
                                        if marked[i:i + len(plain)] == plain), [])
                    break
        return list(self._start)

    def __repr__(self) -> str:
        return f"HFTokenizer({self._path!r})"


def trained_with(tokenizer: Tokenizer, model_vocab_size: int, trained_vocab_size: int | None) -> bool:
    """Whether `tokenizer` can be the one a model of `model_vocab_size` rows was trained with, whose checkpoint
    recorded `trained_vocab_size` tokens (None: not recorded, checkpoints before 2026-11-30 and imports): one of
    another vocabulary decodes the model's ids into other text."""
    return tokenizer.vocab_size <= model_vocab_size and trained_vocab_size in (None, tokenizer.vocab_size)


def build_tokenizer(spec: str) -> Tokenizer:
    """"byte" -> ByteTokenizer; anything else is the path of a tokenizer.json (or of its directory)."""
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(f"tokenizer spec {spec!r} is empty; use 'byte' or the path of a tokenizer.json")
    if spec.strip().lower() == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
