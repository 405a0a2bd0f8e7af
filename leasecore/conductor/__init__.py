"""Talking to a Conductor server: the client's typed calls (``client``), each sent by one
``sender`` (URLs, deadlines, token), its error translation and replies
(``calls``), credentials (``auth``), and the two transports behind one seam (``transport``:
``lean``, the hand-written HTTP/1.1 path for ``http://``, which reads answers with ``answer``;
``requests_transport``, requests for TLS and proxies), with name resolution bounded by the call's deadline
(``resolve``). Nothing here knows about leases, children or state files: callers get models and
errors from the pure core.
"""
