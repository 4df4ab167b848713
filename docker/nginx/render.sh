#!/bin/sh
# Fills docker/nginx/nginx.conf.template for any number of replicas and writes the nginx
# configuration to stdout (docs/operations.md, "Load balancing"). POSIX sh, awk and envsubst
# (Debian's gettext-base; the nginx images have all three), so the same script runs on a host,
# in the nginx container (docker/compose.yaml) and in tests/support/nginx.py.
#
#   REPLICAS="host:port host:port ..."   each replica's HTTP address (required)
#   REPLICAS_GRPC="host:port ..."        each replica's gRPC address, in the same order
#                                        (default: each REPLICAS host on port 50051)
#   LISTEN_HTTP, LISTEN_GRPC             what nginx listens on (default 8080, 50051)
#   BALANCE                              least_conn (default), or "hash $affinity consistent"
#   MAX_BODY_BYTES                       the replicas' --max-body-bytes (default 1048576)
#   TEMPLATE                             the template (default: nginx.conf.template beside this script)
#
# A template line (not a comment) holding ${REPLICA} (or ${REPLICA_GRPC}) is written once per
# replica. Only the template's own upper-case variables are substituted (envsubst with an
# explicit list, as the nginx image's entrypoint substitutes only defined variables): plain
# `envsubst` would also blank nginx's $variables ($binary_remote_addr, $host, ...).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
: "${TEMPLATE:=$here/nginx.conf.template}"
: "${REPLICAS:=}"
: "${LISTEN_HTTP:=8080}" "${LISTEN_GRPC:=50051}" "${BALANCE:=least_conn}" "${MAX_BODY_BYTES:=1048576}"
if [ -z "${REPLICAS_GRPC:-}" ]; then
  REPLICAS_GRPC=""
  for r in $REPLICAS; do REPLICAS_GRPC="$REPLICAS_GRPC ${r%:*}:50051"; done
fi
[ -r "$TEMPLATE" ] || { echo "render.sh: cannot read the template $TEMPLATE" >&2; exit 1; }
set -- $REPLICAS
http_count=$#
if [ "$http_count" = 0 ]; then
  echo "render.sh: REPLICAS names no replica; set it to their HTTP addresses, e.g." \
    "REPLICAS=\"127.0.0.1:8081 127.0.0.1:8082\"" >&2
  exit 1
fi
set -- $REPLICAS_GRPC
if [ "$#" != "$http_count" ]; then
  echo "render.sh: REPLICAS has $http_count addresses but REPLICAS_GRPC has $#" >&2
  exit 1
fi
export LISTEN_HTTP LISTEN_GRPC BALANCE MAX_BODY_BYTES
# awk -v would interpret backslashes in the values; ENVIRON does not.
export REPLICAS REPLICAS_GRPC
awk '
  function each(line, name, list,    n, a, i, out, at) {
    n = split(list, a, /[ \t\n]+/)
    for (i = 1; i <= n; i++) {
      if (a[i] == "") continue
      out = line
      at = index(out, name)
      print substr(out, 1, at - 1) a[i] substr(out, at + length(name))
    }
  }
  /^[ \t]*#/                   { print; next }  # comments as they are
  index($0, "${REPLICA_GRPC}") { each($0, "${REPLICA_GRPC}", ENVIRON["REPLICAS_GRPC"]); next }
  index($0, "${REPLICA}")      { each($0, "${REPLICA}", ENVIRON["REPLICAS"]); next }
  { print }
' "$TEMPLATE" | envsubst '${LISTEN_HTTP} ${LISTEN_GRPC} ${BALANCE} ${MAX_BODY_BYTES}'
