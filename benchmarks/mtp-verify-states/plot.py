"""The plot of reports/mtp-verify-states/README.md: verify cost against one decode step, before and after, from
that folder's ab-*.json."""

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).resolve().parents[2] / "reports" / "mtp-verify-states"
fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
for ax, name in zip(axes, ("ab-4-layers.json", "ab-16-layers.json"), strict=True):
    rows = json.loads((here / name).read_text())
    for label, style in (("base", "o--"), ("new", "o-")):
        r = [x for x in rows if x["label"] == label]
        step = statistics.median(x["verify_s"]["1"] for x in r)
        for key, what in (("verify_s", "all kept"), ("verify_rollback_s", "rolled back to 1")):
            ys = [statistics.median(x[key][t] for x in r) / step for t in "1234"]
            ax.plot([1, 2, 3, 4], ys, style, alpha=1.0 if key == "verify_s" else 0.5,
                    label=f"{'before' if label == 'base' else 'after'}, {what}")
    ax.set_title(rows[0]["checkpoint"])
    ax.set_xlabel("tokens verified")
    ax.set_xticks([1, 2, 3, 4])
    ax.grid(alpha=0.3)
axes[0].set_ylabel("seconds / one decode step")
axes[0].legend(fontsize=8)
fig.tight_layout()
fig.savefig(here / "verify.png", dpi=110)
