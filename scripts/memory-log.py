#!/usr/bin/env python3
"""Reads a cubecl memory log (`[memory.logger] level = "full"` in a cubecl.toml) and prints
the most bytes a run's tensors held at once on the device, against the most its pools reserved.

cubecl logs every reservation of its main device memory with the allocator's usage report
right after it; bytes in use only grow at a reservation, so the largest figure reported after
one is the run's peak in use (what PyTorch calls `max_memory_allocated`), and the largest
reserved figure the pools' peak (`max_memory_reserved`). Staging and uniform buffers, kept
by the runtime beside the pools, are left out, as PyTorch's figures leave out its context.
cubecl keeps one memory per stream (per thread that issues work) and the log does not say
which: where several streams allocate, this reads the largest single report, not their sum.

    python3 scripts/memory-log.py RUN/cubecl-memory.log
"""

import re
import sys

UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
RESERVATION = re.compile(r"^\[(?P<name>[^\]]+)\],? (Reserved|Allocated)")
FIGURE = re.compile(r"^\s+(?P<what>Bytes in use|Total bytes reserved): (?P<value>[\d.]+) (?P<unit>[KMGT]?B)$")


def main(path: str) -> None:
    name = None
    in_summary = False
    usage = {}
    series = []  # (bytes in use, bytes reserved) after each reservation of the main memory
    largest = 0.0
    with open(path, errors="replace") as log:
        for line in log:
            line = line.rstrip("\n")
            match = RESERVATION.match(line)
            if match:
                name = match.group("name")
                in_summary = False
                reserved = re.search(r"Reserved memory ([\d.]+) ([KMGT]?B)", line)
                if reserved and name == "Main GPU Memory":
                    largest = max(largest, float(reserved.group(1)) * UNITS[reserved.group(2)])
                continue
            if line.startswith("## Summary"):
                in_summary, usage = True, {}
                continue
            figure = FIGURE.match(line) if in_summary else None
            if figure:
                usage[figure.group("what")] = float(figure.group("value")) * UNITS[figure.group("unit")]
                if len(usage) == 2:
                    in_summary = False
                    if name == "Main GPU Memory":
                        series.append((usage["Bytes in use"], usage["Total bytes reserved"]))
    if not series:
        sys.exit(f"{path}: no usage reports of the main GPU memory (is the memory logger at `full`?)")
    peak_use = max(u for u, _ in series)
    peak_reserved = max(r for _, r in series)
    mib = 2**20
    print(
        f"cubecl memory log ({len(series)} reservations): peak in use {peak_use / mib:.1f} MiB, "
        f"pools' peak reserved {peak_reserved / mib:.1f} MiB "
        f"({peak_reserved / peak_use:.2f}x), largest allocation {largest / mib:.1f} MiB"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: memory-log.py CUBECL_MEMORY_LOG")
    main(sys.argv[1])
