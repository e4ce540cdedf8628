"""Built-in tokenizer sources for the ``kv_index`` tier: ``replica``, a replica's own ``/tokenize``.

A tokenizer source is built by ``factory(options)`` with the model's
``routing_options`` and answers ``await source.tokenize(replica, body)`` with
the prompt token ids, where ``body`` is the ``/tokenize`` JSON (bytes) that
:func:`llmgw.kv.tokenize.plan` built for the request. It raises
:class:`llmgw.kv.tokenize.TokenizeError` (kind ``timeout`` when too slow).
"""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..kv.tokenize import TokenizeClient


@hookimpl
def register_tokenizer_sources():
    return {"replica": TokenizeClient}
