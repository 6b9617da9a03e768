"""What the gateway does with a reservation's word on spend: remember it for the cascade's
budget policy, show it in the metrics, and on a soft budget's first crossing in a period,
log it, count it and POST the webhook (off the request path)."""

import logging
import time
from typing import TYPE_CHECKING

from quota.budget import NANOS
from quota.limiter import Reservation
from quota.models import Tenant

if TYPE_CHECKING:
    from gateway.gateway import Gateway

log = logging.getLogger(__name__)


def note_spend(
    gw: "Gateway",
    holder: Tenant,
    key_id: str | None,
    reservation: Reservation,
    tenant_id: str | None = None,
) -> None:
    """`holder`: the tenant, or a key's own quota holder (`tenant_id` then names its
    tenant). Does nothing for a holder without a budget."""
    budget = holder.budget
    if budget is None or not reservation.checked:
        return
    tenant_id = tenant_id or holder.tenant_id
    is_key = tenant_id != holder.tenant_id
    spent = reservation.spent_nanos
    gw.spend.note(holder.tenant_id, spent)
    metrics = gw.metrics
    if metrics is not None and not is_key and budget.hard_nanos:
        label = metrics.tenant(tenant_id)
        metrics.budget_remaining.labels(label).set(max(0, budget.hard_nanos - spent) / NANOS)
        metrics.budget_spent_ratio.labels(label).set(spent / budget.hard_nanos)
    if not reservation.soft_crossed:
        return
    who = f"key {key_id} of tenant {tenant_id}" if is_key else f"tenant {tenant_id}"
    log.warning(
        "budget: %s crossed its soft budget (%.6f of %.6f %s this %s period)",
        who,
        spent / NANOS,
        (budget.soft_nanos or 0) / NANOS,
        gw.prices.currency,
        budget.period,
    )
    if metrics is not None:
        metrics.budget_soft_crossings.labels(metrics.tenant(tenant_id)).inc()
    payload = gw.webhook.payload(
        "key" if is_key else "tenant",
        tenant_id,
        key_id if is_key else None,
        budget,
        spent,
        time.time(),
    )
    gw.spawn(gw.webhook.send(payload))
