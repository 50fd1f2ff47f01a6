"""The KV cache and MLA's latent cache, and what they cost per token (chapter 8).

When a decoder generates token ``n``, the keys and values of tokens ``0..n-1`` have not
changed, so they are kept instead of recomputed: :class:`KVCache` for a decoder layer
(:class:`attnlib.decoding.DecoderAttention` fills and reads it), :class:`LatentCache`
for :class:`attnlib.decoding.LatentAttention`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

from attnlib.checks import check_dtype, check_tensor, check_width, format_shape

__all__ = ["KVCache", "LatentCache", "kv_cache_bytes_per_token", "latent_cache_bytes_per_token",
           "check_cache_call"]


def kv_cache_bytes_per_token(
    num_kv_heads: int, d_k: int, d_v: int | None = None, dtype: torch.dtype = torch.float32
) -> int:
    """Bytes a KV cache holds per token, per layer and sequence: ``g * (d_k + d_v) * itemsize``.

    With ``g = num_kv_heads = h`` (MHA), ``d_k = d_v = d_model / h`` this is
    ``2 * d_model * itemsize``; GQA divides it by ``h / g``; MQA is ``g = 1``.
    """
    check_width("num_kv_heads", num_kv_heads)
    check_width("d_k", d_k)
    d_v = d_k if d_v is None else check_width("d_v", d_v)
    return num_kv_heads * (d_k + d_v) * check_dtype("dtype", dtype).itemsize


def latent_cache_bytes_per_token(d_c: int, d_r: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes an MLA cache holds per token, per layer and sequence: ``(d_c + d_r) * itemsize``
    (one latent of width ``d_c`` and one shared RoPE key of width ``d_r``)."""
    check_width("d_c", d_c)
    check_width("d_r", d_r, zero_ok=True)
    return (d_c + d_r) * check_dtype("dtype", dtype).itemsize


# ---- caches ---------------------------------------------------------------------------------


class _Cache:
    """Per-layer store of tensors that grow along a sequence dimension (base class).

    Subclasses name their tensors (``_names``) and where the sequence axis sits
    (``_seq_dim``). The cache remembers the module that first filled it and refuses any
    other, and refuses a batch size, dtype or device other than the one it holds.
    """

    _names: tuple[str, ...] = ()
    _seq_dim: int = 0
    _kind: str = "cache"
    _shapes: dict[str, str] = {}  # name -> its shape, for messages
    _lead: str = ""  # the dimensions up to the sequence axis, shared by all tensors

    def __init__(self) -> None:
        self._tensors: dict[str, Tensor] = {}
        self._owner: weakref.ReferenceType[nn.Module] | None = None

    def __len__(self) -> int:
        """The number of cached positions ``n``."""
        if not self._tensors:
            return 0
        return int(self._tensors[self._names[0]].shape[self._seq_dim])

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached tensors (nothing else counted)."""
        return sum(t.nbytes for t in self._tensors.values())

    @property
    def batch_size(self) -> int | None:
        """``B`` of the cached tensors; ``None`` while empty."""
        return None if not self._tensors else int(self._tensors[self._names[0]].shape[0])

    @property
    def dtype(self) -> torch.dtype | None:
        """The cached tensors' dtype; ``None`` while empty."""
        return None if not self._tensors else self._tensors[self._names[0]].dtype

    @property
    def device(self) -> torch.device | None:
        """The cached tensors' device; ``None`` while empty."""
        return None if not self._tensors else self._tensors[self._names[0]].device

    def clear(self) -> None:
        """Empty the cache and release it from its module (it may then serve another)."""
        self._tensors = {}
        self._owner = None

    def _get(self, name: str) -> Tensor | None:
        return self._tensors.get(name)

    def check(self, module: nn.Module, batch_size: int, dtype: torch.dtype | None, device: torch.device) -> None:
        """Raise ``ValueError`` unless a call of ``module`` with this batch, dtype and device may
        use the cache: a layer calls it before it computes anything, ``update`` again.

        ``dtype=None`` skips the dtype: a module checking before it projects passes it, because
        under ``torch.autocast`` float32 inputs give bfloat16 (or float16) keys; ``update``
        then checks the dtype of what is actually stored."""
        if self._owner is not None:
            owner = self._owner()
            if owner is None:
                raise ValueError(
                    f"this {self._kind} was filled by a module that no longer exists (it was "
                    f"garbage-collected); call cache.clear() to use the cache with another module"
                )
            if owner is not module:
                raise ValueError(
                    f"this {self._kind} holds the keys of another module ({type(owner).__name__}); "
                    f"use one cache per attention layer, or call cache.clear() first"
                )
        if self._tensors:
            if batch_size != self.batch_size:
                raise ValueError(
                    f"batch size {batch_size} does not match the {self._kind}'s batch size {self.batch_size}"
                )
            if dtype is not None and dtype != self.dtype:
                raise ValueError(
                    f"dtype {dtype} does not match the {self._kind}'s dtype {self.dtype}: make every call "
                    f"with one cache in one dtype (under torch.autocast: every call under the same autocast)"
                )
            if device != self.device:
                raise ValueError(f"device {device} does not match the {self._kind}'s device {self.device}")

    def _check_new(self, **new: Tensor) -> None:
        """Raise unless the new tensors have their rank and agree up to the sequence axis."""
        for name, t in new.items():
            if check_tensor(name, t).dim() != self._seq_dim + 2:
                raise ValueError(f"{name} must have shape {self._shapes[name]}, got {format_shape(t)}")
        (a, ta), (b, tb) = new.items()
        lead = self._seq_dim + 1
        if ta.shape[:lead] != tb.shape[:lead]:
            raise ValueError(
                f"{a} of shape {format_shape(ta)} and {b} of shape {format_shape(tb)} must have the "
                f"same {self._lead}: one entry of each per position"
            )

    def _append(self, module: nn.Module, **new: Tensor) -> dict[str, Tensor]:
        """Append ``new`` (checked by the caller) along the sequence axis; return the totals."""
        if self._tensors:
            self._tensors = {k: torch.cat([self._tensors[k], new[k]], dim=self._seq_dim) for k in self._names}
        else:
            # copies: a view (say of a packed q|k|v projection) would keep its whole base alive
            self._tensors = {k: new[k].clone(memory_format=torch.contiguous_format) for k in self._names}
            self._owner = weakref.ref(module)
        return dict(self._tensors)

    def __repr__(self) -> str:
        if not self._tensors:
            return f"{type(self).__name__}(empty)"
        shapes = ", ".join(f"{k}={format_shape(t)}" for k, t in self._tensors.items())
        return f"{type(self).__name__}(len={len(self)}, {shapes}, dtype={self.dtype})"


