"""The demo's judge, on made-up timelines: no server, no processes, no clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from leasecore.demo.judge import Observation, SceneTracker
from leasecore.demo.plan import DemoSettings, SceneKind, runner_config, standard_scenes, task_defs_for
from leasecore.demo.secret import SECRET_NAME, leaks, secret_line

SETTINGS = DemoSettings()  # R = 2 s, kill grace 0.3 s, ownership check every 1 s
SCENES = {s.kind: s for s in standard_scenes(SETTINGS, completed_exit=0, fenced_exit=5)}
TREE = (101, 102)


def obs(at: float, **kw: object) -> Observation:
    base: dict[str, object] = {"runner_pid": 50, "workflow_status": "RUNNING"}
    base.update(kw)
    return Observation(at=at, **base)  # type: ignore[arg-type]


def running(at: float, updated_at: float, **kw: object) -> Observation:
    base: dict[str, object] = {"task_status": "IN_PROGRESS", "poll_count": 1, "updated_at": updated_at,
                               "tree": TREE, "tree_alive": 2}
    base.update(kw)
    return obs(at, **base)


def feed(tracker: SceneTracker, samples: list[Observation], ended_at: float | None = None) -> SceneTracker:
    for sample in samples:
        terminal = sample.task_status not in (None, "SCHEDULED", "IN_PROGRESS")
        tracker.observe(sample, ended_at=ended_at if terminal else None)
    return tracker


SECRET_SAID = f"secret {SECRET_NAME}: the same in ${SECRET_NAME} and in $CONDUCTOR_SECRETS_FILE: ***"


def heartbeat_timeline(secret_said: str | None = SECRET_SAID) -> list[Observation]:
    """Polled at 1.0, the child's line about the secret in the task log at 1.9, heartbeats at 2.6,
    4.2, 5.8, 7.4; completes at 8.1."""
    samples = [obs(0.0, task_status="SCHEDULED"), running(1.1, 1.0)]
    samples.append(running(1.9, 1.0, secret_line=secret_said))
    for beat in (2.6, 4.2, 5.8, 7.4):
        samples.append(running(beat + 0.05, beat, last_output="working"))
    done = {"task_status": "COMPLETED", "workflow_status": "COMPLETED", "tree": TREE, "tree_alive": 0,
            "poll_count": 1, "updated_at": 8.1}
    samples.append(obs(8.2, **done))
    samples.append(obs(8.4, **done, runner_exit=0))
    return samples


def failed_texts(tracker: SceneTracker, **kw: bool) -> list[str]:
    return [c.text for c in tracker.verdict(**kw).checks if not c.ok]


# ---------------------------------------------------------------------------- scene 1: heartbeats


def test_heartbeats_scene_passes_and_counts_each_moved_update_time() -> None:
    tracker = feed(SceneTracker(SCENES[SceneKind.HEARTBEATS], SETTINGS), heartbeat_timeline(), ended_at=8.1)
    tracker.secret_leaks = ()  # the player read the task log, the workflow and the runner's log: clean
    verdict = tracker.verdict()
    assert verdict.ok, [c.text for c in verdict.checks if not c.ok]
    assert any(c.text.startswith(f"the child got the server's secret {SECRET_NAME}") for c in verdict.checks)
    assert tracker.heartbeats == [2.6, 4.2, 5.8, 7.4]
    assert tracker.polled_at == 1.0
    assert tracker.finished()
    assert "4 heartbeats" in verdict.summary
    texts = [e.text for e in tracker.events]
    assert any(t.startswith("heartbeat 4: ") and "+9.4s" in t for t in texts)  # 7.4 + R
    assert "runner exited with code 0" in texts
    assert f"child says (task log): {SECRET_SAID}" in texts


@pytest.mark.parametrize(
    ("said", "leaked", "failing"),
    [
        (None, (), "(its line: not in the task log)"),  # the child never got it (or never said)
        (SECRET_SAID.replace("the same", "NOT the same"), (), "as a variable and in $CONDUCTOR_SECRETS_FILE"),
        (SECRET_SAID.replace("***", "s3cr3t-value"), (), "is *** in the task log"),  # not masked
        (SECRET_SAID, ("the runner's log",), "unmasked in: the runner's log"),
        (SECRET_SAID, None, "nothing was read"),  # nobody looked: no pass by default
    ],
)
def test_the_secret_claims_fail_when_the_value_did_not_arrive_or_was_not_masked(
    said: str | None, leaked: tuple[str, ...] | None, failing: str
) -> None:
    scene = SCENES[SceneKind.HEARTBEATS]
    tracker = feed(SceneTracker(scene, SETTINGS), heartbeat_timeline(said), ended_at=8.1)
    tracker.secret_leaks = leaked
    failed = failed_texts(tracker)
    assert any(failing in text for text in failed), failed
    assert all("secret" in text or "*** in the task log" in text for text in failed), failed  # only these


def test_only_the_first_scene_judges_the_secret() -> None:
    scenes = standard_scenes(SETTINGS, completed_exit=0, fenced_exit=5)
    assert [s.shows_secret for s in scenes] == [True, False, False]


def test_the_secret_line_is_found_inside_a_batch_and_leaks_are_named_by_place() -> None:
    entries = [{"log": "working: step 1 of 7"}, {"log": f"working: step 2\n{SECRET_SAID}\nworking: step 3"}]
    assert secret_line(entries) == SECRET_SAID
    assert secret_line([{"log": "working"}, {"nolog": 1}]) is None
    places = {"the task log": "... ***", "the workflow": '{"token": "abcd1234"}', "the runner's log": ""}
    assert leaks("abcd1234", places) == ("the workflow",)
    assert leaks("abcd1234", {"the task log": "***"}) == ()


def test_heartbeats_scene_fails_when_the_server_timed_the_task_out() -> None:
    samples = [obs(0.0, task_status="SCHEDULED"), running(1.1, 1.0),
               obs(3.1, task_status="TIMED_OUT", workflow_status="TIMED_OUT", poll_count=1, tree=TREE,
                   tree_alive=0, runner_exit=5)]
    tracker = feed(SceneTracker(SCENES[SceneKind.HEARTBEATS], SETTINGS), samples, ended_at=3.0)
    failed = failed_texts(tracker)
    assert any("is TIMED_OUT/TIMED_OUT (expected COMPLETED/COMPLETED)" in t for t in failed)
    assert any("0 heartbeats" in t for t in failed)
    assert any("stayed IN_PROGRESS for 2.0s" in t for t in failed)


def test_a_second_delivery_is_not_a_heartbeat_and_fails_the_scene() -> None:
    samples = heartbeat_timeline()
    samples.insert(3, running(3.0, 3.0, poll_count=2))  # re-queued and polled again
    tracker = feed(SceneTracker(SCENES[SceneKind.HEARTBEATS], SETTINGS), samples, ended_at=8.1)
    assert 3.0 not in tracker.heartbeats
    assert any("handed out once (pollCount 2)" in t for t in failed_texts(tracker))
    assert any(e.kind == "bad" for e in tracker.events)


def test_a_scene_cut_short_fails_and_says_so() -> None:
    tracker = feed(SceneTracker(SCENES[SceneKind.HEARTBEATS], SETTINGS), heartbeat_timeline()[:3])
    assert not tracker.finished()
    assert any("did not finish within" in t for t in failed_texts(tracker, cut_short=True))


@pytest.mark.parametrize("kind", list(SceneKind))
def test_a_runner_that_exits_before_polling_ends_the_scene_at_once(kind: SceneKind) -> None:
    # A start-up error (a bad CA bundle in the environment, say): waiting out the scene's budget for
    # a poll that cannot come only hid the runner's message behind "did not finish within 28s".
    tracker = feed(SceneTracker(SCENES[kind], SETTINGS), [obs(0.0, task_status="SCHEDULED")])
    assert not tracker.finished()
    feed(tracker, [obs(0.3, task_status="SCHEDULED", runner_exit=3)])
    assert tracker.finished()
    failed = failed_texts(tracker)
    assert "the runner polled the task" in failed
    assert any("the runner exited with code 3" in text for text in failed)
    assert not any("did not finish" in text for text in failed)


def test_a_surviving_tree_fails_every_scene() -> None:
    samples = heartbeat_timeline()
    samples[-1] = replace(samples[-1], tree_alive=1)
    samples[-2] = replace(samples[-2], tree_alive=1)
    tracker = feed(SceneTracker(SCENES[SceneKind.HEARTBEATS], SETTINGS), samples, ended_at=8.1)
    assert not tracker.finished()
    assert any("no process of the task's tree is left (2 seen, 1 alive)" in t for t in failed_texts(tracker))


# ---------------------------------------------------------------------------- scene 2: no lease


TIMED_OUT_BY_SERVER = {"task_status": "TIMED_OUT", "workflow_status": "TIMED_OUT",
                       "reason": "responseTimeout: 2 exceeded for the taskId: abc with TaskDef"}
FAILED_BY_RUNNER = {"task_status": "FAILED", "workflow_status": "FAILED",
                    "reason": "lease expired: no heartbeat was acknowledged within the heartbeat timeout"}


def no_lease_timeline(dead_at: float, outcome: dict[str, str] | None = None) -> list[Observation]:
    """Polled at 1.0; the lease ends at 3.0 (R = 2): TERM; the task ends on the server at 3.1."""
    end = outcome or TIMED_OUT_BY_SERVER
    samples = [obs(0.0, task_status="SCHEDULED"), running(1.1, 1.0), running(2.0, 1.0),
               running(3.0, 1.0, fence_reason="lease_expired")]
    if dead_at > 3.1:
        samples.append(obs(3.15, poll_count=1, updated_at=3.1, tree=TREE, tree_alive=2, **end))
    samples.append(obs(dead_at, poll_count=1, tree=TREE, tree_alive=0, runner_exit=5, **end))
    return samples


@pytest.mark.parametrize("outcome", [TIMED_OUT_BY_SERVER, FAILED_BY_RUNNER])
def test_no_lease_scene_passes_when_the_tree_dies_at_r_whoever_ends_the_task(outcome: dict[str, str]) -> None:
    # With lease extension off the lease ends at R: the runner's TERM at poll + R races the server's
    # timeout at R; either the server's TIMED_OUT or the runner's FAILED (lease expired) lands first.
    tracker = feed(SceneTracker(SCENES[SceneKind.NO_LEASE], SETTINGS), no_lease_timeline(3.3, outcome),
                   ended_at=3.1)
    verdict = tracker.verdict()
    assert verdict.ok, [c.text for c in verdict.checks if not c.ok]
    assert "the tree was gone 2.3s after the poll (R = 2s)" in verdict.summary
    assert outcome["task_status"] in verdict.summary
    assert any(e.text == "the runner fences the tree: lease expired" for e in tracker.events)


def test_no_lease_scene_fails_when_the_tree_outlives_r() -> None:
    # Gone at +8.5 s, 7.5 s after the poll: past R (2 s, when it must be dead) + slack (3 s); the
    # server may have handed the task to another worker since R.
    tracker = feed(SceneTracker(SCENES[SceneKind.NO_LEASE], SETTINGS), no_lease_timeline(8.5), ended_at=3.1)
    failed = failed_texts(tracker)
    assert any("the tree was gone 7.5s after the poll: the lease ends at R = 2s" in t for t in failed)


def test_no_lease_scene_fails_when_the_child_was_not_killed() -> None:
    # Gone only at +13.5 s: the 12 s task simply finished (polled at +1.0).
    tracker = feed(SceneTracker(SCENES[SceneKind.NO_LEASE], SETTINGS), no_lease_timeline(13.5), ended_at=3.1)
    failed = failed_texts(tracker)
    assert any("killed, not finished" in t for t in failed)
    assert any("the tree was gone 12.5s after the poll" in t for t in failed)


def test_no_lease_scene_fails_on_another_outcome() -> None:
    other = {"task_status": "COMPLETED", "workflow_status": "COMPLETED"}
    tracker = feed(SceneTracker(SCENES[SceneKind.NO_LEASE], SETTINGS), no_lease_timeline(3.3, other),
                   ended_at=3.1)
    expected = "is COMPLETED/COMPLETED (expected TIMED_OUT/TIMED_OUT or FAILED/FAILED)"
    assert any(expected in t for t in failed_texts(tracker))


def test_no_lease_scene_fails_if_heartbeats_were_sent() -> None:
    samples = no_lease_timeline(3.5)
    samples.insert(2, running(1.7, 1.6))
    tracker = feed(SceneTracker(SCENES[SceneKind.NO_LEASE], SETTINGS), samples, ended_at=3.6)
    assert any("no heartbeat was sent (1 seen)" in t for t in failed_texts(tracker))


# ---------------------------------------------------------------------------- scene 3: fenced


def fenced_run(dead_at: float) -> SceneTracker:
    """Polled at 1.0, heartbeats at 2.6 and 4.2, silent from 4.3: lease deadline 6.2."""
    tracker = SceneTracker(SCENES[SceneKind.FENCED], SETTINGS)
    feed(tracker, [obs(0.0, task_status="SCHEDULED"), running(1.1, 1.0), running(2.7, 2.6)])
    assert not tracker.wants_silence()  # one heartbeat is not enough
    tracker.observe(running(4.25, 4.2))
    assert tracker.wants_silence()
    tracker.observe(running(4.3, 4.2, silent=True))
    assert not tracker.wants_silence() and not tracker.wants_resume()
    tracker.observe(running(dead_at, 4.2, silent=True, tree_alive=0, fence_reason="lease_expired",
                            runner_said=("terminating the process tree (lease expired)",)))
    assert not tracker.wants_resume()  # the server has not timed the task out yet
    tracker.observe(obs(dead_at + 0.1, task_status="TIMED_OUT", workflow_status="TIMED_OUT", poll_count=1,
                        tree=TREE, tree_alive=0, silent=True), ended_at=6.2)
    assert tracker.wants_resume()
    tracker.observe(obs(dead_at + 0.3, task_status="TIMED_OUT", workflow_status="TIMED_OUT", poll_count=1,
                        tree=TREE, tree_alive=0, runner_exit=5))
    return tracker


def test_fenced_scene_passes_when_the_tree_dies_at_the_lease_deadline() -> None:
    tracker = fenced_run(6.25)
    verdict = tracker.verdict()
    assert verdict.ok, [c.text for c in verdict.checks if not c.ok]
    assert tracker.silenced_at == 4.3 and tracker.resumed_at == pytest.approx(6.55)
    texts = [e.text for e in tracker.events]
    assert ("the server goes silent: requests get no answer; last heartbeat at +4.2s, "
            "so the lease ends at +6.2s") in texts
    assert "runner log: terminating the process tree (lease expired)" in texts
    assert "the runner fences the tree: lease expired" in texts


@pytest.mark.parametrize("dead_at", [4.5, 12.0])
def test_fenced_scene_fails_when_the_kill_is_far_from_the_deadline(dead_at: float) -> None:
    assert any("lease deadline +6.2s" in t for t in failed_texts(fenced_run(dead_at)))


# ---------------------------------------------------------------------------- configuration


def test_runner_config_per_scene() -> None:
    kwargs = {"server_url": "http://127.0.0.1:1/api", "command": ["python3", "demo_long.py"],
              "worker_id": "demo"}
    on = runner_config(SCENES[SceneKind.HEARTBEATS], SETTINGS, **kwargs)  # type: ignore[arg-type]
    off = runner_config(SCENES[SceneKind.NO_LEASE], SETTINGS, **kwargs)  # type: ignore[arg-type]
    assert on["server"] == {"url": "http://127.0.0.1:1/api"}
    (task,) = on["task"]
    assert task["type"] == "demo_long_job" and task["lease_extend_enabled"] is True
    assert task["command"] == ["python3", "demo_long.py"]
    assert "heartbeat_timeout" not in task  # the lease deadline is R
    (task_off,) = off["task"]
    assert task_off["lease_extend_enabled"] is False
    assert "heartbeat_timeout" not in task_off  # R too: a longer one would be capped at R anyway


def test_scenes_outlast_r_and_fit_in_a_minute_together() -> None:
    scenes = standard_scenes(SETTINGS, completed_exit=0, fenced_exit=5)
    assert [s.kind for s in scenes] == [SceneKind.HEARTBEATS, SceneKind.NO_LEASE, SceneKind.FENCED]
    assert all(s.task_seconds >= 3 * SETTINGS.response_timeout_seconds for s in scenes)
    assert scenes[0].expect_runner_exit == 0 and scenes[2].expect_runner_exit == 5


def test_task_defs_get_the_demo_r_and_others_are_untouched() -> None:
    key = "responseTimeoutSeconds"
    defs = [{"name": "demo_long_job", key: 60}, {"name": "x", key: 9}]
    out = task_defs_for(defs, DemoSettings(response_timeout_seconds=3))
    assert out == [{"name": "demo_long_job", key: 3, "runtimeMetadata": [SECRET_NAME]}, {"name": "x", key: 9}]
    assert defs[0]["responseTimeoutSeconds"] == 60  # not mutated
