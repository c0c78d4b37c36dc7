#!/usr/bin/env python3
"""Projection of allocations/s and reads/s at more cores, from lock section
times measured on this machine (bench/locks.py). The model and its
assumptions are explained in docs/performance.md; this file is the
arithmetic, so that the projection can be recomputed from new figures.

Standalone:
  bench/model.py --begin 229 --finish 64 --end 336 --copy 325 --slots 2.5 \\
      --view 650 --alloc-per-core 7800 --read-per-core 19000
(times in ns; slots: active backend slots a copy visits; rates per core per
second, from a cell where writers and readers run together).
"""
import argparse
import math

# Assumptions (docs/performance.md, "Assumptions").
LINE_NS = 100  # moving one cache line that another core wrote last
LINES_PER_SECTION = 4  # lock word, change counter and header, stream state, ring or slot
SLOT_NS = 50  # one more active slot to copy (a line another core wrote; misses overlap)
WAKE_NS = 5_000  # an LWLock waiter that had to sleep: semaphore wake-up to running
U_MAX = 0.7  # exclusive utilisation beyond which waiting exceeds the hold time
ATOMIC_NS = 100  # an atomic read-modify-write on a contended cache line
LOCK_FREE_TRIES = 8  # visibility.rs


def exclusive_ns(t):
    """Lock time one allocation needs: its three exclusive sections (begin,
    finish, commit), each pulling the cache lines it writes from the core
    that wrote them last."""
    return t["begin"] + t["finish"] + t["end"] + 3 * LINES_PER_SECTION * LINE_NS


def active_slots(t, allocs_per_s):
    """Active backend slots a reader visits: in-flight transactions, which
    grow with the allocation rate (Little's law, same transaction length as
    measured)."""
    return t["slots"] * allocs_per_s / t["alloc_measured"]


def gap_wait_ns(shared_per_s, hold_ns):
    """Mean wait of an exclusive request for a moment with no shared holder,
    shared holders arriving at random (Poisson) and holding hold_ns each,
    without writer preference (PostgreSQL's LWLock): ρ = R·t; with
    probability 1 − e^−ρ a holder is in, and the request sleeps until the
    busy period ends (mean (e^ρ − 1)/R), plus a wake-up."""
    if shared_per_s <= 0:
        return 0.0
    rho = shared_per_s * hold_ns * 1e-9
    busy_ns = (math.exp(rho) - 1) / shared_per_s * 1e9
    return (1 - math.exp(-rho)) * (busy_ns + WAKE_NS)


def project(t, alloc_per_core, read_per_core, cores, lock_free):
    """With `cores` cores running the measured mix of writers and readers:
    (allocations/s, reads/s, what limits each, details)."""
    a_demand = alloc_per_core * cores
    r_demand = read_per_core * cores
    x_ns = exclusive_ns(t)
    a = a_demand
    details = {}
    for _ in range(200):  # fixed point: waits depend on rates and back
        slots = active_slots(t, a)
        extra_ns = max(0.0, slots - t["slots"]) * SLOT_NS + LINES_PER_SECTION * LINE_NS
        if lock_free:
            copy_ns = t["copy"] + extra_ns
            # A try is thrown away when a section that moves entries (the
            # commit's; allocations only publish) overlaps it.
            end_ns = t["end"] + LINES_PER_SECTION * LINE_NS
            overlap = 1 - math.exp(-a * (copy_ns + end_ns) * 1e-9)
            fallback = overlap**LOCK_FREE_TRIES
            shared = r_demand * fallback
            hold = t["view"] + extra_ns
            details = dict(overlap=overlap, fallback=fallback, slots=slots, copy_ns=copy_ns)
        else:
            shared = min(r_demand, 1 / (2 * ATOMIC_NS * 1e-9))
            hold = t["view"] + extra_ns
            details = dict(slots=slots, view_ns=hold)
        wait = gap_wait_ns(shared, hold)
        details["gap_wait_ns"] = wait
        a_lock = U_MAX / ((x_ns + 3 * wait) * 1e-9)
        new_a = min(a_demand, a_lock)
        if abs(new_a - a) < 1:
            break
        a = (a + new_a) / 2
    if lock_free:
        # Thrown-away tries cost readers CPU: fewer reads per core.
        tries = sum(details["overlap"] ** k for k in range(LOCK_FREE_TRIES))
        per_read_ns = 1e9 / read_per_core
        wasted_ns = (tries - 1) * details["copy_ns"] + (details["copy_ns"] - t["copy"])
        r = r_demand * per_read_ns / (per_read_ns + wasted_ns)
        details["tries"] = tries
        read_limit = "cores" if wasted_ns < 0.05 * per_read_ns else "cores (and retried copies)"
    else:
        r_lock = 1 / (2 * ATOMIC_NS * 1e-9)
        r = min(r_demand, r_lock)
        read_limit = "cores" if r_demand <= r_lock else "the lock word"
    if a_demand <= a + 1:
        alloc_limit = "cores"
    elif details["gap_wait_ns"] > x_ns / 3:
        alloc_limit = "waiting for readers to leave"
    else:
        alloc_limit = "exclusive sections"
    return a, r, alloc_limit, read_limit, details


def table(t, alloc_per_core, read_per_core, core_counts=(2, 16, 64)):
    lines = [
        f"Exclusive lock time per allocation on many cores: {exclusive_ns(t):.0f} ns "
        f"(ceiling {U_MAX / (exclusive_ns(t) * 1e-9) / 1000:.0f}k allocations/s at {U_MAX:.0%} utilisation).",
        "",
        "| read path | cores | allocations/s | limited by | reads/s | limited by | active slots | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for lock_free in (False, True):
        for cores in core_counts:
            a, r, al, rl, d = project(t, alloc_per_core, read_per_core, cores, lock_free)
            if lock_free:
                note = (f"copy {d['copy_ns']:.0f} ns, {d['tries']:.1f} tries a read, "
                        f"{100 * d['fallback']:.2g} % fall back to the lock")
            else:
                note = f"view {d['view_ns']:.0f} ns; an exclusive section waits {d['gap_wait_ns'] / 1000:.2g} µs for readers"
            lines.append(
                f"| {'lock-free (seqlock)' if lock_free else 'shared LWLock'} | {cores} | {a / 1000:.0f}k | {al} "
                f"| {r / 1000:.0f}k | {rl} | {d['slots']:.1f} | {note} |"
            )
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    for name in ("begin", "finish", "end", "copy", "view"):
        ap.add_argument(f"--{name}", type=float, required=True, help="ns")
    ap.add_argument("--slots", type=float, required=True, help="active slots a copy visits, measured")
    ap.add_argument("--alloc-per-core", type=float, required=True)
    ap.add_argument("--read-per-core", type=float, required=True)
    args = ap.parse_args()
    t = {k: getattr(args, k) for k in ("begin", "finish", "end", "copy", "view", "slots")}
    t["alloc_measured"] = args.alloc_per_core * 2
    print(table(t, args.alloc_per_core, args.read_per_core))


if __name__ == "__main__":
    main()
