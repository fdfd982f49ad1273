#!/usr/bin/env bash
# Writes the secrets docker/compose.yaml mounts (as files under /run/secrets, never in environment
# variables or argv): random values, one file each, in DIR (default docker/secrets, mode 700).
# Existing files are kept, so running it again changes nothing.
#
#   docker/secrets.sh [DIR]
set -euo pipefail
dir=${1:-$(dirname "$0")/secrets}
umask 077
mkdir -p "$dir"
chmod 700 "$dir"
new() {  # name value: the file is world-readable inside DIR (mode 700) so that the containers'
         # non-root users (airflow, postgres) can read their bind-mounted copy
    [ -s "$dir/$1" ] || { printf '%s' "$2" >"$dir/$1"; chmod 644 "$dir/$1"; }
}
new postgres_password "$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
new sql_alchemy_conn "postgresql+psycopg2://airflow:$(cat "$dir/postgres_password")@postgres:5432/airflow"
new jwt_secret "$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
echo "secrets in $dir: $(cd "$dir" && echo *)"
