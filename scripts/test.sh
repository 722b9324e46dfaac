#!/usr/bin/env bash
# The test command: installs what is missing, then runs the whole suite.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/python -m pytest -q "$@"
