r"""The factored product behind every head: :math:`W_i^{QK}` and :math:`W_i^{OV}` (chapter 4).

A head's scores use :math:`W_i^Q` and :math:`W_i^K` only through their product,

.. math::
    (X W_i^Q)(X W_i^K)^\top = X\, W_i^{QK} X^\top, \qquad
    W_i^{QK} = W_i^Q {W_i^K}^\top \in \mathbb{R}^{d_{model} \times d_{model}},

and what it writes uses :math:`W_i^V` and :math:`W_i^O` only through
:math:`W_i^{OV} = W_i^V W_i^O` (Elhage et al., 2021). Both are products of a tall and a
wide factor, so their rank is at most :math:`d_k` (or :math:`d_v`).

:class:`FactoredMatrix` is the home for such a product ``M = left @ right``: it keeps
the two factors and answers questions about ``M`` (its SVD, rank, stable rank,
parameter and FLOP counts) without forming the ``m x n`` matrix unless asked.
:func:`qk_circuit` and :func:`ov_circuit` build it from a
:class:`~attnlib.multihead.MultiHeadAttention`.

The package's modules: :mod:`~attnlib.lowrank.factored` (:class:`FactoredMatrix` and
:class:`FlopCount`), :mod:`~attnlib.lowrank.signs` (:func:`fix_signs`) and
:mod:`~attnlib.lowrank.circuits` (:func:`qk_circuit`, :func:`ov_circuit`); every name is
importable from ``attnlib.lowrank``.

Orientation as everywhere in attnlib: row vectors, ``x @ M``.
"""

from attnlib.lowrank.circuits import ov_circuit, qk_circuit
from attnlib.lowrank.factored import FactoredMatrix, FlopCount
from attnlib.lowrank.signs import fix_signs

__all__ = ["FactoredMatrix", "FlopCount", "qk_circuit", "ov_circuit", "fix_signs"]
