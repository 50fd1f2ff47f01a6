"""Masks across libraries, converted to and from attnlib's boolean ``True`` = may attend
(chapter 5's mask Rosetta stone, in the reference appendix)."""

from __future__ import annotations

import torch
from torch import Tensor

from attnlib.checks import check_head_mask, check_positive_int, check_tensor, format_shape

__all__: list[str] = []

# ---------------------------------------------------------------------------
# Masks across libraries (chapter 5's mask Rosetta stone)
#
# attnlib, and F.scaled_dot_product_attention with a boolean mask: True = may attend.
# nn.MultiheadAttention's boolean attn_mask and key_padding_mask: True = may NOT attend.
# Additive (float) masks, in every library: added to the scores before the softmax,
# 0 = may attend, -inf (PyTorch) or torch.finfo(dtype).min (Hugging Face) = may not.
# ---------------------------------------------------------------------------


def _require_bool(mask: object, name: str) -> Tensor:
    mask = check_tensor(name, mask)
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must have dtype torch.bool, got {name} of shape {format_shape(mask)} and dtype {mask.dtype}")
    return mask


def additive_mask(mask: Tensor, dtype: torch.dtype = torch.float32, fill: str = "-inf") -> Tensor:
    """attnlib's boolean mask (``True`` = may attend) as an additive float mask.

    ``A = 0`` where ``mask`` is ``True`` and ``A = fill`` where it is ``False``, so that
    ``softmax(S + A)`` ignores the masked keys. ``fill="-inf"`` is PyTorch's convention
    (``nn.MultiheadAttention``, SDPA); ``fill="min"`` uses ``torch.finfo(dtype).min``, the
    large finite negative number of Hugging Face's extended masks. Same shape as ``mask``.
    """
    mask = _require_bool(mask, "mask")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    if fill not in ("-inf", "min"):
        raise ValueError(f"fill must be '-inf' or 'min', got {fill!r}")
    blocked = float("-inf") if fill == "-inf" else torch.finfo(dtype).min
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return zero.masked_fill(~mask, blocked).expand(mask.shape).clone()  # same shape as mask


def mask_from_additive(additive: Tensor) -> Tensor:
    """An additive mask (0 = may attend; ``-inf`` or ``torch.finfo(dtype).min`` = may not)
    as attnlib's boolean mask, same shape. Any other value is a bias, not a mask, and an
    error: its information would be lost."""
    if not isinstance(additive, Tensor) or not additive.dtype.is_floating_point:
        raise TypeError("additive must be a floating-point torch.Tensor")
    blocked = additive <= torch.finfo(additive.dtype).min  # -inf or finfo.min
    if not ((additive == 0) | blocked).all():
        raise ValueError(
            f"additive of shape {format_shape(additive)} holds values other than 0 and -inf/finfo.min: "
            "it is a bias, not a mask"
        )
    return ~blocked


def mask_from_padding(attention_mask: Tensor, padding_is_true: bool = False) -> Tensor:
    """A per-sequence padding mask ``(B, n_k)`` as attnlib's mask ``(B, 1, 1, n_k)``,
    broadcastable to ``(B, h, n_q, n_k)``.

    ``padding_is_true=False``: Hugging Face's ``attention_mask`` (1 = real token, 0 = padding;
    any integer or bool dtype). ``padding_is_true=True``: ``nn.MultiheadAttention``'s boolean
    ``key_padding_mask`` (``True`` = padding, may not be attended)."""
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
        got = format_shape(attention_mask) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a 2-D tensor (B, n_k), got {got}")
    if padding_is_true:
        real = ~_require_bool(attention_mask, "key_padding_mask")
    else:
        if attention_mask.dtype.is_floating_point or not ((attention_mask == 0) | (attention_mask == 1)).all():
            raise ValueError("attention_mask must hold only 0 and 1 (1 = real token) in an integer or bool dtype")
        real = attention_mask.bool()
    return real[:, None, None, :]  # (B, 1, 1, n_k)


