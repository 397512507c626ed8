"""The reference Worker agent (README "Worker API"): stdlib only, no Django imports.

`python -m workers.agent --url URL --credential-file PATH` opens a Session,
heartbeats, pulls offers and runs them as local processes under the Worker
protocol rules: verify the spec digest, ACK `starting` before spawning (a 409
means do not run), ACK `running` with the pid, then the outcome; stop on a
cancel verdict or any 409.
"""

from __future__ import annotations

AGENT_VERSION = "qinglong-agent/1"
