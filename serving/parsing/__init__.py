"""Requests in: the Triton LLM convention's inputs parsed and validated once (``request``), the router's child
requests (``pd_request``) and the child protocol's codec with its schema hash (``child_codec``)."""
