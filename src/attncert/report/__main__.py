"""The report's commands.

    python -m attncert.report summary   # reports/metrics/summary.json from every stage's metrics
    python -m attncert.report readme    # the results sections of README.md and docs/results.md
    python -m attncert.report html      # reports/html/: each executed notebook and index.html
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from attncert.pipeline.dvcfile import DVC_FILE, read_stages, stage_runs
from attncert.pipeline.params import PARAMS_FILE
from attncert.report.htmlexport import html_export
from attncert.report.readme import README_FILE, RESULTS_FILE, update_readme
from attncert.stages import figures as figures_stage
from attncert.stages.registry import load_params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attncert.report",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=("summary", "readme", "html"))
    ap.add_argument("--params", default=PARAMS_FILE)
    ap.add_argument("--dvc", default=DVC_FILE)
    ap.add_argument("--readme", default=README_FILE)
    ap.add_argument("--results", default=RESULTS_FILE, help="readme: the full results page")
    ap.add_argument("--force", action="store_true", help="html: export every page again")
    args = ap.parse_args(argv)
    params = load_params(args.params)
    fig = params["figures"]
    if args.command == "readme":
        changed = update_readme(args.readme, fig.summary, args.results)
        print(f"{args.readme}, {args.results}: results sections "
              f"{'updated' if changed else 'unchanged'}")
        return 0
    stages = read_stages(args.dvc)
    if args.command == "summary":
        figures_stage.write_summary(fig.summary, figures_stage.summary(
            params, stages, required=fig.required))
        print(f"wrote {fig.summary}")
        return 0
    data = json.loads(Path(fig.summary).read_text()) if Path(fig.summary).is_file() else None
    pages = html_export(stage_runs(stages, params), fig.html_dir, data, force=args.force)
    print(f"{fig.html_dir}: {len(pages)} page(s) written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
