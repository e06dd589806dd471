"""The output folder of label generation: checks before any model is loaded, atomic writes, the run lock.

Layout::

    <output_dir>/meta.json, data-*.arrow, state.json, dataset_info.json   the finished dataset (save_to_disk)
    <output_dir>/_work/config.json                                          what a partial run was started with
    <output_dir>/_work/batches/000012/                                      one finished batch (atomic rename)
    <output_dir>/shards/0-of-4/                                             a --shard 0/4 output (same layout)

meta.json is written last, so a folder holding it is complete; a folder holding ``_work/`` is a partial run that the
same command resumes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..acceptance.labels import FORMAT
from .config import config_differences

META = "meta.json"
WORK = "_work"
SHARDS = "shards"
DATASET_FILES = ("state.json", "dataset_info.json")
SHARD_NAME = re.compile(r"^(\d+)-of-(\d+)$")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as sorted, indented JSON through a temporary file and a rename (never a half file)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or None if it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def dataset_files(folder: Path) -> list[Path]:
    """The files ``Dataset.save_to_disk`` wrote into ``folder``."""
    return list(folder.glob("data-*.arrow")) + [folder / n for n in DATASET_FILES if (folder / n).exists()]


def make_writable_dir(path: Path) -> Path | None:
    """Create ``path`` if needed and prove it is writable (before any model is loaded).

    Returns the outermost folder this created (None if ``path`` existed), for :func:`remove_created`.
    """
    if path.exists() and not path.is_dir():
        raise ValueError(f"output_dir={str(path)!r} is a file, not a folder; pass a folder with --output_dir.")
    created = None
    for parent in [path, *path.parents]:
        if parent.exists():
            break
        created = parent
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"output_dir={str(path)!r} is not writable ({err.strerror or err}); pass a folder you can write to "
            "with --output_dir."
        ) from err
    return created


def output_status(path: Path, fingerprint: dict, overwrite: bool) -> str:
    """What to do with the (existing, writable) folder ``path``; raise ValueError when it must not be touched.

    Returns ``fresh`` (nothing there yet), ``resume`` (a partial run of this config), ``complete`` (this config,
    finished) or ``replace`` (``overwrite``: whatever data_gen output is there, this config's too, is cleared once
    the run is ready to write).
    """
    meta = read_json(path / META) if (path / META).is_file() else None
    work = read_json(path / WORK / "config.json") if (path / WORK).is_dir() else None
    if meta is not None and meta.get("format") == FORMAT:
        previous, status = meta.get("fingerprint"), "complete"
    elif work is not None:
        previous, status = work.get("fingerprint"), "resume"
    else:
        known = {WORK, SHARDS}
        foreign = sorted(p.name for p in path.iterdir() if p.name not in known and not p.name.startswith(".write-"))
        if foreign:
            raise ValueError(
                f"output_dir={str(path)!r} is not empty and holds no data_gen output ({', '.join(foreign[:5])}"
                f"{', ...' if len(foreign) > 5 else ''}); choose a new or empty folder with --output_dir."
            )
        return "fresh"
    if previous == fingerprint and not overwrite:
        return status
    if not overwrite:
        what = "a finished dataset" if status == "complete" else "a partial run"
        diff = config_differences(previous or {}, fingerprint)
        raise ValueError(
            f"output_dir={str(path)!r} holds {what} made with a different config: {'; '.join(diff[:8]) or 'unknown'}. "
            "Pass --overwrite true to replace it, or choose another --output_dir."
        )
    return "replace"


def clear_output(path: Path) -> None:
    """Remove the data_gen content of ``path`` (dataset files, meta.json, _work); leave ``shards/`` alone."""
    for file in dataset_files(path):
        file.unlink()
    (path / META).unlink(missing_ok=True)
    shutil.rmtree(path / WORK, ignore_errors=True)


def remove_created(out: Path, created: Path | None) -> None:
    """Undo the folders :func:`make_writable_dir` created, as long as they are still empty.

    Called when a run fails before writing any work (bad prompts, tokenizer mismatch, ...).
    """
    if created is None:
        return
    for folder in [out, *out.parents]:
        try:
            folder.rmdir()  # only succeeds on an empty folder: never removes another process's work
        except OSError:
            return
        if folder == created:
            return


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an advisory lock on the folder ``path`` so two processes never write the same output.

    The lock is taken on the folder itself and the kernel releases it when the process ends, kill -9 included.
    Deliberately not ``filelock``: it needs a lock file, which in or beside the output folder would break "a run that
    fails writes nothing" (tried: the write-nothing tests fail). Without ``fcntl`` (not POSIX) there is no lock.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            raise ValueError(
                f"Another data_gen process is writing to {path}; wait for it or pick another --output_dir."
            ) from err
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """Silence ``datasets``' per-save progress bars (they would interleave with ours); restore them afterwards."""
    from datasets.utils import logging as ds_logging

    enabled = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            ds_logging.enable_progress_bar()


def empty_dataset(features):
    """A label dataset with no rows (a shard that got no batch), of the given ``datasets.Features``."""
    import datasets

    return datasets.Dataset.from_dict({name: [] for name in features}, features=features)


def save_dataset(dataset, out: Path) -> None:
    """``save_to_disk`` into ``out`` after removing a previous dataset's files (other content stays)."""
    for file in dataset_files(out):
        file.unlink()
    dataset.save_to_disk(str(out), num_shards=1 if len(dataset) == 0 else None)
