"""What :func:`~attnlib.audit.diagnose`, :func:`~attnlib.audit.planted` and
:func:`~attnlib.audit.diagnose_cache` share: checks of their arguments, the relative error
they compare outputs by, and where in a reader's code an error was raised."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlib.multihead import MultiHeadAttention

__all__ = ["check_flags", "check_reference", "default_rtol", "module_dtype", "relative_error", "where_raised"]

_TORCH_DIR = str(Path(torch.__file__).parent)


def check_reference(reference: object) -> None:
    """Refuse a reference that is not an :class:`~attnlib.MultiHeadAttention` (``TypeError``)."""
    if not isinstance(reference, MultiHeadAttention):
        raise TypeError(
            f"reference must be an attnlib.MultiHeadAttention holding your weights, got {type(reference).__name__}"
        )


def check_flags(causal: object, padding: object, cross: object) -> None:
    """Refuse call-form flags that are not bools (``TypeError``), or ``causal`` with ``cross``
    (``ValueError``)."""
    for name, value in (("causal", causal), ("padding", padding), ("cross", cross)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if causal and cross:
        raise ValueError(
            "causal=True and cross=True together: cross-attention reads a context with no "
            "positions in common with the queries, so there is no future to mask; pass one of them"
        )


def default_rtol(dtype: torch.dtype) -> float:
    """sqrt(machine epsilon): 3.5e-4 for float32, 1.5e-8 for float64, 0.03 for float16."""
    return math.sqrt(torch.finfo(dtype).eps)


def relative_error(y: Tensor, r: Tensor) -> float:
    """``max |y - r| / max |r|`` over the finite ``r``; where both are NaN they agree, where
    only one is NaN or inf the error is ``inf``."""
    y64, r64 = y.to(torch.float64), r.to(torch.float64)
    diff = (y64 - r64).abs()  # (B, n, d)
    worst = diff.max()
    if torch.isfinite(worst):  # the common case: no NaN, no inf
        return float(worst / r64.abs().max().clamp_min(torch.finfo(torch.float64).tiny))
    both_nan = torch.isnan(y64) & torch.isnan(r64)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    diff = diff.masked_fill(both_nan, 0.0)
    scale = torch.nan_to_num(r64, nan=0.0).abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return float(diff.max() / scale)


def where_raised(err: BaseException, forward: object) -> str:
    """Where in the reader's code ``err`` was raised: their module, or their adapter."""
    tb = err.__traceback__
    module_frame, last_own = None, None
    while tb is not None:
        frame = tb.tb_frame
        if not frame.f_code.co_filename.startswith(_TORCH_DIR):
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and not isinstance(owner, MultiHeadAttention):
                module_frame = (type(owner).__name__, frame.f_code.co_name, tb.tb_lineno)
            last_own = (frame.f_code.co_name, tb.tb_lineno)
        tb = tb.tb_next
    if module_frame is not None:
        cls, fn, line = module_frame
        return f"inside your module, in {cls}.{fn} (line {line})"
    if last_own is not None and not isinstance(forward, nn.Module):
        return f"in your adapter, {last_own[0]} (line {last_own[1]}), outside your module"
    return "in your forward"


def module_dtype(forward: object) -> torch.dtype | None:
    """The dtype of the first floating parameter of ``forward``'s module (``forward`` itself, or
    the module whose method it is); None for a plain function."""
    owner = forward if isinstance(forward, nn.Module) else getattr(forward, "__self__", None)
    if isinstance(owner, nn.Module):
        for param in owner.parameters():
            if param.is_floating_point():
                return param.dtype
    return None
