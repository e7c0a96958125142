#!/usr/bin/env bash
# A Redis config for a run across hosts, on stdout: ops/redis.conf (AOF fsynced on every write,
# noeviction) bound to an address the other hosts route to, with the ACL of ops/redis-acl.conf and a
# password: the rollstream user, which sees only rollstream:* keys and runs only the transport's commands;
# the passwordless default user off (docs/security.md).
#
#   REDIS_PASSWORD=$(openssl rand -hex 32) ops/launch/redis-conf.sh BIND_ADDRESS [PORT [DIR]] > redis.conf
#   redis-server redis.conf        # workers: transport.url = "redis://rollstream:PASSWORD@HOST:PORT/0"
#
# TLS: REDIS_TLS_CERT, REDIS_TLS_KEY and REDIS_TLS_CA (files) serve TLS only, on PORT; the workers then use
# rediss://rollstream:PASSWORD@HOST:PORT/0?ssl_ca_certs=CA, HOST a name the certificate carries.
# The file holds the password: write it where only Redis's user reads it (umask 077).
set -euo pipefail

ops=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bind=${1:?usage: REDIS_PASSWORD=... $0 BIND_ADDRESS [PORT [DIR]]}
port=${2:-6379}
dir=${3:-/var/lib/rollstream-redis}
password=${REDIS_PASSWORD:?set REDIS_PASSWORD, e.g. REDIS_PASSWORD=\$(openssl rand -hex 32)}

# The password goes into the workers' redis:// URL as it is, so only characters a URL carries unescaped.
if [[ ! $password =~ ^[A-Za-z0-9._~-]{16,}$ ]]; then
    echo "REDIS_PASSWORD: give at least 16 of A-Z a-z 0-9 . _ ~ - (it goes unescaped into transport.url); openssl rand -hex 32 makes one" >&2
    exit 2
fi
if [[ ! $port =~ ^[0-9]+$ ]] || ((port < 1 || port > 65535)); then
    echo "PORT=$port: give a TCP port, 1..65535" >&2
    exit 2
fi

echo "# written by ops/launch/redis-conf.sh; holds the rollstream user's password"
echo "include $ops/redis.conf"
echo "bind $bind"
if [[ -n ${REDIS_TLS_CERT:-} ]]; then
    : "${REDIS_TLS_KEY:?REDIS_TLS_CERT is set: set REDIS_TLS_KEY to its private key too}"
    : "${REDIS_TLS_CA:?REDIS_TLS_CERT is set: set REDIS_TLS_CA to the CA that signed it too}"
    echo "port 0"
    echo "tls-port $port"
    echo "tls-cert-file $REDIS_TLS_CERT"
    echo "tls-key-file $REDIS_TLS_KEY"
    echo "tls-ca-cert-file $REDIS_TLS_CA"
    # the password authenticates the workers; a client certificate is asked for only where given (mutual TLS)
    echo "tls-auth-clients optional"
else
    echo "port $port"
fi
echo "dir $dir"
# The ACL lines of ops/redis-acl.conf, the one home of the command list, with the password put in.
grep '^user ' "$ops/redis-acl.conf" | sed "s/>CHANGE-ME/>$password/"
