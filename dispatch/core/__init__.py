"""The dispatcher core: pure Python, no Django (docs/architecture.md, "The dispatch cycle").

Modules: `spec` (the one ExecutionSpec/task validator), `placement`, `budget`,
`offer`, `result`, `ports` (Protocols + the data crossing them), `paging`
(bounded keyset reads that re-check each page), `cycle` (`dispatch_once`, the
nine steps in order) and `fakes` (well-behaved in-memory ports, held to the
same contract suite as the ORM adapters).
"""

from __future__ import annotations
