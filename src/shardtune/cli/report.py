"""`shardtune report`: PNG plots and a markdown summary of one or more runs."""

from __future__ import annotations

from pathlib import Path

from shardtune.cli.argtypes import fs_path
from shardtune.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="PNG plots and a markdown summary of one or more runs")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", type=fs_path, help="output folders of runs (overlaid)")
    p.add_argument("--out", type=fs_path, help="folder for the plots and report.md (default: RUN_DIR/report, or "
                     "./report-compare for several runs)")


def run(args) -> int:
    from shardtune.checkpoint.folders import run_weights
    from shardtune.telemetry.report import write_report

    def model_step(run: Path) -> int | None:  # what `eval RUN --generate` scores now
        picked = run_weights(run)
        return picked.step if picked is not None else None

    runs = [Path(r) for r in args.runs]
    seen: dict[Path, str] = {}
    for given, path in zip(args.runs, runs, strict=True):
        if path.resolve() in seen:  # its curves drawn twice, as two runs
            raise UserError(f"run {given!r} is given twice ({seen[path.resolve()]!r}); give each run once")
        seen[path.resolve()] = given
    out = Path(args.out) if args.out else (runs[0] / "report" if len(runs) == 1 else Path("report-compare"))
    print(f"report written to {write_report(runs, out, model_step)}")
    return 0
