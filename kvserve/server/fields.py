"""Request fields kvserve does not know: ignored and logged once per name, or refused with --strict-fields.

vLLM accepts and ignores them, and routers in front of replicas rely on it: SGLang's router
adds fields of its own when it re-serialises a request. A warning names the field (never
its value: that is the caller's data), once per field name for the life of the server.
"""

from __future__ import annotations

from pydantic import BaseModel

from kvserve.logger import logger
from kvserve.server.errors import APIError
from kvserve.server.protocol import unknown_fields


class UnknownFields:
    def __init__(self, strict: bool = False):
        self.strict = strict
        self.logged: set[str] = set()  # names already warned about (list indexes left out)

    def check(self, request: BaseModel) -> None:
        """Raise a 400 naming every unknown field under --strict-fields (`param`: the first);
        else log new names."""
        paths = unknown_fields(request)
        if not paths:
            return
        if self.strict:
            params = [".".join(map(str, path)) for path in paths]
            names = ", ".join(f"`{p}`" for p in params)
            message = f"unknown field{'s' if len(params) > 1 else ''} {names} (the server runs with --strict-fields)"
            raise APIError(400, message, param=params[0])
        for path in paths:
            name = ".".join(p for p in path if isinstance(p, str))
            if name not in self.logged:
                self.logged.add(name)
                logger.warning("ignoring the unknown request field `%s` (said once per field)", name)
