"""``conductor-run demo``: the scenes played (``scenes``), their script (``plan``), the judge of
what a scene showed (``judge``) and the outage proxy (``proxy``). Used only by ``cli/demo.py``;
nothing in the product imports it.
"""
