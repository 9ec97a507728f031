#!/bin/sh
# Entry point of the hypertrain image: the first argument names what to run.
#
#   aggregator|relay|island ARGS...   exec hypertrain-<daemon> ARGS...
#   torchrun ARGS...                  a multi-rank island: torchrun ... -m hypertrain.island ...
#   hypertrain ARGS...                the CLI (keys init, plan, data prepare, ...)
#   sh|python|python3 ARGS...         a shell or an interpreter (debugging, init containers)
#
# exec keeps the daemon the direct child of tini, so SIGTERM reaches it.
set -eu
usage() {
    echo "usage: hypertrain-entrypoint {aggregator|relay|island|torchrun|hypertrain|sh|python} [ARGS...]"
}
if [ "$#" -eq 0 ]; then
    usage >&2
    exit 2
fi
cmd=$1
shift
case "$cmd" in
    aggregator|relay|island) exec "hypertrain-$cmd" "$@" ;;
    torchrun|hypertrain|sh|python|python3) exec "$cmd" "$@" ;;
    -h|--help|help) usage; exit 0 ;;
    *)
        echo "hypertrain-entrypoint: unknown command '$cmd'" >&2
        usage >&2
        exit 2
        ;;
esac
