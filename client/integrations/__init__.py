"""Plug-ins for the trainers people use: Lightning, Hugging Face ``Trainer`` and Accelerate.

Each framework has its own module, imported only when asked for, so ``from ckptstore import client`` never
imports a framework:

- :mod:`client.integrations.lightning` — ``CkptstoreCheckpointIO`` for ``Trainer(plugins=[...])``,
  ``load_from_checkpoint`` from a ``ckptstore://`` reference;
- :mod:`client.integrations.transformers` — ``CkptstoreCallback`` and ``resume`` for ``Trainer``;
- :mod:`client.integrations.accelerate` — ``save_state`` / ``load_state`` for an ``Accelerator``.

They share :mod:`client.integrations.paths` (``ckptstore://RUN@REF`` and trainer paths as
tags), :mod:`client.integrations.rng` (random number generator state as tensors and JSON) and
:mod:`client.integrations.trees` (a framework's checkpoint dict as a version).

May import the client's public surface (``client``, ``client.api``), the top of ``client``,
``service`` and what :mod:`client.formats` knows of a framework's files (a Lightning
checkpoint's monitored metrics); each framework only inside its own module.
"""
