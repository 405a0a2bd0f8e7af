"""What the runner keeps on the host: status files read by ``conductor-run status`` (``statefile``),
results not yet delivered (``outbox``), and the trees left by a runner that died (``orphans``).
"""
