"""The data plane's side of tenancy: a tenant's request admitted before routing, a refusal answered, the
reservation settled once with what the answer used, and its usage recorded.

:class:`TenancyGate` is what a gateway runs of tenancy (the :class:`~llmgw.tenancy.interfaces.Tenancy` bundle and
the estimator of the same config), swapped whole on reload; a request reads it once. For each request of a known
key :meth:`TenancyGate.open` makes a :class:`Charge` without waiting; only a limited key's request then waits
on :meth:`TenancyGate.admit` (the limiter), so a key without limits costs no await. The charge's
:meth:`~Charge.answered` (an engine's answer ended, however) or :meth:`~Charge.unanswered` (none came) is
called exactly once by the data plane; later calls do nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from ..http.messages import Response, error_response
from ..tenancy.estimate import Estimator
from ..tenancy.interfaces import RATE_LIMITED, Admission, Refusal, Tenancy, UsageRecord
from ..tenancy.model import Estimate, Tenant, Usage
from ..tenancy.ratelimit_headers import retry_after_header
from .usage import usage_counts

_NO_HEADERS: list[tuple[bytes, bytes]] = []
# What a request was charged on (llmgw_tenant_settled_total's label): the engine's usage; the estimate's prompt
# and what was sent (no usage: a stream broken off or left, an engine that reports none); nothing (no answer).
USAGE, SENT, NOTHING = "usage", "sent", "nothing"
SETTLE_BASES = (USAGE, SENT, NOTHING)


def _uncounted(basis: str) -> None:
    pass


class Charge:
    """One request's reservation (if its key is limited) and the usage record of its answer."""

    __slots__ = ("_tenancy", "_count", "tenant", "model", "estimate", "admission", "priority", "_open")

    def __init__(self, tenancy: Tenancy, tenant: Tenant, model: str, estimate: Estimate,
                 count: Callable[[str], None] = _uncounted) -> None:
        self._tenancy = tenancy
        self._count = count
        self.tenant = tenant
        self.model = model
        self.estimate = estimate
        self.admission: Admission | None = None  # set once the limiter admitted it (a limited key)
        self.priority: str | None = None  # the class the gateway's queue gave it: its usage row's class
        self._open = True

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """The ``x-ratelimit-*`` headers of its answer (none for a key without limits)."""
        admission = self.admission
        return admission.headers if admission is not None else _NO_HEADERS

    def unanswered(self) -> None:
        """No engine answered (no replica, every attempt failed, the client went away first): the reservation's
        tokens and money go back; nothing is recorded as usage."""
        if not self._open:
            return
        self._open = False
        admission = self.admission
        if admission is not None:
            admission.settle(None)
        self._count(NOTHING)

    def shed(self) -> None:
        """The gateway's queue answered it 429 (``rate_limit_exceeded``, overloaded): as :meth:`unanswered`, and
        counted refused in its usage row's 429 column (``refused_rate``), with the limits' own refusals."""
        if not self._open:
            return
        self.unanswered()
        self._tenancy.usage.refused(self.tenant, self.model, RATE_LIMITED, priority=self.priority)

    def answered(self, status: int, usage: Mapping[str, object] | None, sent_tokens: int | None) -> None:
        """An engine's answer ended with ``status``: settled with its ``usage`` when it has one; else (a stream
        broken off or left by its client, an engine that sent none) the estimate's prompt and what was sent:
        ``sent_tokens`` (at most; None: unknown, the estimate's output). An engine's error costs what its usage
        says, or nothing."""
        if not self._open:
            return
        self._open = False
        estimate = self.estimate
        prompt, cached, completion = usage_counts(usage) if usage is not None else (None, None, None)
        self._count(USAGE if (prompt is not None and completion is not None) or status not in (200, 499) else SENT)
        if status != 200 and status != 499:
            prompt = prompt or 0
            completion = completion or 0
        if prompt is None:
            prompt = estimate.prompt_tokens
        if completion is None:
            most = estimate.max_output_tokens
            completion = most if sent_tokens is None else min(max(sent_tokens, 0), most)
        cached = cached or 0
        tenancy = self._tenancy
        used = Usage(prompt, completion, cached, tenancy.prices.of(self.model).cost(prompt, cached, completion))
        admission = self.admission
        if admission is not None:
            admission.settle(used)
        tenant = self.tenant
        team = tenant.team
        tenancy.usage.record(UsageRecord(tenant.key_id, tenant.name, team.name if team is not None else None,
                                         self.model, used, status, time.time(), self.priority))


class TenancyGate:
    """A gateway's tenancy as the data plane uses it: the bundle, and the estimator of the same config."""

    __slots__ = ("tenancy", "estimator", "_count")

    def __init__(self, tenancy: Tenancy, max_model_len: Mapping[str, int] | None = None,
                 count: Callable[[str], None] = _uncounted) -> None:
        """``count(basis)``: one request settled on ``basis`` (one of :data:`SETTLE_BASES`)."""
        self.tenancy = tenancy
        self.estimator = Estimator(tenancy.settings, tenancy.prices, max_model_len)
        self._count = count

    def open(self, tenant: Tenant, model: str, path: str, body: Mapping[str, object], body_bytes: int) -> Charge:
        """The charge of a request of ``tenant`` (not yet admitted: see :meth:`admit`)."""
        return Charge(self.tenancy, tenant, model, self.estimator.estimate(model, path, body, body_bytes),
                      self._count)

    async def admit(self, charge: Charge) -> Response | None:
        """Reserve a limited key's request against its limits: None when admitted (the charge holds the
        admission), else the 429 to answer."""
        tenancy = self.tenancy
        admitted = await tenancy.limiter.admit(charge.tenant, charge.model, charge.estimate)
        if isinstance(admitted, Refusal):
            tenancy.usage.refused(charge.tenant, charge.model, admitted.error_type)
            return refusal_response(admitted)
        charge.admission = admitted
        return None


def refusal_response(refusal: Refusal) -> Response:
    """A refusal in OpenAI's shape: ``{"error": {"type": "rate_limit_exceeded" | "insufficient_quota", "code":
    the same, "message": ...}}`` with ``Retry-After`` and the limiter's ``x-ratelimit-*`` headers."""
    headers = list(refusal.headers)
    if not any(name == b"retry-after" for name, _ in headers):
        headers.append(retry_after_header(refusal.retry_after))
    return error_response(refusal.status, refusal.message, code=refusal.error_type, type_=refusal.error_type,
                          headers=headers)
