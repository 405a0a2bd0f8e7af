#!/bin/sh
# Exits at once, leaving a grandchild that keeps our stdout open and has left our process group
# (setsid). Exit is detected from the process, not from EOF, so the task still ends now; the
# grandchild is then killed with the rest of the task's tree.
setsid sleep 300 &
echo "started a grandchild: $!"
exit 0
