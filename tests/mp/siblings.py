"""The rules for one room across its ranks, as the tests judge them (a
module for fault_check.py and netns_cut.py; tools/verdict.h holds the same
rules for the demo's own verdict, and says why each one holds).

A room's ranks are every decode rank and the prefill ranks of the room's
DP group.  Each is given as a dict: side ("prefill"/"decode"), rank,
state ("Success"/"Failed"), killed (bool: the demo's record, not the
rank's), failure (the record, or None).
"""
import re

# host:port, as reasons name a rank: "prefill rank 0 (127.0.0.1:41000)".
_ADDR = re.compile(r"(?<![\w.-])([\w.-]+:\d{1,5})(?![\w])")


def names(record):
    """The ranks a failure record names: its origin, and every host:port
    in its reason."""
    got = set(_ADDR.findall(record.get("reason") or ""))
    if record.get("origin_addr"):
        got.add(record["origin_addr"])
    return got


def one_state(ranks):
    """Every rank ends as the others do; a side whose ranks all succeeded
    may keep SUCCESS when every failed rank is on the other side, names a
    cause on its own side, and the succeeding side lost no rank.  Returns
    None, or why not."""
    live = [r for r in ranks if not r.get("killed")]
    failed = {r["side"] for r in live if r["state"] == "Failed"}
    ok = {r["side"] for r in live if r["state"] == "Success"}
    if not failed or not ok:
        return None
    killed = {r["side"] for r in ranks if r.get("killed")}
    if (len(failed) == 1 and not failed & ok and not killed & ok and
            all((r["failure"] or {}).get("origin_side") == r["side"]
                for r in live if r["state"] == "Failed")):
        return None
    return "its ranks disagree: " + ", ".join(
        "%s[%s] %s%s" % (r["side"], r["rank"], r["state"], " (killed)" if r.get("killed") else "")
        for r in ranks)


def one_cause(ranks):
    """Every FAILED rank that was not killed has a reason, none "unknown
    reason", and all their records (a stopped rank's aside) name one rank
    in common.  Returns (common, why):
    the set of ranks every record names, and None or why not."""
    judged = [r for r in ranks if not r.get("killed")]  # the demo's records
    # A stopped rank heard only what its peers told it before they gave up
    # on it; its reason must still be one, but needs no rank in common.
    ranks = [r for r in judged if not r.get("stopped")]
    for r in judged:
        why = (r["failure"] or {}).get("reason") or ""
        if r["state"] == "Failed" and (not why or "unknown reason" in why.lower()):
            return set(), "%s[%s] FAILED without a reason, or an unknown one: %r" % (
                r["side"], r["rank"], why)
    records = [r["failure"] or {} for r in ranks if r["state"] == "Failed"]
    for r in ranks:
        if r["state"] != "Failed":
            continue
        why = (r["failure"] or {}).get("reason") or ""
        if not why:
            return set(), "%s[%s] FAILED without a reason" % (r["side"], r["rank"])
        if "unknown reason" in why.lower():
            return set(), "%s[%s] FAILED for an unknown reason: %r" % (r["side"], r["rank"], why)
    if not records:
        return set(), None
    common = set.intersection(*(names(f) for f in records))
    if not common:
        return common, "its failure records name no rank in common: " + "; ".join(
            "%s[%s] from %s: %r" % (r["side"], r["rank"], (r["failure"] or {}).get("origin_addr"),
                                    ((r["failure"] or {}).get("reason") or "")[:120])
            for r in ranks if r["state"] == "Failed")
    return common, None
