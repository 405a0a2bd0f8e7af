"""A deterministic simulation of runners, their trees and a Conductor under faults (docs/simulator.md).

``world`` (clock, event heap, random source, trace), ``conductor`` (the embedded server's store behind a
faulty network), ``trees`` (task trees, their records, the fork server), ``runner`` and ``reports``
(the simulated driver of the product's decision cores), ``scenario`` (one seed: setting, faults,
invariants), ``campaign`` (many seeds, the summary line).
"""
