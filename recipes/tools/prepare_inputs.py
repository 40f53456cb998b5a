"""Documents from what ``python -m recipes.prepare`` is given, streamed in a fixed order.

* a text file is one document (any suffix not below), read as bytes;
* ``*.jsonl`` / ``*.json`` / ``*.parquet`` / ``*.arrow`` / ``*.csv`` are read through the ``datasets``
  package, streaming (no Arrow copy of the corpus is made), one record per document, its text in
  ``--text-key``;
* a folder written by ``Dataset.save_to_disk`` (it holds ``dataset_info.json`` or ``state.json``, or
  ``dataset_dict.json``) is loaded with ``datasets.load_from_disk`` (``--input-split`` of a dict);
* ``hf:<name>`` is a Hub dataset, streamed (``--input-split``; needs the network);
* any other folder: its files, recursively, sorted, each by the rules above.

Every problem with an input is a :class:`DataError` raised before any tokenizer worker starts
(:func:`check_inputs` reads each dataset's first record).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..training.corpus_format import DataError

DATASET_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
BATCH = 1000  # records read from a dataset at a time


@dataclass(frozen=True)
class Source:
    """One input: ``kind`` ``text`` (``path`` a file), ``files`` (``format`` of ``datasets`` and its
    files), ``saved`` (a ``save_to_disk`` folder) or ``hub`` (``path`` the name)."""

    kind: str
    path: str
    format: str | None = None
    files: tuple[str, ...] = ()


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError(
            "jsonl/parquet/arrow/csv and saved or Hub datasets need `datasets`: pip install 'gridtrain[data]'"
        ) from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return datasets


def sources(inputs: list[str]) -> list[Source]:
    """The inputs as sources, in order: text files one by one, runs of dataset files of one format
    together (one ``datasets`` reader each)."""
    out: list[Source] = []
    for item in inputs:
        if item.startswith("hf:"):
            out.append(Source("hub", item[3:]))
            continue
        p = Path(item)
        if p.is_dir() and any((p / m).is_file() for m in SAVED_MARKERS):
            out.append(Source("saved", str(p)))
            continue
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        elif p.is_file():
            files = [p]
        elif p.exists():
            raise DataError(f"input {item} is not a regular file or directory (a device, pipe or socket)")
        else:
            raise DataError(f"input {item} does not exist")
        for f in files:
            fmt = DATASET_FORMATS.get(f.suffix.lower())
            if fmt is None:
                out.append(Source("text", str(f)))
            elif out and out[-1].kind == "files" and out[-1].format == fmt:
                out[-1] = Source("files", out[-1].path, fmt, (*out[-1].files, str(f)))
            else:
                out.append(Source("files", str(f), fmt, (str(f),)))
    if not out:
        raise DataError("no input files given (the folders named hold no files)")
    return out


def _dataset(src: Source, split: str):
    ds_mod = _datasets()
    try:
        if src.kind == "files":
            return ds_mod.load_dataset(src.format, data_files=list(src.files), split="train", streaming=True)
        if src.kind == "hub":
            return ds_mod.load_dataset(src.path, split=split, streaming=True)
        ds = ds_mod.load_from_disk(src.path)
    except Exception as e:  # noqa: BLE001 - the library's error, in one line
        raise DataError(f"cannot read {src.path} as a dataset ({type(e).__name__}: {str(e)[:160]})") from None
    if isinstance(ds, ds_mod.DatasetDict):
        if split not in ds:
            raise DataError(f"{src.path} has splits {sorted(ds)}, not --input-split {split!r}")
        ds = ds[split]
    return ds


def _records(src: Source, split: str, key: str) -> Iterator[list]:
    try:
        for batch in _dataset(src, split).iter(batch_size=BATCH):
            if key not in batch:
                raise DataError(f"{src.path} has no column {key!r} (it has {sorted(batch)}); name it with --text-key")
            yield batch[key]
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt or truncated file, found while reading
        raise DataError(f"cannot read {src.path} ({type(e).__name__}: {str(e)[:160]}); is it complete?") from None


def check_inputs(srcs: list[Source], split: str, key: str) -> None:
    """Read each dataset source's first batch: the text key exists, the file opens."""
    for src in srcs:
        if src.kind != "text":
            next(_records(src, split, key), None)


def documents(srcs: list[Source], split: str, key: str) -> Iterator[str | bytes]:
    """Every document of every source, in order (text files as bytes, records as str; ``None``
    and non-string values are refused naming the source)."""
    for src in srcs:
        if src.kind == "text":
            yield Path(src.path).read_bytes()
            continue
        for texts in _records(src, split, key):
            for t in texts:
                if not isinstance(t, str):
                    raise DataError(f"{src.path}: column {key!r} holds {type(t).__name__}, not text")
                yield t
