"""What kopf remembers of each object to tell a change from an echo (its "diff base").

kopf builds an object's essence (its spec, labels and annotations) on every watch event
of every watched kind, by deep-copying the whole body (``managedFields`` and status
included) and then dropping most of it. :class:`LeanDiffBase` hands kopf's builder only
the parts it keeps, and an empty essence for the kinds no change handler watches (the
Deployments and WorkerPools: only event handlers see them, and those never read it).
The essence itself, and where kopf stores it, are kopf's own.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, cast

import kopf

KEPT_METADATA = ("labels", "annotations", "ownerReferences")
"""What kopf's builder reads of ``metadata`` (it keeps labels and annotations; the owner
references name its annotation keys)."""


class LeanDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's annotation diff base, built without copying what it throws away."""

    def __init__(
        self, *, prefix: str, key: str, changing_kinds: Collection[tuple[str, str]]
    ) -> None:
        super().__init__(prefix=prefix, key=key)
        self.changing_kinds = frozenset(changing_kinds)
        """(apiVersion, kind) of the kinds with change handlers (create, update, resume)."""

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None
    ) -> kopf.BodyEssence:
        extra = list(extra_fields or [])
        if extra:  # a handler filters on other fields: kopf's builder keeps them
            return super().build(body=body, extra_fields=extra)
        if (body.get("apiVersion"), body.get("kind")) not in self.changing_kinds:
            return kopf.BodyEssence()
        meta = body.get("metadata") or {}
        lean: dict[str, Any] = {k: v for k, v in body.items() if k not in ("metadata", "status")}
        lean["metadata"] = {k: meta[k] for k in KEPT_METADATA if k in meta}
        return super().build(body=kopf.Body(cast(kopf.RawBody, lean)))
