#!/bin/bash
# The seed's build step (../../../shared/seed), with `sbx` replaced by `harness sandbox`:
# one sandbox, the env uploaded and set up, the baseline graded, then snapshotted.
# Run it in a scratch directory; it leaves env.tgz there and the source sandbox's
# id in src.id (episodes.sh forks that sandbox).
#   SBX      the sandbox command (default `harness sandbox`; any sbx-compatible CLI)
#   ENV_DIR  the environment to upload (default envs/median); it unpacks as ~/env
#   SNAP     the snapshot name (default aeo-rl-env-v1, as in the seed)
set -e
SBX=${SBX:-harness sandbox}
ENV_DIR=${ENV_DIR:-$(cd "$(dirname "$0")/../../envs/median" && pwd)}
SNAP=${SNAP:-aeo-rl-env-v1}

src=$($SBX new --name aeo-rl-1 --type small --ttl 3600)
echo "$src" > src.id

tar czf env.tgz --exclude=__pycache__ --exclude=.venv --transform 's,^\.,env,' -C "$ENV_DIR" .
$SBX exec $src "echo $(base64 -w0 env.tgz) | base64 -d | tar xz && chmod +x env/episode.sh"
$SBX exec $src --timeout 300 "cd env && python3 -m venv .venv && .venv/bin/pip install -q pytest==8.3.3 && .venv/bin/python -m pytest --version"
$SBX exec $src "cd env && .venv/bin/python grade.py"     # baseline: the unfixed bug

$SBX exec $src "rm -f ~/result.json; sync"
$SBX snapshot $src "$SNAP"