def hf_extended_mask(attention_mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Hugging Face's additive mask for eager attention: ``(B, n_k)`` of 1/0 ->
    ``(B, 1, 1, n_k)``, 0 for real tokens and ``torch.finfo(dtype).min`` for padding.

    This is the ``(1 - mask) * finfo.min`` that transformers 4's
    ``get_extended_attention_mask`` returned. transformers 5's ``create_bidirectional_mask``
    (which ``BertModel`` calls) returns, with eager attention and some padding, the same
    values broadcast to ``(B, 1, n_q, n_k)``: ``hf_extended_mask(m).expand(B, 1, n_q, n_k)``;
    with SDPA it returns a boolean mask instead (``mask_from_padding`` broadcast), and
    ``None`` in both cases when nothing is padding."""
    return additive_mask(mask_from_padding(attention_mask), dtype=dtype, fill="min")


def to_torch_mha_masks(mask: Tensor, batch_size: int, num_heads: int) -> Tensor:
    """attnlib's mask, broadcastable to ``(B, h, n_q, n_k)``, as ``nn.MultiheadAttention``'s
    boolean ``attn_mask`` (``True`` = may **not** attend).

    A mask with at most two dimensions ``(n_q, n_k)`` stays 2-D. Anything else becomes the
    3-D ``(B * h, n_q, n_k)`` torch wants, with the heads of one sequence adjacent: row
    ``b * h + i`` is sequence ``b``, head ``i``. (A per-sequence mask ``(B, n_q, n_k)``
    therefore needs ``repeat_interleave(h, 0)``; ``repeat(h, 1, 1)`` would give sequence
    ``r mod B`` to row ``r``.) A 3-D attnlib mask is refused, as by
    :class:`attnlib.MultiHeadAttention`: write ``mask[:, None]`` or ``mask[None]``."""
    mask = _require_bool(mask, "mask")
    if mask.dim() <= 2:
        return ~mask
    if mask.dim() == 3:  # ambiguous: check_head_mask raises, saying how to write it
        check_head_mask(mask, torch.Size([batch_size, num_heads, *mask.shape[1:]]))
    if mask.dim() > 4:
        raise ValueError(f"mask must have at most 4 dimensions (B, h, n_q, n_k), got {format_shape(mask)}")
    m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B or 1, h or 1, n_q, n_k)
    b, h = m4.shape[0], m4.shape[1]
    if b not in (1, batch_size) or h not in (1, num_heads):
        raise ValueError(
            f"mask of shape {format_shape(mask)} does not broadcast to (B, h, n_q, n_k) with "
            f"B = {batch_size}, h = {num_heads}"
        )
    full = m4.expand(batch_size, num_heads, *m4.shape[2:])  # (B, h, n_q, n_k)
    return ~full.reshape(batch_size * num_heads, *m4.shape[2:])  # (B*h, n_q, n_k), batch-major


def from_torch_mha_masks(
    attn_mask: Tensor | None, key_padding_mask: Tensor | None, batch_size: int, num_heads: int
) -> Tensor:
    """What ``nn.MultiheadAttention`` lets each head attend to, as attnlib's mask
    ``(B, h, n_q, n_k)`` (``True`` = may attend), from its ``attn_mask`` (``(n_q, n_k)``
    or ``(B * h, n_q, n_k)``, boolean ``True`` = blocked or additive) and boolean
    ``key_padding_mask`` ``(B, n_k)`` (``True`` = padding). torch blocks a key if
    **either** mask blocks it, so the result is the logical AND of what each allows."""
    if attn_mask is None and key_padding_mask is None:
        raise ValueError("give attn_mask, key_padding_mask or both")
    allowed: Tensor | None = None
    if attn_mask is not None:
        allowed = ~attn_mask if attn_mask.dtype == torch.bool else mask_from_additive(attn_mask)
        if allowed.dim() == 3:
            if allowed.shape[0] != batch_size * num_heads:
                raise ValueError(
                    f"a 3-D attn_mask must have shape (B * h, n_q, n_k) with B * h = "
                    f"{batch_size * num_heads}, got {format_shape(attn_mask)}"
                )
            allowed = allowed.view(batch_size, num_heads, *allowed.shape[1:])  # (B, h, n_q, n_k)
        elif allowed.dim() != 2:
            raise ValueError(f"attn_mask must be (n_q, n_k) or (B * h, n_q, n_k), got {format_shape(attn_mask)}")
    if key_padding_mask is not None:
        if key_padding_mask.dim() != 2 or key_padding_mask.shape[0] != batch_size:
            raise ValueError(f"key_padding_mask must have shape (B, n_k) with B = {batch_size}, got {format_shape(key_padding_mask)}")
        keys = mask_from_padding(key_padding_mask, padding_is_true=True)  # (B, 1, 1, n_k)
        allowed = keys if allowed is None else allowed & keys
    assert allowed is not None
    n_q, n_k = allowed.shape[-2], allowed.shape[-1]
    return allowed.expand(batch_size, num_heads, n_q, n_k)  # (B, h, n_q, n_k)


def fully_masked_rows(mask: Tensor) -> Tensor:
    """``(..., n_q)``: ``True`` for the queries that may attend to no key at all. Their
    output differs by library: attnlib and ``F.scaled_dot_product_attention`` give 0;
    ``nn.MultiheadAttention`` gives NaN on its explicit-softmax paths and its inference
    fast path, 0 on its SDPA path (training with ``need_weights=False``); an additive
    ``finfo.min`` mask (Hugging Face) gives the plain average of all values."""
    return ~_require_bool(mask, "mask").any(dim=-1)


__all__ += [
    "additive_mask",
    "mask_from_additive",
    "mask_from_padding",
    "hf_extended_mask",
    "to_torch_mha_masks",
    "from_torch_mha_masks",
    "fully_masked_rows",
]

