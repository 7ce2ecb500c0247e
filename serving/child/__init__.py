"""The router↔worker child protocol, both sides next to each other: ``codec`` (what a child request and its
responses carry, driven by ``serving.schema``, and the schema hash both sides check), ``signing`` (fleet
signatures of child requests) and ``frames`` (the framing on a worker's own endpoint)."""
