"""A forced stop: a second SIGTERM cuts the HTTP call in flight (here the final update, held by a silent
server) instead of waiting for its 10 s timeout; the result is kept in the outbox."""

from __future__ import annotations

import signal
import time

from cli import exitcodes
from leasecore.state.outbox import Outbox
from tests.support import wait_until

from .helpers import World


def test_a_second_sigterm_cuts_the_update_in_flight(world: World) -> None:
    world.define(response_timeout=30)
    world.start_workflow()
    with world.proxy() as proxy:
        url = proxy.url_for("/api")
        proc = world.run(url=url, command=world.gated_command())
        wait_until(world.child_pids, 30, what="the child to start")
        proxy.set_mode("blackhole")  # the final update will hang on a silent server
        world.gate.touch()
        wait_until(lambda: "reporting COMPLETED" in world.stderr(proc), 30, what="the child to finish")
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "received SIGTERM" in world.stderr(proc), 30, what="the first signal handled")
        time.sleep(0.3)  # the update attempt is on the wire, waiting for an answer that never comes
        forced_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code, err = world.finish(proc, timeout=30)
        took = time.monotonic() - forced_at
        proxy.set_mode("reset")
    assert code == exitcodes.SIGTERM, err
    assert took < 4.0, f"the forced stop took {took:.1f} s (the update's timeout is 10 s)\n{err}"
    assert "second signal" in err
    saved = Outbox(world.state_dir / "outbox", server=url).entries()
    assert [entry.result.status.value for entry in saved] == ["COMPLETED"]
