#!/bin/sh
# A child that ignores SIGTERM (and so do the sleeps it starts: an ignored signal stays ignored
# across fork and exec). Only SIGKILL, after the kill grace, can stop it.
trap '' TERM
echo "ignoring TERM"
while :; do
    sleep 1
done
