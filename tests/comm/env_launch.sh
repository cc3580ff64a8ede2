#!/bin/sh
# Runs COMMAND as N ranks under the env launcher (torchrun's variables, a free port on
# 127.0.0.1), the way a plain shell or torchrun starts them; exits non-zero when any rank does.
# Usage: env_launch.sh N COMMAND [ARGS...]
set -u
n=$1
shift
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=
r=0
while [ "$r" -lt "$n" ]; do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=$n LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$@" &
  pids="$pids $!"
  r=$((r + 1))
done
rc=0
for p in $pids; do
  wait "$p" || rc=$?
done
exit $rc
