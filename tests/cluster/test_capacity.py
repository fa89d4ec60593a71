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


def test_a_ray_started_here_fails_at_once_without_waiting_for_its_monitor(ray_cluster):
    """`dflash-serve serve` knows the Ray it started gains no nodes: no autoscaler report
    needed (the monitor's first one comes seconds later)."""
    with pytest.raises(ValueError, match="no autoscaler can add one"):
        check_capacity(engine_bundles(64, True), "STRICT_PACK", "tp 64", may_grow=False)


@pytest.mark.parametrize("address", [None, "10.0.0.1:6379"])
def test_serve_checks_the_placement_once_ray_is_up(monkeypatch, capsys, tiny_demo, address):
    """`dflash-serve serve` asks the cluster after ray.init (the application builder ran
    before Ray was up): a Ray it started itself cannot grow, a joined one is asked; a group
    that fits nowhere exits 2 with the message, Ray shut down."""
    import deploy.app
    import deploy.cli
    import deploy.process_tree

    seen, calls = {}, []

    real = deploy.app.check_placement  # the builder's call, before Ray is up: a no-op

    def refuse(sargs, cfg=None, may_grow=None):
        if "init" not in calls:
            return real(sargs, cfg, may_grow)
        seen["may_grow"] = may_grow
        raise ValueError("this application needs GPU 64 on one node per replica")

    monkeypatch.setattr(deploy.cli, "setup_logging", lambda: None)  # the process's logging
    monkeypatch.setattr(deploy.cli, "_init_ray", lambda *a, **k: calls.append("init"))
    monkeypatch.setattr(deploy.app, "check_placement", refuse)
    monkeypatch.setattr(deploy.cli, "local_only_ray", lambda: None)
    monkeypatch.setattr(deploy.process_tree, "become_subreaper", lambda: None)
    monkeypatch.setattr("deploy.proxy_auth.proxy_env", lambda key: {})
    monkeypatch.setattr("ray.shutdown", lambda: calls.append("shutdown"))
    target, draft = map(str, tiny_demo)
    argv = ["serve", target, "--draft-model", draft, "--device", "cpu", "--port", "0"]
    assert deploy.cli.main(argv + (["--address", address] if address else [])) == 2
    assert seen["may_grow"] is (None if address else False)
    assert calls == ["init", "shutdown"]
    assert "needs GPU 64 on one node" in capsys.readouterr().err
