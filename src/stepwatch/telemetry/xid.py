"""What an XID error means and what to do about it.

NVML reports only the XID number (``nvmlEventTypeXidCriticalError``); the meanings come from
NVIDIA's Xid catalog (https://docs.nvidia.com/deploy/xid-errors/, "Xid Errors" and its catalog
table). Rows, severities and actions: the reference sheet's "XID Error Reference" (B.4).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Xid:
    code: int
    name: str
    # The reference's severity: "CRITICAL", "HIGH", "LOW".
    level: str
    action: str


XIDS: dict[int, Xid] = {
    x.code: x
    for x in (
        Xid(48, "DBE (double-bit ECC error)", "CRITICAL",
            "Evacuate the workload immediately; hardware replacement required."),
        Xid(63, "ECC page retirement needed", "HIGH", "Schedule maintenance; retire the affected pages."),
        Xid(74, "NVLink error", "HIGH", "Check cables and the peer GPU; disable the link if it persists."),
        Xid(79, "GPU failure requiring reset (fallen off the bus)", "CRITICAL",
            "GPU reset required; drain the job from the node."),
        Xid(80, "Correctable SBE (single-bit ECC)", "LOW", "Monitor the rate; alert above 1,000/hour."),
        Xid(94, "Contained ECC error, not corrected", "HIGH", "Drain the node after the workload ends."),
        Xid(95, "Uncontained ECC error (possible data loss)", "CRITICAL", "Evacuate immediately."),
    )
}

# Finding severity for the reference's levels.
SEVERITY = {"CRITICAL": "critical", "HIGH": "warning", "LOW": "info"}


def describe(code: int) -> tuple[str, str, str]:
    """(name, finding severity, action) for an XID; unknown codes point at the catalog."""
    x = XIDS.get(int(code))
    if x is None:
        return (
            f"XID {code} (not in stepwatch's table)",
            "warning",
            "Look it up in NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors) and check "
            "`dmesg -T | grep -i xid` on the node.",
        )
    return x.name, SEVERITY[x.level], x.action
