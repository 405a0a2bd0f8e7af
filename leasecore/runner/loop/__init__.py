"""The runner's main loop: the one thread that owns per-task state (``runner``), the attributes
its parts share (``runner_base``), a task's start up to its running child (``task_start``) and
its end (``task_end``: fences, exit, result, report), the events of its queue (``events``),
per-task state and its snapshots (``status``) and signal capture (``signals``).
"""
