"""``cpgraph serve``: a long-running CP prefill node behind an OpenAI-compatible HTTP API (docs/serve.md).

Needs the ``serve`` extra (``pip install 'cpgraph[serve]'``: aiohttp and
prometheus_client).  :mod:`.protocol` checks requests and builds responses,
:mod:`.metrics` renders ``/metrics``, :mod:`.app` is the server,
:mod:`.node` builds the engine a command line asks for, :mod:`.transfer`
adapts a Mooncake prefill peer to the engine's KV sink.
"""
