"""Triton glue: the python-backend adapters of the engine models (``host.ModelHost`` and its PD child and
colocated models), request and response tensors (``io``), the response thread (``response_dispatch``), the
deferred ``model.py`` entry (``entry``), and the watches that keep a stub honest about its server
(``orphan_watch``, ``server_watch``, ``stub_guard`` with its ``stub_guardian`` process)."""
