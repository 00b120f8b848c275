"""megalm-preprocess: text (jsonl, txt, directories) -> tokenized PREFIX.bin/.idx.

Tokenizing is done once, offline, so training only memory-maps ids. Documents are read in a fixed
order (inputs in the order given, directory contents sorted by path) so the same inputs always give
the same dataset, byte for byte; with --workers the batches are tokenized in parallel but written in
order. Every user error is one line on stderr and exit code 2. `--format megatron` writes the same
tokens as Megatron-LM's MMIDIDX files (plus megalm's sidecar PREFIX.megalm.json), for Megatron-LM
runs or for sharing one corpus between both; megalm reads either (docs/data_formats.md).

    megalm-preprocess --input corpus.jsonl --output-prefix data/corpus --tokenizer byte
    megalm-preprocess --input books/ --glob "*.txt" --output-prefix data/books \
        --tokenizer tokenizer.json --workers 8
    megalm-preprocess --input corpus.jsonl --output-prefix data/corpus --format megatron
"""

from __future__ import annotations

import argparse
import codecs
import fnmatch
import itertools
import json
import logging
import os
import re
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megalm.data.files import exists_error
from megalm.data.indexed import MAGIC as MEGALM_MAGIC
from megalm.data.indexed import IndexedDatasetWriter, dataset_exists
from megalm.data.megatron_format import SIDECAR_SUFFIX, MegatronDatasetWriter, sidecar_path, write_sidecar
from megalm.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer
from megalm.errors import DataError, MegalmError

log = logging.getLogger(__name__)

JSON_SUFFIXES = (".jsonl", ".json", ".jsonlines", ".ndjson")
_BATCH_DOCS = 512  # documents per tokenization batch
_BATCH_CHARS = 4 << 20  # ... or this many characters, whichever comes first
FORMATS = ("megalm", "megatron")


@dataclass
class PreprocessStats:
    output_prefix: str
    num_files: int
    num_docs: int
    num_tokens: int
    skipped_empty: int  # documents with no text (blank lines, empty files), not written
    vocab_size: int
    dtype: str
    seconds: float
    format: str = "megalm"
    repaired: int = 0  # documents whose bytes were not UTF-8, or whose JSON held lone surrogates: stored as U+FFFD

    def summary(self) -> str:
        files = f"{self.output_prefix}.bin and {self.output_prefix}.idx"
        if self.format == "megatron":
            files += f" + {self.output_prefix}{SIDECAR_SUFFIX} (Megatron-LM format)"
        return (f"wrote {files}: {self.num_docs} documents, {self.num_tokens} tokens "
                f"({self.dtype}, vocab {self.vocab_size}) from {self.num_files} files in {self.seconds:.1f}s"
                + (f"; skipped {self.skipped_empty} empty documents" if self.skipped_empty else "")
                + (f"; {self.repaired} documents held bytes that are not UTF-8 (or JSON's lone surrogates), "
                   "stored as U+FFFD" if self.repaired else ""))


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


# Compressed files would be read as one document of binary noise: refused, naming the fix.
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4", ".zip", ".7z", ".tgz")
# So would binary formats (Hugging Face datasets' parquet and arrow above all): refused, naming the conversion.
BINARY_SUFFIXES = (".parquet", ".arrow", ".feather", ".npy", ".npz", ".pt", ".safetensors", ".pdf")
_DATASET_SUFFIXES = (".bin", ".idx", SIDECAR_SUFFIX)


def _dataset_prefix(path: Path) -> str | None:
    """The prefix of the tokenized dataset that `path` (a .bin, .idx or sidecar) belongs to, if one is there."""
    for suffix in _DATASET_SUFFIXES:
        if path.name.endswith(suffix):
            prefix = str(path)[: -len(suffix)]
            others = [f"{prefix}{s}" for s in (".bin", ".idx") if s != suffix]
            return prefix if any(os.path.exists(o) for o in others) else None
    return None


