"""Requests in: the Triton LLM convention's inputs parsed and validated once (``request``) and the router's
child requests (``pd_request``, over the child protocol of ``serving.child``)."""
