#!/bin/sh
# Entry point of the hypertrain image: the first argument names what to run.
#
#   aggregator|relay|island ARGS...   exec hypertrain-<daemon> ARGS...
#   torchrun ARGS...                  a multi-rank island: torchrun ... -m hypertrain.island ...
#   hypertrain ARGS...                the CLI (keys init, plan, data prepare, ...)
#   sh|python|python3 ARGS...         a shell or an interpreter (debugging, init containers)
#   relay-key FROM TO RELAY_ARGS...   install this relay shard's keys and certificate (below)
#
# Relay shards (docs/design.md §4.9, deploy/README.md "Relay shards").  When
# HYPERTRAIN_SHARD_INDEX is set (Kubernetes: the StatefulSet pod's ordinal), this process
# is shard i = HYPERTRAIN_SHARD_INDEX of its region's relay, and S is the run's
# topology.relay_shards as the relay itself reads it: --relay-shards in RELAY_ARGS, else
# relay_shards in [run.topology] of their --config, else 1.  Then
#   relay ARGS...      adds --shard=i/S to ARGS when S > 1 (and nothing when S = 1);
#   relay-key FROM TO RELAY_ARGS...
#                      copies into the folder TO this shard's files that
#                      `hypertrain keys init` wrote to FROM: FROM/<name>.key as
#                      TO/signing.key and FROM/<name>.tls.key as TO/tls.key (mode 0400),
#                      FROM/<name>.crt as TO/tls.crt (0444), where the name is
#                      relay-<region> when S = 1, relay-<region>-<i> when S > 1
#                      (<region>: --region in RELAY_ARGS).  The relay then takes
#                      --signing-key TO/signing.key --tls-cert TO/tls.crt --tls-key TO/tls.key.
# Either refuses (exit 2) an index that is no shard of S: i >= S means the StatefulSet
# has more replicas than the run has relay shards.  Without HYPERTRAIN_SHARD_INDEX,
# relay passes ARGS through unchanged.
#
# exec keeps the daemon the direct child of tini, so SIGTERM reaches it.
set -eu
usage() {
    echo "usage: hypertrain-entrypoint {aggregator|relay|island|torchrun|hypertrain|sh|python|relay-key} [ARGS...]"
}
die() {
    echo "hypertrain-entrypoint: $*" >&2
    exit 2
}
# Prints "S REGION" for the relay arguments "$@" (REGION empty without --region).
READ_SHARDS='
import argparse, sys, tomllib
p = argparse.ArgumentParser(add_help=False)
p.add_argument("--config")
p.add_argument("--region", default="")
p.add_argument("--relay-shards", type=int)
p.add_argument("--shard")
a, _ = p.parse_known_args(sys.argv[1:])
if a.shard is not None:
    sys.exit("--shard is set by the entry point from HYPERTRAIN_SHARD_INDEX: do not pass it too")
s = a.relay_shards
if s is None and a.config:
    with open(a.config, "rb") as f:
        s = tomllib.load(f).get("run", {}).get("topology", {}).get("relay_shards")
print(1 if s is None else s, a.region)
'
# Sets index, shards and region for the relay arguments "$@" (see the top of this file).
relay_shard() {
    index=${HYPERTRAIN_SHARD_INDEX-}
    case $index in
        '' | *[!0-9]*) die "HYPERTRAIN_SHARD_INDEX must be a shard index (the pod's ordinal), got '$index'" ;;
    esac
    out=$(python3 -c "$READ_SHARDS" "$@") || die "cannot tell the run's relay_shards from the relay's arguments"
    shards=${out%% *}
    region=${out#* }
    case $shards in
        '' | *[!0-9]* | 0) die "relay_shards must be a positive integer, got '$shards'" ;;
    esac
    if [ "$index" -ge "$shards" ]; then
        die "relay shard index $index, but the run has relay_shards = $shards: run exactly relay_shards relays per region (Kubernetes: the StatefulSet's replicas)"
    fi
}
if [ "$#" -eq 0 ]; then
    usage >&2
    exit 2
fi
cmd=$1
shift
case "$cmd" in
    relay)
        if [ -n "${HYPERTRAIN_SHARD_INDEX+set}" ]; then
            relay_shard "$@"
            if [ "$shards" -gt 1 ]; then
                set -- "$@" "--shard=$index/$shards"
            fi
        fi
        exec hypertrain-relay "$@"
        ;;
    relay-key)
        [ "$#" -ge 2 ] || die "usage: relay-key FROM_DIR TO_DIR RELAY_ARGS..."
        from=$1
        to=$2
        shift 2
        relay_shard "$@"
        [ -n "$region" ] || die "relay-key: --region REGION is required"
        if [ "$shards" -gt 1 ]; then name="relay-$region-$index"; else name="relay-$region"; fi
        for file in "$name.key" "$name.tls.key" "$name.crt"; do
            [ -e "$from/$file" ] || die "relay-key: no $file in $from (the region's key Secret must hold every shard's signing key, TLS key and certificate, named as \`hypertrain keys init\` names them)"
        done
        [ -d "$to" ] || die "relay-key: $to is not a folder"
        install -m 0400 "$from/$name.key" "$to/signing.key"
        install -m 0400 "$from/$name.tls.key" "$to/tls.key"
        exec install -m 0444 "$from/$name.crt" "$to/tls.crt"
        ;;
    aggregator|island) exec "hypertrain-$cmd" "$@" ;;
    torchrun|hypertrain|sh|python|python3) exec "$cmd" "$@" ;;
    -h|--help|help) usage; exit 0 ;;
    *)
        echo "hypertrain-entrypoint: unknown command '$cmd'" >&2
        usage >&2
        exit 2
        ;;
esac
