#!/bin/sh
# A task tree for the kill-latency bench: this shell, a grandchild in its group, and an escapee in its
# own session. Writes "shell grandchild escapee" pids to $2/$CONDUCTOR_TASK_ID, then waits.
# $1 = "ignore-term": every member ignores SIGTERM (inherited), so only SIGKILL ends the tree.
[ "$1" = ignore-term ] && trap '' TERM
sleep 600 &
grandchild=$!
setsid sleep 600 &
escapee=$!
echo "$$ $grandchild $escapee" > "$2/$CONDUCTOR_TASK_ID.tmp"
mv "$2/$CONDUCTOR_TASK_ID.tmp" "$2/$CONDUCTOR_TASK_ID"
wait
