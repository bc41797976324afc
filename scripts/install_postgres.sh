#!/usr/bin/env bash
# Debian's PostgreSQL server, for the store's tests against a real server (tests/test_history_store.py
# starts its own with initdb / pg_ctl in a temporary folder; nothing here starts a service).
# Tolerant by design: where it cannot be installed (no apt-get, not root, no network) it says so and exits 0,
# and those tests skip naming the package; the SQLite tests run either way.
set -u
if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  echo "[postgres] installed: $(ls -d /usr/lib/postgresql/*/bin | tail -1)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
  echo "[postgres] not installed and no apt-get as root here: the PostgreSQL store tests will be skipped"
  exit 0
fi
echo "[postgres] installing Debian's postgresql package"
if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null); then
  echo "[postgres] installed: $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | tail -1)"
else
  echo "[postgres] the install failed (apt-get's message above): the PostgreSQL store tests will be skipped"
fi
exit 0
