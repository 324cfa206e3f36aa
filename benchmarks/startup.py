"""Where a command's first seconds go: when each stderr line of `mdcli ask-many` appears, and what
the imports before the model loads cost.

    python benchmarks/startup.py --repeats 3
    python benchmarks/startup.py --repeats 5 --check-record

Runs, alternating, `ask-many` with --progress (the "loading" line is printed before torch is
imported, as on a terminal) and without (the loader prints it when it starts, after the imports),
and reports per run: seconds to the first stderr line, to the header (model loaded), and to the
end. Then one `python -X importtime` run: the cumulative import time of the heavy modules.

With --check-record it alternates instead runs that find the record of the embedded .gguf's
bit-for-bit check (mdcli.models.block_checks) with runs that start without it, both with
--progress. Before each of the latter every record in the folder is removed, so that run checks
the whole file and writes its record again, as every load did before records were kept.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "mdcli", "ask-many", "examples/story.txt", "-q", "Who?", "-n", "1", "--plain"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
sys.path.insert(0, str(ROOT))  # this tree's mdcli, for the cache folder's place
from mdcli import settings  # noqa: E402
from mdcli.models import block_checks  # noqa: E402

HEAVY = ("mdcli.cli.app", "mdcli.api", "torch", "transformers", "pydantic", "mdcli.models.load", "mdcli.core.engine")


def timed_lines(extra: list[str]) -> dict[str, float]:
    """Seconds from start to the first stderr line, to the header line, and to the exit."""
    start = time.perf_counter()
    process = subprocess.Popen(COMMAND + extra, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    seen: dict[str, float] = {}
    for line in process.stderr:
        now = time.perf_counter() - start
        seen.setdefault("first line", now)
        if " · " in line and "header" not in seen:
            seen["header"] = now
    process.wait()
    seen["end"] = time.perf_counter() - start
    return seen


def import_times() -> dict[str, float]:
    """Cumulative import seconds of HEAVY modules in one `-X importtime` run of the command."""
    result = subprocess.run([sys.executable, "-X", "importtime", *COMMAND[1:]], cwd=ROOT, env=ENV,
                            capture_output=True, text=True)
    times = {}
    for line in result.stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \|\s*(\S+)$", line)
        if match and match.group(2) in HEAVY:
            times[match.group(2)] = int(match.group(1)) / 1e6
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check-record", action="store_true",
                        help="runs with the .gguf check's record against runs without it, instead")
    args = parser.parse_args()
    if args.check_record:
        records = settings.current().mdcli_cache / block_checks.FOLDER
        timed_lines(["--progress"])  # writes the record if none is there yet
        runs = {"check recorded": [], "check run (record removed first)": []}
        for _ in range(args.repeats):  # alternate, so a busy machine slows both alike
            runs["check recorded"].append(timed_lines(["--progress"]))
            for record in records.glob("*.json"):
                record.unlink()
            runs["check run (record removed first)"].append(timed_lines(["--progress"]))
        return print_runs(runs)
    runs = {"announced (--progress)": [], "at load (before)": []}
    for _ in range(args.repeats):  # alternate, so a busy machine slows both alike
        runs["announced (--progress)"].append(timed_lines(["--progress"]))
        runs["at load (before)"].append(timed_lines([]))
    print_runs(runs)
    print()
    print("| module (cumulative import) | s |")
    print("|---|---|")
    for module, seconds in sorted(import_times().items(), key=lambda item: -item[1]):
        print(f"| `{module}` | {seconds:.2f} |")


def print_runs(runs: dict[str, list[dict[str, float]]]) -> None:
    print("| run | median s to first line | to header (model loaded) | to exit |")
    print("|---|---|---|---|")
    for name, results in runs.items():
        cells = [statistics.median(r[key] for r in results) for key in ("first line", "header", "end")]
        print(f"| {name} | " + " | ".join(f"{cell:.2f}" for cell in cells) + " |")


if __name__ == "__main__":
    main()
