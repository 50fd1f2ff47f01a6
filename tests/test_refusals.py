"""Refusal by type: every tool written for the plain layer of chapters 2-4, on every attention
class attnlib has, and on a subclass that has not said what it computes.

A tool asks the module for its plain view (``as_plain()``, through
:func:`attnlib.multihead.plain_view`); a record of a layer's weights is asked the same
(``AttentionWeights.as_plain()``). A layer the plain layer cannot compute is refused with a
message naming what it adds (RoPE, ALiBi, latent attention), never read with it dropped;
a layer the plain layer can compute (grouped keys and values) is read with its groups
written out, and computes the same function.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import attnlib
from attnlib import LatentAttention, MultiHeadAttention, SeparateHeadsAttention, composition_scores, head_explorer
from attnlib.decoding import AlibiAttention, AlibiWeights, DecoderAttention, causal_mask
from attnlib.interop import (
    read_bloom,
    write_bert,
    write_bloom,
    write_conv1d,
    write_linear_heads,
    write_packed_linear,
    write_separate_linear,
    write_torch_mha,
)
from attnlib.lowrank import ov_circuit, qk_circuit

F64 = torch.float64
D, H = 8, 2  # every subject: d_model = 8, two heads


class Shifted(MultiHeadAttention):
    """The next subclass: it changes what the layer computes and says nothing about it."""

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        out, weights = super().forward(*args, **kwargs)
        return out + 1.0, weights


# name -> (build, None if the plain layer can compute it, else (exception, what the message names))
SUBJECTS: dict[str, tuple[Callable[[], nn.Module], tuple[type[Exception], str] | None]] = {
    "MultiHeadAttention": (lambda: MultiHeadAttention(D, H, dtype=F64), None),
    "SeparateHeadsAttention": (lambda: SeparateHeadsAttention(D, H, dtype=F64), None),
    "DecoderAttention, grouped": (lambda: DecoderAttention(D, H, num_kv_heads=1, dtype=F64), None),
    "DecoderAttention, RoPE": (lambda: DecoderAttention(D, H, rope_base=100.0, dtype=F64),
                               (ValueError, r"DecoderAttention with RoPE \(rope_base=100\) has no plain view: RoPE rotates")),
    "AlibiAttention": (lambda: AlibiAttention(D, H, dtype=F64),
                       (TypeError, r"AlibiAttention has no plain view: ALiBi adds the position bias")),
    "LatentAttention": (lambda: LatentAttention(D, H, 4, 2, dtype=F64),
                        (TypeError, r"LatentAttention has no plain view: multi-head latent attention \(MLA\)")),
    "a subclass without as_plain": (lambda: Shifted(D, H, dtype=F64),
                                    (TypeError, r"cannot read Shifted: it inherits as_plain\(\).*define Shifted.as_plain\(\)")),
}

X = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0), dtype=F64)  # (B, n, d_model)
MASK = causal_mask(5)


def _plain() -> MultiHeadAttention:
    return MultiHeadAttention(D, H, dtype=F64)


def _output(m: nn.Module) -> Tensor:
    return m(X, X, X, mask=MASK)[0]  # (B, n, d_model)


def _check_function(tool_result: object, m: nn.Module) -> None:
    """An accepted layer: a module the tool built computes ``m``'s function."""
    if isinstance(tool_result, nn.MultiheadAttention):
        out = tool_result(X, X, X, attn_mask=~MASK, need_weights=False)[0]
        torch.testing.assert_close(out, _output(m))
    elif isinstance(tool_result, nn.Module):
        torch.testing.assert_close(_output(tool_result), _output(m))


# tool name -> (the tool on a module, the tool's name in its message)
TOOLS: dict[str, tuple[Callable[[nn.Module], object], str]] = {
    "SeparateHeadsAttention.from_fused": (SeparateHeadsAttention.from_fused, "SeparateHeadsAttention.from_fused"),  # type: ignore[dict-item]
    "to_torch": (lambda m: MultiHeadAttention.to_torch(m), "to_torch"),  # type: ignore[arg-type]
    "qk_circuit": (qk_circuit, "qk_circuit"),  # type: ignore[dict-item]
    "ov_circuit": (lambda m: ov_circuit(m, 1), "ov_circuit"),  # type: ignore[arg-type]
    "composition_scores, layer 0": (lambda m: composition_scores(m, _plain(), "K"), "composition_scores"),  # type: ignore[arg-type]
    "composition_scores, layer 1": (lambda m: composition_scores(_plain(), m, "Q"), "composition_scores"),  # type: ignore[arg-type]
    "head_explorer": (lambda m: head_explorer([m], [X], [list("abcde"), list("abc")]), "head_explorer"),  # type: ignore[list-item]
    "as_plain": (lambda m: attnlib.multihead.plain_view(m, "m", "a tool"), "a tool"),
}


NO_METHOD = {("SeparateHeadsAttention", "to_torch"), ("LatentAttention", "to_torch")}  # no such method


@pytest.mark.parametrize(("subject", "tool"), sorted(
    (s, t) for s in SUBJECTS for t in TOOLS if (s, t) not in NO_METHOD))
def test_every_tool_refuses_what_the_plain_layer_cannot_compute(subject: str, tool: str) -> None:
    build, refusal = SUBJECTS[subject]
    call, user = TOOLS[tool]
    torch.manual_seed(0)
    m = build()
    if refusal is None:
        if tool == "head_explorer":  # it draws a figure: one accepted case, checked against the plain view
            if subject == "DecoderAttention, grouped":
                assert call(m).data == call(m.as_plain()).data  # type: ignore[attr-defined]
            return
        _check_function(call(m), m)
        return
    error, names = refusal
    with pytest.raises(error, match=f"^{user}: .*{names}|{names}"):
        call(m)


