"""attnlib.decoding.cache on hand-sized tensors: what ``KVCache.update`` and
``LatentCache.update`` return, what the cache then reports (length, bytes, batch, dtype,
device, repr), the byte counts per token, and each refusal with its exception class.
Written to kill what mutation testing (``make mutants``) found unchecked."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from attnlib.decoding.cache import (
    KVCache,
    LatentCache,
    check_cache_call,
    kv_cache_bytes_per_token,
    latent_cache_bytes_per_token,
)


def _kv(b: int, g: int, t: int, d: int, start: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(b * g * t * d, dtype=dtype) + start).reshape(b, g, t, d)


def test_bytes_per_token() -> None:
    assert kv_cache_bytes_per_token(4, 8) == 4 * 16 * 4
    assert kv_cache_bytes_per_token(2, 8, 3, dtype=torch.float64) == 2 * 11 * 8
    assert kv_cache_bytes_per_token(1, 2, dtype=torch.bfloat16) == 1 * 4 * 2
    assert latent_cache_bytes_per_token(5, 3) == 8 * 4
    assert latent_cache_bytes_per_token(5, 0, torch.float16) == 5 * 2
    assert kv_cache_bytes_per_token(1, 1, dtype=torch.int8) == 2 and latent_cache_bytes_per_token(1, 1, torch.int8) == 2
    with pytest.raises(TypeError, match="dtype must be a torch.dtype, got str 'float32'"):
        kv_cache_bytes_per_token(1, 2, dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype must be a torch.dtype, got str 'float32'"):
        latent_cache_bytes_per_token(1, 2, "float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        kv_cache_bytes_per_token(0, 8)
    with pytest.raises(ValueError):
        kv_cache_bytes_per_token(2, 8, 0)
    with pytest.raises(ValueError):
        latent_cache_bytes_per_token(0, 1)
    with pytest.raises(ValueError):
        latent_cache_bytes_per_token(4, -1)


def test_kv_cache_update_returns_everything_cached() -> None:
    layer, cache = nn.Linear(1, 1), KVCache()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.keys is None and cache.values is None
    assert cache.batch_size is None and cache.dtype is None and cache.device is None
    assert repr(cache) == "KVCache(empty)"
    k1, v1 = _kv(1, 2, 3, 4), _kv(1, 2, 3, 4, 100.0)
    keys, values = cache.update(layer, k1, v1)
    assert torch.equal(keys, k1) and torch.equal(values, v1)
    assert keys.data_ptr() != k1.data_ptr()  # a copy, not the caller's tensor
    k2, v2 = _kv(1, 2, 1, 4, -50.0), _kv(1, 2, 1, 4, 500.0)
    keys, values = cache.update(layer, k2, v2)
    assert torch.equal(keys, torch.cat([k1, k2], dim=2)) and torch.equal(values, torch.cat([v1, v2], dim=2))
    assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)
    assert len(cache) == 4 and cache.batch_size == 1 and cache.dtype == torch.float32
    assert cache.device == torch.device("cpu")
    assert cache.nbytes == 2 * 1 * 2 * 4 * 4 * 4
    assert repr(cache) == "KVCache(len=4, keys=(1, 2, 4, 4), values=(1, 2, 4, 4), dtype=torch.float32)"
    cache.clear()
    assert len(cache) == 0 and cache.keys is None
    cache.update(nn.Linear(1, 1), k1, v1)  # cleared: another module may fill it


def test_a_view_is_cached_as_a_compact_copy() -> None:
    packed = _kv(1, 2, 3, 8)
    k, v = packed[..., :4], packed[..., 4:]  # views of one packed projection
    keys, values = KVCache().update(nn.Linear(1, 1), k, v)
    assert keys.is_contiguous() and values.is_contiguous()
    assert torch.equal(keys, k) and torch.equal(values, v)
    # a dense view in another order (a transpose) is made contiguous too, not copied stride for stride
    t = _kv(1, 2, 8, 3).transpose(-1, -2)  # (1, 2, 3, 8), strides of (1, 2, 8, 3)
    keys, values = KVCache().update(nn.Linear(1, 1), t, t)
    assert keys.is_contiguous() and values.is_contiguous() and torch.equal(keys, t)


def test_kv_cache_refusals() -> None:
    layer, cache = nn.Linear(1, 1), KVCache()
    k, v = _kv(2, 2, 3, 4), _kv(2, 2, 3, 4)
    cache.update(layer, k, v)
    bad = [
        ((nn.Linear(1, 1), k, v), "holds the keys of another module"),
        ((layer, _kv(1, 2, 1, 4), _kv(1, 2, 1, 4)), "batch size 1 does not match the KVCache's batch size 2"),
        ((layer, _kv(2, 2, 1, 4, dtype=torch.float64), _kv(2, 2, 1, 4, dtype=torch.float64)), "dtype torch.float64"),
        ((layer, _kv(2, 1, 1, 4), _kv(2, 1, 1, 4)), r"new keys of shape \(2, 1, 1, 4\) do not fit the cached keys"),
        ((layer, _kv(2, 2, 1, 4), _kv(2, 2, 1, 3)), r"new values of shape \(2, 2, 1, 3\) do not fit the cached values"),
        ((layer, _kv(2, 2, 1, 4)[0], _kv(2, 2, 1, 4)), r"keys must have shape \(B, g, t, d_k\), got \(2, 1, 4\)"),
        ((layer, _kv(2, 2, 1, 4), _kv(2, 2, 1, 4)[0]), r"values must have shape \(B, g, t, d_v\)"),
        ((layer, _kv(2, 2, 1, 4), _kv(2, 2, 2, 4)), r"must have the same \(B, g, t\)"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            cache.update(*args)
    assert len(cache) == 3  # nothing was appended by a refused call
    with pytest.raises(TypeError, match="keys must be a torch.Tensor"):
        cache.update(layer, [0.0], v)  # type: ignore[arg-type]
    cache.check(layer, 2, None, torch.device("cpu"))  # dtype None: not checked
    with pytest.raises(ValueError, match="device meta does not match the KVCache's device cpu"):
        cache.check(layer, 2, torch.float32, torch.device("meta"))


def test_a_cache_whose_module_is_gone_is_refused() -> None:
    cache = KVCache()
    layer = nn.Linear(1, 1)
    cache.update(layer, _kv(1, 1, 1, 2), _kv(1, 1, 1, 2))
    del layer
    gc.collect()
    with pytest.raises(ValueError, match="filled by a module that no longer exists"):
        cache.update(nn.Linear(1, 1), _kv(1, 1, 1, 2), _kv(1, 1, 1, 2))


def test_latent_cache_update_returns_everything_cached() -> None:
    layer, cache = nn.Linear(1, 1), LatentCache()
    c1, r1 = torch.arange(6.0).reshape(1, 2, 3), torch.arange(4.0).reshape(1, 2, 2)
    c2, r2 = -torch.ones(1, 1, 3), -torch.ones(1, 1, 2)
    lat, rk = cache.update(layer, c1, r1)
    assert torch.equal(lat, c1) and torch.equal(rk, r1)
    lat, rk = cache.update(layer, c2, r2)
    assert torch.equal(lat, torch.cat([c1, c2], 1)) and torch.equal(rk, torch.cat([r1, r2], 1))
    assert torch.equal(cache.latents, lat) and torch.equal(cache.rope_keys, rk)
    assert len(cache) == 3 and cache.nbytes == 3 * (3 + 2) * 4
    assert repr(cache) == "LatentCache(len=3, latents=(1, 3, 3), rope_keys=(1, 3, 2), dtype=torch.float32)"
    with pytest.raises(ValueError, match=r"latents must have shape \(B, t, d_c\)"):
        cache.update(layer, c2[0], r2)
    with pytest.raises(ValueError, match=r"must have the same \(B, t\)"):
        cache.update(layer, c2, torch.ones(1, 2, 2))


def test_check_cache_call() -> None:
    assert check_cache_call(KVCache(), KVCache, None) is None
    with pytest.raises(TypeError, match="cache must be an attnlib.KVCache .* got LatentCache"):
        check_cache_call(LatentCache(), KVCache, None)
    with pytest.raises(ValueError, match="mask cannot be combined with cache"):
        check_cache_call(KVCache(), KVCache, torch.ones(1, dtype=torch.bool))
