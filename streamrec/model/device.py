"""The torch device a process runs the model on, from a ``device`` setting."""

from __future__ import annotations

import torch


def pick_device(name: str, setting: str) -> torch.device:
    """``auto``: CUDA when available, else CPU; otherwise the named device, which must exist.
    ``setting`` names the config key in errors (``trainer.device``, ``serving.device``)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"{setting} must be auto, cpu, cuda or cuda:N; got {name!r} ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{setting} is {name} but no CUDA device is available")
    return device
