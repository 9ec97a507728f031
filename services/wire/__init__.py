"""hypertrain.wire: the gRPC transport shared by the island, relay and aggregator daemons.

Modules:
    chunks      bounded-chunk streaming of deltas and merges, with verification
    frames      zero-copy (de)serializers for the chunk messages
    spool       the receive side's workers: hash, copy, spool to disk, publish
    tensorhash  tensor_digest computed while a merge arrives
    server      daemon bootstrap: server options, servicer registration, bind/announce,
                run until signalled, status mapping of exceptions
    client      connect, stubs with the chunk codec, push/fetch helpers, retries
    options     the gRPC channel arguments both ends use
    errors      WireError and the one exception -> status table
"""
