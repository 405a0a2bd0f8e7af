"""The deterministic simulator (leasecore.sim): same seed, same trace; a clean range is clean; every
planted race is found; the command's last line and exit status.

Each planted race is a switch in the simulator's stand-in glue (``leasecore.sim.setting.Bugs``), never
in production code; a test runs seeds from 1 up and requires the violation the race causes within 200
seeds (most are found in the first few, so these tests take seconds).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli.sim import main
from leasecore.sim.scenario import SeedResult, SimOptions, run_seed
from leasecore.sim.setting import Bugs

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(r"^sim: (\d+) seeds, ([\d.]+) simulated task-hours, (\d+) attempts, (\d+) faults, "
                     r"(\d+) violations$")


def first_violation(options: SimOptions, seeds: int = 200, invariant: str = "") -> SeedResult | None:
    """The first seed from 1 up with a violation (of ``invariant``, if given: a planted race may break
    another invariant first in some seed, which is a finding too but not the one asked for)."""
    for seed in range(1, seeds + 1):
        result = run_seed(seed, options)
        if any(v.startswith(invariant) for v in result.violations):
            return result
    return None


def test_the_same_seed_gives_the_same_trace_bit_for_bit() -> None:
    options = SimOptions(minutes=2, keep_trace=True)
    a, b = run_seed(7, options), run_seed(7, options)
    assert a.events > 500 and a.attempts > 10  # a run with something in it
    assert a.trace == b.trace
    assert a.digest == b.digest
    assert run_seed(8, options).digest != a.digest  # the digest does tell seeds apart


def test_the_trace_does_not_depend_on_hash_order() -> None:
    """Two interpreters with different string hashing print the same digest for one seed."""
    digests = set()
    for hash_seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-m", "cli.sim", "--seed", "3", "--minutes", "3", "--trace"],
                             cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": hash_seed}, capture_output=True,
                             text=True, timeout=120, check=True).stdout
        found = re.findall(r"^seed 3: trace digest sha256:([0-9a-f]{64})", out, re.MULTILINE)
        assert len(found) == 1
        digests.add(found[0])
    assert len(digests) == 1


def test_a_fixed_seed_range_runs_clean_with_faults_injected() -> None:
    attempts = faults = 0
    for seed in range(1, 7):
        result = run_seed(seed, SimOptions(minutes=3))
        assert result.violations == [], (seed, result.violations, result.trace[-30:])
        attempts += result.attempts
        faults += result.faults
    assert attempts > 200 and faults > 50  # the range did exercise the runners and the faults


# (race planted, what else the seed needs, the invariant it must break)
PLANTED = [
    (Bugs(term_at_deadline=True), {}, "two live copies"),
    (Bugs(no_redelivery_hold=True), {}, "two live copies"),
    (Bugs(no_final_wait=True), {"fault_scale": 4.0}, "final record"),
    (Bugs(yield_unheld=True), {}, "two live copies"),
    # the product's first retry comes 0.5 s after the timeout, so the resend follows the next poll less
    # often than it did with the stand-in's 1-3 s: heavier faults find it within 20 seeds, not ~70
    (Bugs(retry_landed_yield=True), {"fault_scale": 4.0}, "delivered twice"),
    # the transport's resend of a yield whose connection was reset under it (the jar's lost-yield test
    # failed so in CI): no read-back at all, so no heavier faults needed
    (Bugs(resend_in_progress=True), {}, "delivered twice"),
    (Bugs(failed_before_tree_gone=True), {}, "two live copies"),
    # the retry the wrong FAILED creates must go to a host that neither held the task nor holds the
    # re-delivery (its previous holder's own retry waits for its dying tree): more hosts, more often
    (Bugs(held_reported_failed=True), {"runners": 5}, "two live copies"),
    # on one host a FAILED sent while escapees live is caught by the dying-tree wait alone
    (Bugs(failed_before_tree_gone=True, no_dying_wait=True), {"runners": 1}, "two live copies"),
]


@pytest.mark.parametrize(("bugs", "extra", "invariant"), PLANTED,
                         ids=["+".join(k for k, v in vars(b).items() if v) for b, _, _ in PLANTED])
def test_each_planted_race_is_found_within_200_seeds(
    bugs: Bugs, extra: dict[str, float], invariant: str
) -> None:
    result = first_violation(SimOptions(minutes=10, bugs=bugs, **extra), invariant=invariant)  # type: ignore[arg-type]
    assert result is not None, f"{bugs} not found in 200 seeds"
    assert result.violations[0].startswith(invariant), result.violations


def test_without_the_planted_race_the_same_setting_is_clean() -> None:
    """The control of the one-runner case above: the escapee's FAILED alone is caught by DyingTrees."""
    for seed in range(1, 7):
        result = run_seed(seed, SimOptions(minutes=10, runners=1, bugs=Bugs(failed_before_tree_gone=True)))
        assert result.violations == [], (seed, result.violations)


