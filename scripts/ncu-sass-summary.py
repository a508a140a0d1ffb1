#!/usr/bin/env python3
"""Summarise an `ncu --page source --print-source sass --csv` export of one kernel: warp-level
instructions executed by opcode class, and the hottest instructions (scripts/gpu-ncu-source.sh)."""
import csv
import sys
from collections import Counter

path = sys.argv[1]
with open(path, newline="") as f:
    lines = f.read().splitlines()
# the CSV starts at its header row (ncu may print a kernel line before it)
start = next((i for i, l in enumerate(lines) if l.startswith('"#"') or l.startswith('"Address"') or '"Source"' in l), None)
if start is None:
    print(f"{path}: no source table ({len(lines)} lines)")
    print("\n".join(lines[:5]))
    sys.exit(0)
rows = list(csv.DictReader(lines[start:]))
cols = rows[0].keys() if rows else []
exec_col = next((c for c in cols if c.startswith("Instructions Executed") or c == "Warp Instructions Executed" or c.startswith("inst_executed")), None)
samp_col = next((c for c in cols if c.startswith("Warp Stall Sampling (All")), None)
src_col = "Source" if "Source" in cols else next(iter(cols))
if exec_col is None:
    print(f"{path}: columns {list(cols)}")
    sys.exit(0)


def num(s):
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return 0.0


by_op, samp_op = Counter(), Counter()
total = samp_total = 0.0
for r in rows:
    n = num(r[exec_col])
    src = r[src_col].strip()
    op = src.split()[0] if src else "?"
    if op.startswith("@"):
        op = src.split()[1] if len(src.split()) > 1 else op
    op = op.split(".")[0]
    by_op[op] += n
    total += n
    if samp_col:
        s = num(r[samp_col])
        samp_op[op] += s
        samp_total += s
print(f"== {path}: {total:,.0f} warp instructions, {len(rows)} SASS lines" + (f", {samp_total:,.0f} stall samples" if samp_col else ""))
for op, n in by_op.most_common(24):
    extra = f"  samples {100 * samp_op[op] / samp_total:5.1f}%" if samp_col and samp_total else ""
    print(f"   {op:<12} {n:>12,.0f}  {100 * n / total:5.1f}%{extra}")
if samp_col and samp_total:
    print("   hottest by stall samples:")
    for r in sorted(rows, key=lambda r: -num(r[samp_col]))[:25]:
        print(f"     {num(r[samp_col]):>7,.0f}  exec {num(r[exec_col]):>9,.0f}  {r[src_col].strip()[:90]}")
