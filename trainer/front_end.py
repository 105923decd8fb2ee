"""The trainer's front end: its sample source and the Prefetcher that batches it, either on
a thread of the trainer's process or in a child process (trainer/decode_process.py)."""

from __future__ import annotations

import torch

from trainer.decode_process import DecodeProcess
from trainer.prefetch import Prefetcher
from trainer.sources import SampleSource, SourceRecipe


def decodes_in_process(mode: str, device: torch.device) -> bool:
    """``trainer.decode_process``: "auto" decodes in a child process on CUDA, where the
    training thread is bound by the host and a decoding thread's share of the GIL slows
    every step; on CPU the cores are the limit, and a process adds none."""
    return mode == "process" or (mode == "auto" and device.type == "cuda")


def open_front_end(recipe: SourceRecipe, batch_size: int, history_len: int, depth: int, device: torch.device, mode: str = "auto",
                   max_delay_s: float | None = None) -> tuple[SampleSource, Prefetcher | DecodeProcess]:
    """(the source to commit to and ask for lag, the started prefetcher to ``get`` from);
    stop the prefetcher, then close the source."""
    pin = device.type == "cuda"
    if decodes_in_process(mode, device):
        worker = DecodeProcess(recipe, batch_size, history_len, depth, pin, max_delay_s).start()
        return worker, worker
    source = recipe.open()
    return source, Prefetcher(source, recipe.spec, batch_size, history_len, depth, pin, max_delay_s).start()
