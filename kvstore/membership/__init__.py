"""Several routers and store servers on etcd: membership, liveness, admission.

Without ``--etcd`` nothing here runs: one router (embedded in ``kvstore serve``
or ``kvstore router``) holds every decision, as before. With it, etcd holds
the small, strongly consistent part every process must agree on; block
events keep flowing from each store to each router replica over gRPC.

Keys (``layout.py``), under ``/kvstore/v1/`` unless ``--etcd-prefix`` says
otherwise, every path component percent-encoded, values msgpack maps:

    stores/<node id>         {"store": host:port, "ucx": host:port,
                              "owner": CN of its first publisher}     the store's lease
    routers/<address>        {"address": host:port}                   the replica's lease
    workers/<worker>         {"set": [model, namespace, role], "owner"}  the worker's lease
    worksets/<model>/<namespace>/<role>/card
                             {"checksum", "hash_format", "card"}      no lease
    worksets/<model>/<namespace>/<role>/members/<worker>
                             {"card": {...}, "owner": CN}             the worker's lease

Leases have a TTL of ``--etcd-ttl`` (10 s) and are kept alive every TTL / 3
from a thread with its own event loop, so a busy loop cannot starve them. A
store's generation is its key's create revision, a worker's the revision of
the transaction that admitted it: etcd revisions, so every replica agrees.
A store's key is one store's: another store address holding it live refuses
a registration (ALREADY_EXISTS, retried until that lease lapses); the same
address (a restart) replaces it at once.

Modules, one concept each:

    etcd.py       the client (aetcd; TLS to etcd), compares and operations; errors are UNAVAILABLE
    layout.py     the keys and their records
    keeper.py     LeaseKeeper: a process's leases refreshed from a thread of its own
    lease.py      KeyLease: keys under one lease, registered again when lost
    relayed.py    RelayedWorkers: a store's relayed workers; re-admitted -> snapshot again
    directory.py  Directory: one prefix listed, watched, listed again after an outage
    worksets.py   first-wins admission, removal and dissolution as transactions (owner checked)
    claims.py     StoreClaims: a store node id's first publisher, recorded in its value
    mirror.py     etcd's stores and workers applied to a router replica's core
    replica.py    RouterReplica: a router on etcd (registration, mirrors, held workers)

This room imports only ``kvstore.wire`` and aetcd, and grpc in ``etcd.py`` for
the TLS channel to etcd (``make lint`` checks it); the service edges and the CLI
use it. Design and limits: README.md here.
"""

from kvstore.membership.etcd import EtcdConfig, EtcdTls

__all__ = ["EtcdConfig", "EtcdTls"]
