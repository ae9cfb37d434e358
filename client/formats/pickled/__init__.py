"""The one reader of pickled bytes: an allow-list interpreter of pickles.

- :mod:`.reader`: runs a pickle (protocols 0-5), calling nothing but the constructors it is
  handed, bounded while it reads (bytes, objects, memo, keys);
- :mod:`.allowlist`: what a pickle may name (:class:`~.allowlist.Global`), the limits, plain
  records for foreign classes, and how a value is shown in a message without formatting it;
- :mod:`.tree`: the value measured as a tree (size and depth) before anything walks it.

May import the standard library and ``ckptstore.service.errors`` only: no torch, nothing else of
the client.
"""
