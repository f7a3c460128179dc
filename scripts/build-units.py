#!/usr/bin/env python3
"""The longest units of the last `cargo build --timings` (CI's build step
prints them beside its time): where the build's CPU went, unit by unit."""
import json
import re
import sys
from pathlib import Path

report = Path(sys.argv[1] if len(sys.argv) > 1 else "target/cargo-timings/cargo-timing.html")
count = int(sys.argv[2]) if len(sys.argv) > 2 else 15
try:
    text = report.read_text()
    units = json.loads(re.search(r"const UNIT_DATA = (\[.*?\]);\n", text, re.S).group(1))
except (OSError, AttributeError, ValueError) as error:
    print(f"build-units: no timings in {report}: {error}")
    sys.exit(0)
total = sum(unit["duration"] for unit in units)
print(f"== build units: {len(units)}, {total:.0f} s of CPU in all; the longest")
for unit in sorted(units, key=lambda unit: -unit["duration"])[:count]:
    target = unit.get("target", "").strip()
    print(f"  {unit['duration']:7.1f} s  {unit['name']} {target}")
