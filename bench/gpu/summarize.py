"""summary.md of a GPU suite results folder (bench/gpu/run.sh writes it after every stage): the
stages' status, the CUDA tests' outcome, the benchmark tables, the profile's top operators, the
planner's accuracy and the soak's verdict. Short enough to read in a terminal; the full files
stay in the folder (and its results.tar.gz).

    python bench/gpu/summarize.py RESULTS_DIR > RESULTS_DIR/summary.md
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def section(text: str, start: str, stop: str | None = None) -> str:
    """The lines of `text` from the first one starting with `start` up to one starting with `stop`."""
    lines = text.splitlines()
    begin = next((i for i, line in enumerate(lines) if line.startswith(start)), None)
    if begin is None:
        return ""
    end = next((i for i in range(begin + 1, len(lines)) if stop and lines[i].startswith(stop)), len(lines))
    return "\n".join(lines[begin:end]).strip()


def tests(results: Path) -> list[str]:
    xml = results / "cuda-tests.xml"
    if not xml.is_file():
        return ["no JUnit XML (the tests did not run or did not finish)"]
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    out = [f"{counts['tests']} tests: {counts['tests'] - counts['failures'] - counts['errors'] - counts['skipped']} "
           f"passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped "
           f"({float(suite.get('time', 0)):.0f} s)", ""]
    for case in suite.iter("testcase"):
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                message = (node.get("message") or node.text or "").strip().splitlines()
                out.append(f"- {kind}: `{case.get('name')}`: {message[0][:300] if message else ''}")
    records = sorted(p.name for p in (results / "tests").glob("*")) if (results / "tests").is_dir() else []
    if records:
        out += ["", f"records in tests/: {', '.join(records)}"]
    return out


def bench(path: Path) -> list[str]:
    text = path.read_text()
    table = section(text, "## Results", "## Runs")
    head = [line + "\n" for line in text.splitlines()[:6] if line.startswith(("# ", "model "))]
    return head + ([table] if table else ["(no table: the last lines of the output)", "```",
                                          *text.splitlines()[-8:], "```"])


def main() -> int:
    results = Path(sys.argv[1])
    out = [f"# GPU suite: {results.name}", ""]
    env = results / "env.txt"
    if env.is_file():
        out += ["```", *env.read_text().strip().splitlines()[:12], "```", ""]
    stages = results / "stages.tsv"
    rows = [line.split("\t") for line in stages.read_text().splitlines()] if stages.is_file() else []
    out += ["| stage | exit | seconds | output |", "|---|---|---|---|"]
    out += [f"| {' | '.join(r)} |" for r in rows]
    ran = {r[0] for r in rows}
    if "tests" in ran:
        out += ["", "## CUDA tests", "", *tests(results)]
    for name, file in (("llama", "vs_hf_llama.md"), ("opt", "vs_hf_opt.md")):
        if f"bench-{name}" in ran and (results / file).is_file():
            out += ["", f"## shardtune vs HF Trainer: {name}", "", *bench(results / file)]
    profile = results / "profile.md"
    if profile.is_file():
        out += ["", "## Profile", "", *profile.read_text().strip().splitlines()[2:]]
    plan = results / "plan_accuracy.md"
    if plan.is_file():
        out += ["", "## Planner accuracy", "", plan.read_text().strip()]
    float8 = results / "float8.md"
    if float8.is_file():
        out += ["", "## float8 vs bf16", "", *float8.read_text().strip().splitlines()[2:]]
    if "float8-tests" in ran and (results / "float8-tests.log").is_file():
        out += ["", "## float8 CUDA tests", "", *(results / "float8-tests.log").read_text().strip().splitlines()[-3:]]
    liger = results / "liger.md"
    if liger.is_file():
        out += ["", "## Liger-Kernel vs shardtune's own path", "", *liger.read_text().strip().splitlines()[2:]]
    if "liger-tests" in ran and (results / "liger-tests.log").is_file():
        out += ["", "## Liger CUDA tests", "", *(results / "liger-tests.log").read_text().strip().splitlines()[-3:]]
    chunks = results / "head_chunks.md"
    if chunks.is_file():
        out += ["", "## The head loss by chunk size", "", *chunks.read_text().strip().splitlines()[2:]]
    for title, file in (("The memory savers' speed order", "speed_order.md"), ("Where the NaN begins", "nan-origin.md"),
                        ("Liger-Kernel bisect", "liger_bisect.md")):
        if (results / file).is_file():  # their verdicts are their last lines
            out += ["", f"## {title}", "", *(results / file).read_text().strip().splitlines()[-25:]]
    soak = results / "soak.md"
    if soak.is_file():
        out += ["", "## Soak", "", *soak.read_text().strip().splitlines()[-6:]]
    sums = [json.loads(p.read_text()) for p in sorted(results.glob("vs_hf_*.json"))]
    if sums:  # one line per benchmark for a quick look
        out += ["", "## In one line each", ""]
        out += [f"- {s['setup']} on {s['device']}: " + "; ".join(
            f"{k} {v}" for r in s["results"] for k, v in r.items() if "tok/s" in k or "ratio" in k or "MFU" in k)
            for s in sums]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
