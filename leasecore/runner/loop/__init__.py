"""The runner's main loop: the one thread that owns per-task state (``runner``, composed of the parts
below), the table they share (``table``), the pure decisions about a task (``decisions``: admission,
a held start, what an exit means), a task's start up to its running child (``task_start``) and its
end (``task_end``: fences, exit, result, report), live control (``operate``), the stop
(``stopping``), the status snapshots (``publishing``), the events of its
queue (``events``), per-task state and its snapshots (``status``) and signal capture (``signals``).
"""
