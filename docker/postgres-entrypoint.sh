#!/bin/sh
# Initialises $PGDATA on first start (user, password, database from the environment), then runs
# PostgreSQL in the foreground, listening on all the container's addresses, password auth only.
set -eu
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
    POSTGRES_PASSWORD=$(cat "$POSTGRES_PASSWORD_FILE")
fi
if [ -z "${POSTGRES_PASSWORD:-}" ]; then
    echo "postgres-entrypoint: set POSTGRES_PASSWORD (or POSTGRES_PASSWORD_FILE): no database without a password" >&2
    exit 1
fi
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
    initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
        --encoding=UTF8 >/dev/null
    rm -f "$pwfile"
    {
        echo "listen_addresses = '*'"
        echo "unix_socket_directories = '/tmp'"
    } >>"$PGDATA/postgresql.conf"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    if [ "$db" != postgres ]; then
        postgres --single -D "$PGDATA" -c unix_socket_directories=/tmp postgres >/dev/null <<SQL
CREATE DATABASE "$db" OWNER "$user";
SQL
    fi
    echo "postgres-entrypoint: initialised $PGDATA (user $user, database $db)"
fi
unset POSTGRES_PASSWORD
exec postgres -D "$PGDATA"
