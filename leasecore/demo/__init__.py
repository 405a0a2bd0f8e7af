"""``conductor-run demo``: the scenes (``scenes``), their plan (``plan``) and the outage proxy
(``proxy``). Used only by ``cli/demo.py``; nothing in the product imports it.
"""
