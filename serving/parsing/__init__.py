"""Requests in: the Triton LLM convention's inputs parsed and validated once (``request``), the router's child
requests (``pd_request``) and their codec with the schema hash (``child_codec``), and the tokenizing intake
(``intake``)."""
