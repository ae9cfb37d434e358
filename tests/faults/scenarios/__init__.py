"""Fault scenarios run against real parts, small in CI and larger from bench/faults.py.

Each scenario module has one ``run(workdir, seed, scale)`` returning a
:class:`~tests.faults.scenarios.record.ScenarioResult`; :mod:`.runner` names them all:

    database     a private PostgreSQL cluster stopped and started under saving clients
    s3-link      the server's link to S3 (moto behind a TCP gate) cut and restored
    worker-kill  the server process SIGKILLed mid-save and restarted; clients retry
    client-kill  saving client processes SIGKILLed at seeded moments
    disk-full    an embedded store on a small tmpfs saved into until it is full
    bit-flips    seeded bit flips in shard blobs and in the SQLite metadata file
    gc-loop      garbage collection at grace 0 in a loop beside saving clients

Pieces: :mod:`.record` (what a scenario counted), :mod:`.savers` (saving clients and the
states they save), :mod:`.checks` (what the store holds afterwards).
"""
