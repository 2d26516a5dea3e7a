"""The hot path: hierarchical quota checks in one Redis round trip. No Django import.

    from quotas.engine import QuotaEngine, QuotaExceeded
    engine = QuotaEngine.from_url(redis_url)
"""

from .decision import (
    Decision,
    LimitState,
    PolicyNotLoaded,
    QuotaBackendUnavailable,
    QuotaError,
    QuotaExceeded,
    Settlement,
    UnknownAgent,
    UnknownLease,
    UnknownOrg,
    UnknownReservation,
)
from .engine import Admitted, Lease, QuotaEngine
from .keys import Keys

__all__ = [
    "Admitted",
    "Decision",
    "Keys",
    "Lease",
    "LimitState",
    "PolicyNotLoaded",
    "QuotaBackendUnavailable",
    "QuotaEngine",
    "QuotaError",
    "QuotaExceeded",
    "Settlement",
    "UnknownAgent",
    "UnknownLease",
    "UnknownOrg",
    "UnknownReservation",
]
