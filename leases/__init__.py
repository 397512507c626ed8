"""The lease authority: every write to Run state, Attempt state and RunLease.

One module per use case (`claim`, `ack`, `end`, `renew`), read-only
`selectors` beside them, and the rules they share in `transitions` (legal
from → to and the compare-and-set), `locks` (the one lock order) and `policy`
(expiry, capacity, TTL, caps, fencing). See docs/adr/0004.
"""