def _walk(path: Path, glob: str) -> tuple[list[Path], set[str]]:
    """A directory's files matching `glob`, sorted by their path inside it (hidden files and directories skipped,
    symlinked directories followed once each), and the prefixes of tokenized datasets found there (left out)."""
    found: list[Path] = []
    datasets: set[str] = set()
    seen: set[str] = set()
    for root, dirs, names in os.walk(path, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # a symlink back to a directory already walked
            dirs[:] = []
            continue
        seen.add(real)
        # real directories before symlinked ones, by name: which path a linked tree is read under (and so where its
        # files sort) is the same on every file system, whatever order it lists a directory in
        dirs[:] = sorted((d for d in dirs if not _is_hidden(d)), key=lambda d: (os.path.islink(Path(root, d)), d))
        for name in names:
            if _is_hidden(name) or not fnmatch.fnmatch(name, glob):
                continue
            if (prefix := _dataset_prefix(Path(root, name))) is not None:
                datasets.add(prefix)
            else:
                found.append(Path(root, name))
    return sorted(found, key=lambda p: p.relative_to(path).as_posix()), datasets


def _user_path(item: str | os.PathLike) -> Path:
    """An input as the user meant it: a quoted or --input=~/x path keeps its ~ from bash."""
    return Path(os.path.expanduser(os.fspath(item)))


def list_input_files(inputs: Sequence[str | os.PathLike], glob: str = "*") -> list[Path]:
    """The files to read, in order: each input as given (a regular file, or a pipe such as `<(zcat a.gz)`); a
    directory's files (matching `glob`; hidden files and directories and tokenized datasets skipped, the latter
    with one warning) sorted by their path inside it. Compressed files are refused."""
    files: list[Path] = []
    datasets: set[str] = set()
    for item in inputs:
        path = _user_path(item)
        if path.is_dir():
            found, in_dir = _walk(path, glob)
            files.extend(found)
            datasets |= in_dir
        elif path.exists():
            files.append(path)
        else:
            raise DataError(f"input {path} not found; check --input")
    if datasets:
        log.warning(f"skipping the tokenized dataset{'s' if len(datasets) > 1 else ''} "
                    f"{', '.join(sorted(datasets))} (.bin/.idx) inside the input directories")
    if compressed := [p for p in files if p.name.lower().endswith(COMPRESSED_SUFFIXES)]:
        inner = Path(compressed[0].stem).suffix.lower()  # data.jsonl.gz: .jsonl
        kind = "jsonl" if inner in JSON_SUFFIXES else "txt" if inner == ".txt" else None  # (a .tar.gz: neither)
        as_format = f" --input-format {kind}" if kind else ""
        raise DataError(f"{compressed[0]} is compressed, which megalm-preprocess does not read; decompress it "
                        f"first, or pass it through a pipe (--input <(zcat FILE){as_format}, <(zstd -dc FILE), ...); "
                        "in a directory, --glob leaves it out")
    if binary := [p for p in files if p.name.lower().endswith(BINARY_SUFFIXES)]:
        raise DataError(f"{binary[0]} is a binary file, which megalm-preprocess would read as one document of noise; "
                        "write its text as JSON lines first (a parquet file: python -c \"import pandas as pd; "
                        "pd.read_parquet('IN.parquet').to_json('OUT.jsonl', orient='records', lines=True)\"); "
                        "in a directory, --glob leaves it out")
    return files


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # valid JSON escapes ("\ud800") that no UTF-8 encodes


class _Repairs:
    """How many documents `iter_documents` repaired (bytes not UTF-8, JSON's lone surrogates: U+FFFD instead), for
    the summary line: the text changed, so the user is told, not left to find it in the tokens."""

    def __init__(self) -> None:
        self.documents = 0
        self.last_repaired = False  # the bytes `decode` read last were not UTF-8

    def decode(self, raw: bytes) -> str:
        try:
            text, self.last_repaired = raw.decode("utf-8"), False
        except UnicodeDecodeError:
            text, self.last_repaired = raw.decode("utf-8", errors="replace"), True
            self.documents += 1
        return text

    def json_text(self, text: str) -> str:
        """The text of the JSON line `decode` read last: lone surrogates (valid JSON escapes that no UTF-8 encodes,
        which the tokenizers refuse) replaced; the line counted once if its bytes or its text needed a repair."""
        cleaned = _LONE_SURROGATE.sub("\ufffd", text)
        self.documents += cleaned != text and not self.last_repaired
        return cleaned


def _without_bom(raw: bytes, lineno: int = 1) -> bytes:
    """A file's bytes without the UTF-8 byte-order mark that starts its first line (Windows editors write one)."""
    return raw.removeprefix(codecs.BOM_UTF8) if lineno == 1 else raw


def _read_json_lines(path: Path, lines: Iterable[bytes], json_key: str, repairs: _Repairs
                     ) -> Iterator[tuple[str, int]]:
    """(text, bytes read) of each JSON line of `path` (`lines`: its lines, opened by the caller)."""
    for lineno, raw in enumerate(lines, 1):
        line = repairs.decode(_without_bom(raw, lineno)).strip()
        if not line:
            yield "", len(raw)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}); fix or remove that line") from None
        except (ValueError, RecursionError) as e:  # a number past int's digit limit, nesting past the stack
            reason = str(e).split(";")[0].split("\n")[0] or type(e).__name__
            raise DataError(f"{path}:{lineno}: JSON that Python cannot read ({reason}); fix or remove that "
                            "line") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object per line, got {type(obj).__name__}")
        if json_key not in obj:
            keys = ", ".join(list(obj)[:5])
            raise DataError(f"{path}:{lineno}: no key {json_key!r} (keys: {keys}); pass --json-key KEY")
        text = obj[json_key]
        if not isinstance(text, str):
            raise DataError(f"{path}:{lineno}: {json_key!r} is a {type(text).__name__}, not a string")
        yield repairs.json_text(text), len(raw)