class KVCache(_Cache):
    r"""The keys and values of the positions seen so far, for one attention layer.

    Use one empty cache per layer and pass it to every call of that layer::

        cache = KVCache()
        out, w = mha(prompt, prompt, prompt, cache=cache)  # prefill: (B, t, d_model)
        out, w = mha(x_t, x_t, x_t, cache=cache)           # one step: (B, 1, d_model)

    Each call appends the new tokens' keys (after RoPE) and values, and the new queries
    attend causally to everything cached, so a prefill followed by one-token steps gives
    the same outputs as one causal pass over the whole sequence.

    Attributes:
        keys: ``(B, g, n, d_k)`` or ``None`` while empty (``g`` = the layer's ``num_kv_heads``).
        values: ``(B, g, n, d_v)`` or ``None``.

    ``len(cache)`` is ``n``; ``cache.nbytes`` is ``2 B n g d_k`` times the item size
    (``d_v = d_k``): the keys and values, nothing else. The cache holds the dtype the
    projections produce: under ``torch.autocast(..., torch.bfloat16)`` bfloat16, for
    float32 inputs; every call with one cache must then run under that autocast.
    """

    _names = ("keys", "values")
    _seq_dim = 2
    _kind = "KVCache"
    _shapes = {"keys": "(B, g, t, d_k)", "values": "(B, g, t, d_v)"}
    _lead = "(B, g, t)"

    @property
    def keys(self) -> Tensor | None:
        """``(B, g, n, d_k)``, after RoPE; ``None`` while empty."""
        return self._get("keys")

    @property
    def values(self) -> Tensor | None:
        """``(B, g, n, d_v)``; ``None`` while empty."""
        return self._get("values")

    def update(self, module: nn.Module, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``keys`` ``(B, g, t, d_k)`` and ``values`` ``(B, g, t, d_v)`` for ``module``;
        return all cached keys and values ``(B, g, n + t, .)``.

        Raises:
            ValueError: keys and values of other ranks or of different ``(B, g, t)``;
                another module filled the cache (or it was garbage-collected); batch size,
                dtype, device or head shape differ from what the cache holds.
        """
        self._check_new(keys=keys, values=values)
        self.check(module, keys.shape[0], keys.dtype, keys.device)
        if self._tensors:
            for name, t in (("keys", keys), ("values", values)):
                old = self._tensors[name]
                if t.shape[1] != old.shape[1] or t.shape[3] != old.shape[3]:
                    raise ValueError(
                        f"new {name} of shape {format_shape(t)} do not fit the cached {name} of shape {format_shape(old)}"
                    )
        total = self._append(module, keys=keys, values=values)
        return total["keys"], total["values"]


class LatentCache(_Cache):
    r"""What multi-head latent attention caches per token: a latent and a RoPE key.

    Attributes:
        latents: ``(B, n, d_c)``, :math:`c_j = x_j W^{DKV}`; ``None`` while empty.
        rope_keys: ``(B, n, d_r)``, :math:`k^R_j = \mathrm{RoPE}(x_j W^{KR}, j)`, shared
            by all heads; ``None`` while empty.

    ``cache.nbytes`` is ``B n (d_c + d_r)`` times the item size. Used by
    :class:`LatentAttention` as :class:`KVCache` is used by ``MultiHeadAttention``, with
    the same rules.
    """

    _names = ("latents", "rope_keys")
    _seq_dim = 1
    _kind = "LatentCache"
    _shapes = {"latents": "(B, t, d_c)", "rope_keys": "(B, t, d_r)"}
    _lead = "(B, t)"

    @property
    def latents(self) -> Tensor | None:
        """``(B, n, d_c)``; ``None`` while empty."""
        return self._get("latents")

    @property
    def rope_keys(self) -> Tensor | None:
        """``(B, n, d_r)``, after RoPE; ``None`` while empty."""
        return self._get("rope_keys")

    def update(self, module: nn.Module, latents: Tensor, rope_keys: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``latents`` ``(B, t, d_c)`` and ``rope_keys`` ``(B, t, d_r)``; return all."""
        self._check_new(latents=latents, rope_keys=rope_keys)
        self.check(module, latents.shape[0], latents.dtype, latents.device)
        total = self._append(module, latents=latents, rope_keys=rope_keys)
        return total["latents"], total["rope_keys"]


def check_cache_call(cache: object, cls: type[_Cache], mask: Tensor | None) -> None:
    """Raise unless ``cache`` is a ``cls`` and no mask came with it."""
    if not isinstance(cache, cls):
        raise TypeError(f"cache must be an attnlib.{cls.__name__} (or None), got {type(cache).__name__}")
    if mask is not None:
        raise ValueError(
            "mask cannot be combined with cache: a call with a cache is causal over the cached "
            "and new positions, and takes no other mask"
        )

