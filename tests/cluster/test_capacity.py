"""An engine's placement group that no node of the cluster can hold fails the application
builder at once (naming what it needs and what the nodes have) unless an autoscaler could add a
node; nothing is deployed here."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from cluster import capacity
from cluster.capacity import check_capacity, need
from cluster.ray_executor import engine_bundles

pytestmark = pytest.mark.ray


@pytest.fixture
def no_autoscaler(ray_cluster):
    """The local cluster's monitor reports its (read-only) node types a few seconds in."""
    deadline = time.monotonic() + 30
    while capacity.autoscaler_may_add_nodes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not capacity.autoscaler_may_add_nodes()


def test_one_node_must_hold_the_sum_under_strict_pack_else_the_largest_bundle():
    bundles = [{"GPU": 1, "CPU": 1}, {"GPU": 1, "CPU": 1}, {"CPU": 2}]
    assert need(bundles, "STRICT_PACK") == {"GPU": 2, "CPU": 4}
    assert need(bundles, "PACK") == {"GPU": 1, "CPU": 2}


def test_a_group_that_fits_passes_and_one_that_never_fits_names_both_sides(no_autoscaler):
    check_capacity(engine_bundles(2, True), "STRICT_PACK", "tp 2")
    with pytest.raises(ValueError) as e:
        check_capacity(engine_bundles(64, True), "STRICT_PACK", "tp 64")
    assert "GPU 64" in str(e.value) and "deploy/dflash-demo.yaml" in str(e.value)
    assert "the cluster's nodes have: CPU 8" in str(e.value)


def test_with_an_autoscaler_it_warns_once_and_goes_on(ray_cluster, monkeypatch, caplog):
    monkeypatch.setattr(capacity, "autoscaler_may_add_nodes", lambda: True)
    check_capacity(engine_bundles(64, True), "STRICT_PACK", "tp 64")
    assert [r.levelname for r in caplog.records if "tp 64" in r.getMessage()] == ["WARNING"]


def test_the_app_builder_fails_before_any_download_when_no_node_holds_the_engine(no_autoscaler):
    from deploy.app import app_builder

    config = yaml.safe_load(Path("deploy/dflash.yaml").read_text())
    args = {**config["applications"][0]["args"], "tp": 8, "draft_placement": "separate"}
    with pytest.raises(ValueError, match="GPU 9 on one node"):
        app_builder(args)
