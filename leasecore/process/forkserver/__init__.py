"""The fork server: a small single-threaded process, started by the Supervisor, parent of every
task tree (``server``: the message loop, composed of the parts below), how it starts a tree
(``launch``: ``forkexec`` or a ``spawners`` thread), the trees it holds (``trees``), how it learns of
exits and reaps (``exits``), how it signals and lets trees go (``kills``), the dead-man's switches
(``switches``, ``deadman``), its reused cgroup v1 groups (``grouppool``) and the frames of its
control socket (``frames``, used by both sides).

Stdlib only, and this file stays a docstring: the fork server imports these modules, and it
must load nothing of the runner's side.
"""