INPUT_FORMATS = ("auto", "jsonl", "txt")


def _sniffed_kind(path: Path, head: list[bytes], json_key: str) -> str:
    """auto's reading of a pipe (<(zcat FILE.jsonl.gz): a name without a suffix): jsonl when its first non-blank line
    is a JSON object (one without `json_key` is then refused naming --json-key), else text; one warning line says
    which, and the flag that reads it otherwise."""
    first = next((line for line in head if line.strip()), b"")
    try:
        obj = json.loads(first.removeprefix(codecs.BOM_UTF8))
    except (ValueError, RecursionError):
        obj = None
    kind = "jsonl" if isinstance(obj, dict) else "txt"  # (a line without --json-key's key is then named, one line)
    other = "txt" if kind == "jsonl" else "jsonl"
    log.warning(f"reading {path} as {kind} (its first line {'is' if kind == 'jsonl' else 'is not'} a JSON object); "
                f"--input-format {other} reads it as {other}")
    return kind


def iter_documents(files: Sequence[Path], json_key: str = "text", split_lines: bool = False,
                   repairs: _Repairs | None = None, input_format: str = "auto") -> Iterator[tuple[str, int]]:
    """(text, bytes read) for every document; the byte counts drive the progress bar. Bytes that are not UTF-8
    are read as U+FFFD, and counted in `repairs`. `input_format` auto reads a file by its suffix (a pipe, which has
    none, by its first line: `_sniffed_kind`); jsonl or txt reads every file so."""
    repairs = repairs or _Repairs()
    for path in files:
        with open(path, "rb") as f:
            head: list[bytes] = []
            kind = input_format
            if kind == "auto":
                suffix = path.suffix.lower()
                if suffix in JSON_SUFFIXES:
                    kind = "jsonl"
                elif suffix == ".txt" or path.is_file():
                    kind = "txt"
                else:  # a pipe (/dev/fd/63: no suffix): read up to its first non-blank line, kept for the reader
                    head = list(_until_non_blank(f))
                    kind = _sniffed_kind(path, head, json_key)
            lines = itertools.chain(head, f)
            if kind == "jsonl":
                yield from _read_json_lines(path, lines, json_key, repairs)
            elif split_lines and (input_format == "txt" or path.suffix.lower() == ".txt" or head):
                for lineno, raw in enumerate(lines, 1):
                    yield repairs.decode(_without_bom(raw, lineno)).rstrip("\r\n"), len(raw)
            else:
                data = b"".join(head) + f.read()
                yield repairs.decode(_without_bom(data)), len(data)


