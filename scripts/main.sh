#!/usr/bin/env bash
# The main job: installs what is missing, then runs the median sweep of the seed
# (3 policies x 2 start methods) and prints its table. Extra arguments are passed
# to `harness run` (e.g. episodes=20 or actors=4).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/harness run configs/median.yaml "$@"
