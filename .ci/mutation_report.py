"""Kill rate per module of the last `mutmut run` (see .ci/mutation and docs/mutation-testing.md).

A mutant is killed when a test failed on it or it ran past mutmut's time limit (a mutant that
loops forever); it survived when every test that reaches its function passed, or when no test
reaches it. Mutants that docs/mutation-testing.md lists as equivalent (no test can tell them from
the code: same behaviour, different text) are counted apart; the kill rate is over the others.
Survivors that the document does not list are printed by name: each needs a test or a reason.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

DOC = Path("docs/mutation-testing.md")
KILLED = {"killed", "timeout"}
_ROW = re.compile(r"^\| (`[^`]+`(?:, `[^`]+`)*) \| (.+) \|$")  # | `name`, `name` | reason |


def equivalents() -> dict[str, str]:
    lines = DOC.read_text().splitlines() if DOC.exists() else []
    return {name.strip("`"): m.group(2) for line in lines if (m := _ROW.match(line))
            for name in m.group(1).split(", ")}


def verdicts() -> dict[str, str]:
    out = subprocess.run(["mutmut", "results", "--all", "true"], check=True, text=True,
                         capture_output=True).stdout
    by_hand = Path("mutants/abort-path.txt")  # the abort path, run outside mutmut (.ci/mutation)
    if by_hand.exists():
        out += "\n" + by_hand.read_text()
    pairs = (line.strip().rsplit(": ", 1) for line in out.splitlines() if ": " in line)
    return {name: status for name, status in pairs if status != "not checked"}


def module_of(mutant: str) -> str:
    return re.split(r"\.x(?:ǁ|_)", mutant, maxsplit=1)[0]


def main() -> int:
    listed, counts, unexplained = equivalents(), defaultdict(Counter), []
    for name, status in sorted(verdicts().items()):
        module = module_of(name)
        if status in KILLED:
            counts[module]["killed"] += 1
        elif name in listed:
            counts[module]["equivalent"] += 1
        else:
            counts[module]["survived"] += 1
            unexplained.append(f"{name}: {status}")
    print("| module | mutants | killed | equivalent | survived | kill rate |")
    print("| --- | --- | --- | --- | --- | --- |")
    for module, c in sorted(counts.items()):
        judged = c["killed"] + c["survived"]
        rate = f"{100 * c['killed'] / judged:.1f}%" if judged else "-"
        print(f"| {module} | {judged + c['equivalent']} | {c['killed']} | {c['equivalent']} "
              f"| {c['survived']} | {rate} |")
    if unexplained:
        print("\nSurvivors with no test and no listed reason:")
        print("\n".join(unexplained))
    return 0


if __name__ == "__main__":
    sys.exit(main())
