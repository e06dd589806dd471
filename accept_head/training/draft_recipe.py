"""What the two draft recipes (:mod:`.distill_recipe`, :mod:`.feature_draft_recipe`) share: work folders, atomic
writes, the resumable Lightning run, the draft-step timing, and the model cards' plot and README.md."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger


def expand(path: str) -> Path:
    """``path`` with ``~`` expanded (the recipes' work folders live outside the repository)."""
    return Path(os.path.expanduser(path))


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads, when given (None keeps torch's default)."""
    if threads:
        torch.set_num_threads(threads)


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h
_GLIBC_MMAP_MAX, _GLIBC_TRIM_THRESHOLD = 65536, 128 * 1024  # glibc's defaults


@functools.cache
def _libc():
    """The C library when it is glibc (has ``mallopt`` and ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 -- both or neither
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory(keep: bool = True) -> bool:
    """Have glibc's ``malloc`` keep freed memory for the next allocation (``keep``) instead of handing it back to the
    system, or restore its defaults (``keep=False``, which also gives back what is free).

    A training step on a CPU allocates and frees tensors of hundreds of MB (a batch's logits over the kept vocabulary);
    by default glibc serves each from a fresh ``mmap`` and unmaps it when freed, so every step pays the kernel's page
    faults (and page zeroing) again on first touch. Serving them from the heap (``M_MMAP_MAX`` = 0) and trimming only
    above 2 GB free (``M_TRIM_THRESHOLD``) keeps the pages. The heap then fragments as batch shapes vary (a fit grew to
    19 GB resident in 750 steps): pair it with :func:`trim_freed_memory` every few steps, as :class:`FreedMemory` does.
    Returns False (and changes nothing) where the C library is not glibc."""
    libc = _libc()
    if libc is None:
        return False
    if keep:
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    done = bool(libc.mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_TRIM_THRESHOLD)
    )
    trim_freed_memory()
    return done


def trim_freed_memory() -> None:
    """Give the free pages of glibc's heap back to the system (``malloc_trim``); nothing elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


class FreedMemory(Callback):
    """Training on a CPU: glibc keeps freed pages between steps (:func:`keep_freed_memory`) and gives back what is
    free every ``trim_every`` optimizer steps and after each validation (:func:`trim_freed_memory`), so the steps
    skip most page faults while the process stays near its peak of one step. Measured on the feature draft's training
    step (docs/measurements.md): 1.22× glibc's defaults over 30 steps at the same peak memory; in a 300-step fit
    trimming every 10 steps ran within 2% of every 100 at a third less memory (untrimmed, a fit grew to 19 GB).
    glibc's defaults come back when training ends."""

    def __init__(self, trim_every: int = 10) -> None:
        self.trim_every, self.active = trim_every, False

    def on_fit_start(self, trainer, pl_module) -> None:
        self.active = keep_freed_memory()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.active and trainer.global_step % self.trim_every == 0:
            trim_freed_memory()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.active:
            trim_freed_memory()

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.active:
            keep_freed_memory(False)
            self.active = False


def save_atomic(obj: Any, path: Path, save: Callable[[Any, str], None] = torch.save) -> None:
    """``save(obj, <path>.tmp)``, then rename onto ``path``: a killed stage leaves no half-written shard behind."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    save(obj, str(tmp))
    os.replace(tmp, path)


def jsonable(cfg: Any) -> dict:
    """A recipe's config dataclass as plain JSON values (anything else as its string)."""
    return json.loads(json.dumps(asdict(cfg), default=str))


def fit_resumable(
    module,
    work: Path,
    max_steps: int,
    val_every_steps: int,
    checkpoint_every_steps: int | None = None,
    datamodule=None,
    accelerator: str = "cpu",
    **trainer,
) -> Trainer:
    """Train ``module`` on one ``accelerator`` device (``cpu`` or ``gpu``) for ``max_steps`` optimizer steps,
    validating every ``val_every_steps`` and checkpointing every ``checkpoint_every_steps`` (None: at each
    validation), resuming from ``<work>/checkpoints/last.ckpt`` when it exists; logs go to a new
    ``<work>/logs/version_N`` per run (a fixed version's CSV would be wiped on resume). ``trainer``: further
    :class:`~lightning.pytorch.Trainer` arguments."""
    # Only last.ckpt, rewritten in place (save_top_k=0 needs every_n_train_steps to write at all): a resumed run, also
    # from a moved work folder whose checkpoint names another dirpath, must overwrite it rather than write
    # last-v1.ckpt beside it, or the next resume would go back to the old one.
    checkpoints = ModelCheckpoint(
        dirpath=work / "checkpoints",
        save_last=True,
        save_top_k=0,
        every_n_train_steps=checkpoint_every_steps or val_every_steps,
        enable_version_counter=False,
    )
    run = Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=max_steps,
        max_epochs=-1,
        val_check_interval=val_every_steps,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        callbacks=[checkpoints] + ([FreedMemory()] if accelerator == "cpu" else []),
        logger=CSVLogger(work, name="logs"),
        log_every_n_steps=10,
        enable_progress_bar=False,
        **trainer,
    )
    last = work / "checkpoints" / "last.ckpt"
    run.fit(module, datamodule=datamodule, ckpt_path=str(last) if last.exists() else None)
    return run


def time_draft_step(target, drafter, rounds: int, head=None, context: int = 128, steps: int = 30) -> dict:
    """Median ms of one drafting step (``drafter.propose``, plus ``head`` on its hidden state) and of one single-token
    target forward on a KV cache of ``context`` tokens: ``rounds`` rounds of ``steps`` draft steps then ``steps``
    target forwards (blocks, as a round drafts several tokens in a row; rounds interleave the two against machine
    noise). ``ratio`` is draft over target.

    Not :func:`~accept_head.engine.measure.measure_costs`: that alternates draft and target call by call, so every draft
    step starts with the target's weights in the CPU caches: on this project's 2-core CPU, side by side on the
    committed feature draft, it measured c = 0.100 where this measures 0.058 (draft 3.3 against 2.2 ms).
    """
    from transformers import DynamicCache

    from ..chain.decoding import prefill
    from ..core.hf_compat import cache_kwargs, crop_cache
    from ..core.timing import device_timer, module_device

    device = module_device(target)
    draft_device = getattr(drafter, "device", device)
    ids = torch.randint(0, target.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    draft_times, target_times = [], []
    for _ in range(rounds):
        cache = DynamicCache()
        prefill(target, drafter, ids, cache)
        drafter.propose(None)
        token = int(ids[0, -1])
        for _ in range(steps):
            with device_timer(draft_device) as watch:
                step = drafter.propose(token)
                if head is not None:
                    head(step.hidden[None])
            draft_times.append(watch.seconds)
        for _ in range(steps):
            with device_timer(device) as watch:
                target(input_ids=ids.new_tensor([[token]]), **cache_kwargs(target, cache), logits_to_keep=1)
            target_times.append(watch.seconds)
            crop_cache(cache, cache.get_seq_length() - 1)
    d, t = statistics.median(draft_times), statistics.median(target_times)
    return {"draft_ms": 1e3 * d, "target_ms": 1e3 * t, "ratio": d / t, "samples_each": len(draft_times)}


def plot_curves(path: Path, curves: Sequence[tuple[list, list, dict]], xlabel: str, ylabel: str) -> None:
    """A model card's learning-curve PNG: one line per ``(xs, ys, matplotlib keyword arguments)``."""
    from ..acceptance.plots import new_figure, save_figure

    fig = new_figure(6, 3.5)
    ax = fig.subplots()
    for xs, ys, style in curves:
        ax.plot(xs, ys, **style)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def write_card(folder: Path, text: str) -> str:
    """Write ``text`` as the model folder's README.md; returns it."""
    (folder / "README.md").write_text(text)
    print(f"[model_card] wrote {folder / 'README.md'}", flush=True)
    return text
