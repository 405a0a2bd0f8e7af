"""The loops that talk to the Conductor server: one poll loop per task type (``poller``, with the
pure ``pollpolicy``), final updates (``reporter``), task logs (``logsink``), and how every call
went, for ``conductor-run status`` (``server_contact``).
"""
