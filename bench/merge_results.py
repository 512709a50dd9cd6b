"""Merge several suite JSONs (runs of one commit on one machine) into one results file.

Later files fill in items the earlier ones did not run; an item measured in several files
keeps the first measurement that succeeded. The summary is recomputed.

    python bench/merge_results.py OUT.json FIRST.json MORE.json ...
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402


def merge(paths):
    runs = [json.load(open(p)) for p in paths]
    data = runs[0]
    order, best = [], {}
    for run in runs:
        for item in run["results"]:
            key = (item["workload"], item["dtype"], item["impl"])
            if key not in best:
                order.append(key)
                best[key] = item
            elif best[key].get("status") != "ok" and item.get("status") == "ok":
                best[key] = item
        data["workloads"].update(run.get("workloads", {}))
    data["results"] = [best[k] for k in order]
    data["meta"]["merged_from"] = [r["meta"]["args"] for r in runs]
    data["summary"] = report.summarize(data)
    return data


def main(argv):
    out, *paths = argv
    data = merge(paths)
    with open(out, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
    print(f"wrote {out}: {len(data['results'])} items from {len(paths)} runs")


if __name__ == "__main__":
    main(sys.argv[1:])
