"""docs/grafana/kvbridge.json is a dashboard Grafana can import: valid JSON, panels with a place
and a query each, and only metric names docs/operations.md documents. (Which of them the
daemons expose is checked against live ones by StoreObs.GrafanaDashboardUsesOnlyExposedMetrics.)
"""

from __future__ import annotations

import json
import re

from conftest import REPO

NAME = re.compile(r"\bkvbridge_(?:master|node)_[a-z_]+")


def test_dashboard_is_importable_and_documented():
    dash = json.loads((REPO / "docs/grafana/kvbridge.json").read_text())
    assert dash["title"] and dash["uid"] and dash["schemaVersion"] >= 30
    assert dash["panels"], "no panels"
    documented = set(re.findall(r"`(kvbridge_[a-z_]+)`",
                                (REPO / "docs/operations.md").read_text()))
    ids = set()
    for panel in dash["panels"]:
        assert panel["id"] not in ids, f"panel id {panel['id']} repeats"
        ids.add(panel["id"])
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            for name in NAME.findall(target["expr"]):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                assert name in documented or base in documented, (
                    f"panel {panel['title']!r} queries {name}, which docs/operations.md "
                    "does not document")