def _until_non_blank(f: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of `f` up to and including its first non-blank one."""
    for line in f:
        yield line
        if line.strip():
            return


def _batches(docs: Iterator[tuple[str, int]]) -> Iterator[tuple[list[str], int, int]]:
    """Group non-empty documents into batches: (texts, bytes read, empty documents skipped)."""
    texts: list[str] = []
    nbytes = chars = skipped = 0
    for text, size in docs:
        nbytes += size
        if not text:
            skipped += 1
            continue
        texts.append(text)
        chars += len(text)
        if len(texts) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield texts, nbytes, skipped
            texts, nbytes, chars, skipped = [], 0, 0, 0
    if texts or nbytes or skipped:
        yield texts, nbytes, skipped


def _encode_batch(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    if isinstance(tokenizer, ByteTokenizer):  # bytes are the ids: no Python ints needed
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    encode_batch = getattr(tokenizer, "encode_batch", None)
    ids = encode_batch(texts) if encode_batch is not None else [tokenizer.encode(t) for t in texts]
    # A document starts as its tokenizer starts a text (Llama's <s>), as Megatron-LM's preprocess_data and
    # TorchTitan write it: continued pretraining of an imported Llama then sees what it was trained on
    start = list(tokenizer.prompt_start())
    return [np.asarray(start + list(x), dtype=np.int64) for x in ids]


# Worker processes rebuild the tokenizer from its spec once, then encode batches.
_worker_tokenizer: Tokenizer | None = None


def _worker_init(spec: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallelism comes from the processes
    _worker_tokenizer = build_tokenizer(spec)


def _worker_encode(texts: list[str]) -> list[np.ndarray]:
    assert _worker_tokenizer is not None
    return _encode_batch(_worker_tokenizer, texts)


def preprocess(inputs: Sequence[str | os.PathLike], output_prefix: str, tokenizer: Tokenizer | str = "byte",
               json_key: str = "text", split_lines: bool = False, overwrite: bool = False,
               show_progress: bool = True, glob: str = "*", workers: int = 1,
               output_format: str = "megalm", input_format: str = "auto") -> PreprocessStats:
    """Tokenize `inputs` into output_prefix.bin/.idx (megalm's format, or Megatron-LM's with
    output_format="megatron") and return what was written; `input_format` as `iter_documents`."""
    start = time.perf_counter()
    if output_format not in FORMATS:
        raise DataError(f"--format {output_format!r} is not one of {', '.join(FORMATS)}")
    if input_format not in INPUT_FORMATS:
        raise DataError(f"--input-format {input_format!r} is not one of {', '.join(INPUT_FORMATS)}")
    if isinstance(tokenizer, str):
        tokenizer = build_tokenizer(tokenizer)
    output_prefix = os.path.expanduser(os.fspath(output_prefix))  # as data.path reads it (a quoted ~ stays ~)
    if not output_prefix or output_prefix.endswith(("/", os.sep)) or os.path.isdir(output_prefix):
        raise DataError(f"output prefix {output_prefix!r} is a directory; give a file prefix such as "
                        f"{os.path.join(output_prefix or '.', 'corpus')}")
    if not overwrite and dataset_exists(output_prefix):
        raise exists_error(output_prefix, "--overwrite")
    if not inputs:
        raise DataError("no input given; pass --input PATH [PATH ...]")
    files = list_input_files(inputs, glob)
    outputs = {Path(f"{output_prefix}{suffix}").resolve() for suffix in (".bin", ".idx", SIDECAR_SUFFIX)}
    if named := [str(p) for p in map(_user_path, inputs) if p.is_file() and p.resolve() in outputs]:
        raise DataError(f"--input {named[0]} is this run's own output; choose another --output-prefix")
    if own := [p for p in files if p.resolve() in outputs]:  # an earlier run's output inside an input directory
        log.warning(f"skipping {', '.join(map(str, own))}: the output of an earlier run with this --output-prefix")
        files = [p for p in files if p not in own]
    if not files:
        raise DataError(f"no files matching --glob {glob!r} under {', '.join(map(str, inputs))}; "
                        "check --input and --glob")
    if split_lines and input_format == "auto" and (whole := [p for p in files if p.is_file() and p.suffix.lower()
                                                             not in (".txt", *JSON_SUFFIXES)]):
        others = f" and {len(whole) - 1} more files are" if len(whole) > 1 else " is"
        log.warning(f"--split-lines reads .txt files line by line; {whole[0]}{others} read whole, one document "
                    "each: add --input-format txt to split them too")
    total_bytes = sum(p.stat().st_size for p in files)
    repairs = _Repairs()
    batches = _batches(iter_documents(files, json_key, split_lines, repairs, input_format))
    use_pool = workers > 1 and not isinstance(tokenizer, ByteTokenizer)

    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (batch logs stay clean).
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing",
               disable=None if show_progress else True)
    skipped = 0
    if output_format == "megatron" and tokenizer.vocab_size > 2**31:
        raise DataError(f"vocab {tokenizer.vocab_size} is too large for Megatron-LM's int32 tokens; "
                        "use --format megalm")
    writer_class = MegatronDatasetWriter if output_format == "megatron" else IndexedDatasetWriter
    writer = writer_class(output_prefix, tokenizer.vocab_size, tokenizer.spec, tokenizer.eod_id, overwrite=overwrite)
    with bar, writer:

        def write(encoded: list[np.ndarray], nbytes: int, n_skipped: int) -> None:
            nonlocal skipped
            for ids in encoded:
                writer.add_document(ids)
            skipped += n_skipped
            bar.update(nbytes)

        if use_pool:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor
            from concurrent.futures.process import BrokenProcessPool

            # spawn, not fork: the parent may already run tokenizer threads. At most 2 batches per
            # worker are in flight, so memory stays bounded however large the corpus is; results are
            # written in submission order, so the output does not depend on --workers.
            try:
                with ProcessPoolExecutor(workers, mp.get_context("spawn"), _worker_init,
                                         (tokenizer.spec,)) as pool:
                    pending: deque = deque()
                    for texts, nbytes, n_skipped in batches:
                        pending.append((pool.submit(_worker_encode, texts), nbytes, n_skipped))
                        if len(pending) >= 2 * workers:
                            future, nb, ns = pending.popleft()
                            write(future.result(), nb, ns)
                    while pending:
                        future, nb, ns = pending.popleft()
                        write(future.result(), nb, ns)
            except BrokenProcessPool:
                raise DataError("the --workers processes died (out of memory, or started from an "
                                "interactive/stdin script); run with --workers 1") from None
        else:
            for texts, nbytes, n_skipped in batches:
                write(_encode_batch(tokenizer, texts), nbytes, n_skipped)
        if writer.num_docs == 0:
            raise DataError(f"no documents found in {', '.join(map(str, inputs))} (all empty); "
                            "check --input, --json-key and --glob")
        writer.finalize()
        stats = PreprocessStats(output_prefix, len(files), writer.num_docs, writer.num_tokens, skipped,
                                tokenizer.vocab_size, writer.dtype.name, time.perf_counter() - start, output_format,
                                repairs.documents)
    return stats


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one `error: ...` line (exit code 2), like every other error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="megalm-preprocess",
                       description="Tokenize text into an indexed dataset (PREFIX.bin + PREFIX.idx) "
                                   "for megalm.")
    p.add_argument("--input", nargs="+", metavar="PATH",
                   help=".jsonl/.json (one JSON object per line), .txt (one document; one per line with "
                        "--split-lines), any other file (one document; compressed ones are refused), a pipe "
                        "(<(zcat FILE)), or a directory (walked recursively, symlinks followed, tokenized "
                        "datasets left out)")
    p.add_argument("--output-prefix", help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    p.add_argument("--tokenizer", default="byte", help="'byte' (default) or the path of a Hugging Face "
                                                       "tokenizer.json")
    p.add_argument("--json-key", default="text",
                   help="the key holding the text in .jsonl files (default: text)")
    p.add_argument("--split-lines", action="store_true", help="every line of a .txt file is a document")
    p.add_argument("--input-format", choices=INPUT_FORMATS, default="auto",
                   help="auto (default): each file by its suffix, a pipe by its first line (jsonl when it is a JSON "
                        "object with --json-key, else text; the log says which); jsonl or txt: every input so")
    p.add_argument("--glob", default="*", help="file-name pattern for files inside directories (default: *); "
                                               "hidden files and directories are skipped")
    p.add_argument("--format", choices=FORMATS, default="megalm",
                   help="megalm (default) or megatron: Megatron-LM's MMIDIDX .bin/.idx, which Megatron-LM reads "
                        "too, plus OUTPUT_PREFIX.megalm.json with the tokenizer, vocab and eod for megalm")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT_PREFIX.bin/.idx")
    p.add_argument("--workers", type=int, default=1,
                   help="processes tokenizing in parallel (Hugging Face tokenizers; 'byte' needs none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--sidecar", metavar="PREFIX",
                   help="instead of tokenizing: write PREFIX.megalm.json for a dataset Megatron-LM wrote, with "
                        "--tokenizer's vocab and eod and whether its documents end with eod, so that opening it "
                        "reads no document's last token (docs/data_formats.md)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sidecar is not None and (args.input or args.output_prefix):
        parser.error("--sidecar PREFIX describes a dataset that exists: it takes no --input or --output-prefix")
    if args.sidecar is None and not (args.input and args.output_prefix):
        parser.error("the following arguments are required: --input, --output-prefix (or --sidecar PREFIX)")
    try:
        if args.sidecar is not None:
            prefix = os.path.expanduser(args.sidecar)  # as data.path
            if not (os.path.isfile(f"{prefix}.idx") and os.path.isfile(f"{prefix}.bin")):
                raise DataError(f"--sidecar {prefix}: no {prefix}.idx and {prefix}.bin; name the prefix of a dataset "
                                "Megatron-LM tokenized (its PREFIX.bin and PREFIX.idx)")
            with open(f"{prefix}.idx", "rb") as f:
                megalm_format = f.read(len(MEGALM_MAGIC)) == MEGALM_MAGIC
            if megalm_format:
                raise DataError(f"{prefix} is a megalm dataset, whose .idx names its tokenizer, vocab and eod: it "
                                "needs no sidecar")
            meta = write_sidecar(prefix, build_tokenizer(args.tokenizer), overwrite=args.overwrite)
            docs = f"{meta['num_docs']:,} document{'' if meta['num_docs'] == 1 else 's'}"
            print(f"wrote {sidecar_path(prefix)}: {docs}, tokenizer "
                  f"{meta['tokenizer_spec']}, its documents "
                  f"{'end with eod' if meta['eod_appended'] else 'get an eod at read time'}")
            return 0
        if args.workers < 1:
            raise DataError(f"--workers={args.workers} must be >= 1")
        stats = preprocess(args.input, args.output_prefix, build_tokenizer(args.tokenizer),
                           json_key=args.json_key, split_lines=args.split_lines, overwrite=args.overwrite,
                           show_progress=not args.no_progress, glob=args.glob, workers=args.workers,
                           output_format=args.format, input_format=args.input_format)
    except (MegalmError, OSError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        sys.exit(130)
    print(stats.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