def _records() -> dict[str, Callable[[], object]]:
    """The records the layers give, by how they were taken."""
    torch.manual_seed(0)
    return {
        "AlibiAttention.projections()": lambda: AlibiAttention(D, H, dtype=F64).projections(),
        "DecoderAttention(RoPE).projections()": lambda: DecoderAttention(D, H, rope_base=100.0).projections(),
        "DecoderAttention(grouped).projections()": lambda: DecoderAttention(D, H, num_kv_heads=1).projections(),
        "AlibiAttention.grouped_projections()": lambda: AlibiAttention(D, H, dtype=F64).grouped_projections(),
    }


# a tool that takes a record of the plain layer's weights
RECORD_TOOLS: dict[str, Callable[[Any], object]] = {
    "MultiHeadAttention.from_projections": lambda w: MultiHeadAttention.from_projections(w, H),
    "MultiHeadAttention.from_weights (its name before the rename)": lambda w: MultiHeadAttention.from_weights(w, H),
    "DecoderAttention.from_projections": lambda w: DecoderAttention.from_projections(w, H),
    "write_torch_mha": lambda w: write_torch_mha(w, H),
    "write_separate_linear": write_separate_linear,
    "write_packed_linear": write_packed_linear,
    "write_conv1d": write_conv1d,
    "write_bert": write_bert,
    "write_linear_heads": lambda w: write_linear_heads(w, H),
}

RECORD_REFUSALS = {  # how each record is refused, before or by the tool
    "AlibiAttention.projections()": (TypeError, r"these weights are an AlibiAttention's \(AlibiWeights\): ALiBi adds"),
    "DecoderAttention(RoPE).projections()": (ValueError, r"projections\(\) is the plain layer's record.*rope_base=100"),
    "DecoderAttention(grouped).projections()": (ValueError, r"num_kv_heads=1, num_heads=2.*use grouped_projections\(\)"),
    "AlibiAttention.grouped_projections()": (TypeError, r"AlibiAttention has no grouped_projections\(\).*not ALiBi"),
}


@pytest.mark.parametrize("tool", sorted(RECORD_TOOLS))
@pytest.mark.parametrize("record", sorted(RECORD_REFUSALS))
def test_no_record_loses_what_its_layer_adds(record: str, tool: str) -> None:
    """The weights taken from a layer with more than weights never reach a plain tool."""
    error, names = RECORD_REFUSALS[record]
    with pytest.raises(error, match=names):
        RECORD_TOOLS[tool](_records()[record]())


def test_alibi_records_go_where_alibi_is() -> None:
    """AlibiWeights rebuild the ALiBi layer and write BLOOM's layout (BLOOM has ALiBi); dropping
    ALiBi is possible, and said: without_alibi()."""
    torch.manual_seed(0)
    al = AlibiAttention(D, H, dtype=F64)
    w = al.projections()
    assert isinstance(w, AlibiWeights)
    again = AlibiAttention.from_projections(w, H)
    torch.testing.assert_close(_output(again), _output(al), atol=0, rtol=0)
    back = AlibiAttention.from_projections(read_bloom(write_bloom(w, H), num_heads=H), H)
    torch.testing.assert_close(_output(back), _output(al), atol=0, rtol=0)
    plain = MultiHeadAttention.from_projections(w.without_alibi(), H)
    assert type(plain) is MultiHeadAttention and not torch.allclose(_output(plain), _output(al))


def test_the_issues_reproductions_are_refused_naming_alibi() -> None:
    """The calls of issue 29, at its sizes: each one read ALiBi's layer as the plain layer."""
    torch.manual_seed(0)
    al = AlibiAttention(64, 8)
    x = torch.randn(1, 16, 64)
    calls: list[Callable[[], object]] = [
        lambda: MultiHeadAttention.from_weights(al.projections(), 8),
        lambda: SeparateHeadsAttention.from_fused(al),
        lambda: MultiHeadAttention.from_weights(al.grouped_weights(), 2),  # type: ignore[arg-type]
        lambda: al.to_torch(),
        lambda: qk_circuit(al),
        lambda: composition_scores(al, al, "K"),
        lambda: head_explorer([al], [x], [list("abcd")]),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="ALiBi"):
            call()


def _attnlib_modules() -> set[type]:
    found = set()
    for info in pkgutil.walk_packages(attnlib.__path__, "attnlib."):
        for _, cls in inspect.getmembers(importlib.import_module(info.name), inspect.isclass):
            if cls.__module__.startswith("attnlib") and issubclass(cls, nn.Module):
                found.add(cls)
    return found


def test_every_attention_class_of_attnlib_is_a_subject() -> None:
    """A new attention class (or subclass) joins the table above; any other module of attnlib
    (a trained model) has no plain view, so every tool refuses it by type."""
    covered = {type(build()) for build, _ in SUBJECTS.values()} - {Shifted}
    for cls in _attnlib_modules():
        if issubclass(cls, MultiHeadAttention) or cls.__name__.endswith("Attention") or hasattr(cls, "as_plain"):
            assert cls in covered, f"{cls.__qualname__} is an attention class: add it to SUBJECTS"
        else:
            assert not hasattr(cls, "as_plain"), cls
    with pytest.raises(TypeError, match="mha must be an attnlib.MultiHeadAttention, got Linear"):
        qk_circuit(nn.Linear(D, D))  # type: ignore[arg-type]
