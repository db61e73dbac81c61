"""The one rule for the names trainguard passes between processes: node ids and job names.

Both travel in every coordinator request, name store keys and folders, and appear in logs; the coordinator
refuses any other. The node agent's config, the launcher and the coordinator check against this one pattern (it
was written out three times, and a change to one would have let an agent start with ids every coordinator
refuses). Kept in a module of its own, importing nothing, so each side can import it without the other's weight.
"""

from __future__ import annotations

import re

#: 1-128 characters of ``[A-Za-z0-9._:@-]``, starting with a letter or digit: a host name, ``host-r3``,
#: ``node@pod``, ``10.0.0.7:29500``; never a path (``/``), a flag (``-x``), spaces or control characters.
#: ``\Z``, not ``$``: ``$`` also matches before a final newline, and ``"n1\n"`` was taken as a node id and
#: stored as a key (every caller uses ``match``).
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}\Z")
#: What a node id may be.
NODE_ID_RE = NAME_RE
#: What a job name may be.
JOB_NAME_RE = NAME_RE

__all__ = ["JOB_NAME_RE", "NAME_RE", "NODE_ID_RE"]
