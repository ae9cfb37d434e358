"""The HTTP transport: a server reached through the same protocol as the embedded store.

- :mod:`.route`: the API's paths and their errors; :mod:`.retry`: what is retried and for how long;
- :mod:`.errors`: server errors mapped back to the one error tree (``X-Error-Code``);
- :mod:`.session`: one httpx session with its proxies, TLS and timeouts;
- :mod:`.bulk`: shard uploads and range batches;
- :mod:`.transport`: the :class:`~client.http.transport.HttpTransport` built on them.

Torch-free: may import httpx and ``service`` (errors, format, records) only; never torch or
another package of ``client``.
"""