def test_without_the_fork_servers_kill_by_a_stalled_runner_lets_two_copies_run() -> None:
    """Today's main (no dead-man switch in the fork server yet): a stall past the lease deadline."""
    result = first_violation(SimOptions(minutes=10, kill_by=False))
    assert result is not None and result.violations[0].startswith("two live copies"), result
    assert any("STALL" in line for line in result.trace)


# (21's draws, moved by the reset of a final update's connection, requeue nothing; 20's hold again)
@pytest.mark.parametrize("seed", [17, 20])
def test_the_re_delivery_hold_gap_is_closed(seed: int) -> None:
    """Finding 4 (docs/simulator.md): a re-delivery's hold counted on its previous holder's ownership
    checks getting through; with lost checks or a stalled holder the copies overlapped. These seeds,
    with every requeue and lost reads on, broke "two live copies" before the ownership window at the
    draws of that commit (seed 17 at 343 s, seed 20 at 440 s); the draws moved since (the merged
    engine, poller and runner cores), so the case that fails without the window is the unit test
    test_lease_ownership_window's last one; here they must stay clean and still hold re-deliveries."""
    result = run_seed(seed, SimOptions(minutes=10, known_gaps=True, keep_trace=True))
    assert result.violations == [], result.violations
    assert any("pushed back to its queue" in line for line in result.trace)  # the requeue happened
    assert any("handed out before" in line for line in result.trace)  # and its re-delivery was held


def test_the_command_prints_the_summary_last_and_exits_0_when_clean(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--seeds", "2", "--first-seed", "5", "--minutes", "3", "--jobs", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    match = SUMMARY.match(last)
    assert match is not None, last
    assert match.group(1) == "2" and int(match.group(3)) > 0 and match.group(5) == "0"


def test_a_violation_exits_1_with_its_seed_and_trace(capsys: pytest.CaptureFixture[str]) -> None:
    # The first seed that finds the planted race (seeds move whenever the simulation's draws change).
    found = first_violation(SimOptions(minutes=5, bugs=Bugs(yield_unheld=True)), seeds=60)
    assert found is not None, "yield_unheld not found in seeds 1-60"
    seed, count = str(found.seed), len(found.violations)
    assert main(["--seed", seed, "--minutes", "5", "--bug", "yield_unheld", "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    assert f"seed {seed}: {count} violation(s)" in out
    assert "two live copies" in out and "tree r" in out  # the trace leading to it
    assert SUMMARY.match(out.strip().splitlines()[-1]).group(5) == str(count)  # type: ignore[union-attr]


def test_bad_arguments_are_refused_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seeds", "0"]) == 2
    assert "--seeds" in capsys.readouterr().err



def test_the_orphan_check_catches_trees_left_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check behind "nothing outlives its runner's crash plus the sweep" (after a crash, a fork
    server's death and a stopped runner's exit) can fail: a fork server that forgets to kill its trees
    is reported."""
    from leasecore.sim.trees import SimForkServer

    def kill_nothing(self: SimForkServer, why: str) -> list[object]:
        return []

    monkeypatch.setattr(SimForkServer, "kill_all", kill_nothing)
    result = first_violation(SimOptions(minutes=10), seeds=20, invariant="orphans")
    assert result is not None
    assert "still alive" in result.violations[0] or "after its stop" in result.violations[0]
