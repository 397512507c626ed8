"""The dispatcher core: pure Python, no Django (DESIGN §6, STYLE "In this project").

Modules: `spec` (the one ExecutionSpec/task validator), `placement`, `budget`,
`offer`, `result`, `ports` (Protocols + the data crossing them), `cycle`
(`dispatch_once`) and `fakes` (in-memory ports for tests).
"""

from __future__ import annotations
