#!/bin/bash
# The seed's episode loop (../../../shared/seed), with `sbx` replaced by `harness sandbox`:
# episodes 1 and 2 start from the snapshot, episode 3 forks the live source sandbox.
# Run it in the directory where build.sh ran (it reads the source id from src.id).
# One change beyond sbx -> harness sandbox: `(.sandbox.name // .name)` is in
# parentheses, which jq 1.6 (Debian 12) needs in an object value.
#   SBX   the sandbox command (default `harness sandbox`)
#   SNAP  the snapshot name (default aeo-rl-env-v1)
#   SRC   the source sandbox id (default: the contents of src.id)
SBX=${SBX:-harness sandbox}
snap=${SNAP:-aeo-rl-env-v1}
src=${SRC:-$(cat src.id)}
echo "episode method id startSeconds policy result" > results.txt
for ep in 1 2 3; do
  policy=$((ep - 1))
  t0=$(date +%s.%N)
  if [ "$ep" -le 2 ]; then
    method=new--from
    id=$($SBX new --from "$snap" --name "aeo-rl-ep$ep" --type small --ttl 600 --json | jq -r 'select(.event=="ready") | .id')
  else
    method=fork
    $SBX fork "$src" --type small --ttl 600 --wait --json > fork.json
    id=$(jq -r '.id // .sandbox.id' fork.json | head -1)
  fi
  start=$(echo "$(date +%s.%N) - $t0" | bc)
  [ "$method" = fork ] && $SBX rename "$id" --name "aeo-rl-ep$ep" > /dev/null
  $SBX exec "$id" "test ! -e ~/result.json && echo clean-start"
  $SBX exec "$id" "POLICY=$policy ~/env/episode.sh" > /dev/null
  result=$($SBX exec "$id" "cat ~/result.json")
  echo "$ep $method $id $start $policy $result" >> results.txt
  $SBX info "$id" | jq -c '{name: (.sandbox.name // .name), memoryRestored: (.sandbox.memoryRestored // .memoryRestored), resumedFrom: (.sandbox.resumedFrom // .resumedFrom)}'
  $SBX delete "$id" --yes > /dev/null && echo "deleted $id"
done
cat results.txt
