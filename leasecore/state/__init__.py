"""What the runner keeps on the host, in one state directory (``directory``: made and checked once,
then handed on as a ``StateDir``): status files read by ``conductor-run status`` (``statefile``),
results not yet delivered (``outbox``), and the trees left by a runner that died (``orphans``).
"""
