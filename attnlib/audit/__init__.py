r"""Is my attention right? Check your own multi-head attention, and name its bug (chapter 9).

:func:`diagnose` runs your ``forward`` and an :class:`~attnlib.MultiHeadAttention` holding the
same weights on the same probe inputs and compares the outputs,

.. math::
    \mathrm{error} = \max_{\text{probes}} \frac{\max_{b,i,c} |y_{bic} - r_{bic}|}{\max_{b,i,c} |r_{bic}|},

with :math:`y` your output and :math:`r` the reference's. When they disagree it rebuilds
the layer with each bug of :data:`BUGS` planted, and with every pair of them, from the
reference's weights and attnlib's own pieces, and reports the bugs whose outputs match yours.

Call forms: self-attention ``forward(x, mask)`` with a bool ``(n, n)`` mask (True = may
attend) or None; ``takes_mask=False`` for ``forward(x)``; ``causal=True`` for a module that masks the future itself; ``padding=True``
for a ``(B, n_k)`` key-padding mask (True = real token); ``cross=True`` for
``forward(x, context, mask)``. The reference may have grouped keys/values (``num_kv_heads``)
and RoPE (``rope_base``). :func:`diagnose_cache` checks incremental decoding with a KV cache.

A bug is one entry of the catalogue: a name, a description, the line to look for, the fix, the
steps of the computation it changes (fields of :class:`Recipe`) and, for some, a note on where
else the fix may belong (an adapter, the loading code).

The package: :mod:`~attnlib.audit.catalogue` (the bugs), :mod:`~attnlib.audit.checks` (the
argument checks and the error measure), :mod:`~attnlib.audit.engine` (the layer built from a
recipe; :func:`planted`), :mod:`~attnlib.audit.probes`, :mod:`~attnlib.audit.report`,
:mod:`~attnlib.audit.matcher` (does a recipe reproduce your outputs?),
:mod:`~attnlib.audit.search` (:func:`diagnose`, :func:`assert_attention_matches`) and
:mod:`~attnlib.audit.cache` (:func:`diagnose_cache`, :func:`assert_cache_matches`).
"""

from attnlib.audit.cache import CACHE_BUGS, Step, assert_cache_matches, diagnose_cache
from attnlib.audit.catalogue import BUGS, BUGS_BY_NAME, PAIRS, Bug, Recipe
from attnlib.audit.engine import CONVENTIONS, Forward, planted
from attnlib.audit.probes import LARGE_SCORES, probe_inputs
from attnlib.audit.report import PADDED_ROWS, AuditReport
from attnlib.audit.search import assert_attention_matches, diagnose

__all__ = [
    "BUGS", "BUGS_BY_NAME", "PAIRS", "CACHE_BUGS", "CONVENTIONS", "PADDED_ROWS", "Step", "LARGE_SCORES", "Bug",
    "Recipe", "AuditReport", "Forward", "assert_attention_matches", "assert_cache_matches", "diagnose",
    "diagnose_cache", "planted", "probe_inputs",
]
