"""configs/kernels.py: every kernel choice is a validated field of KernelConfig, plain values
that import no model code; which kernel each takes on a device is target/kernels/selection.py's
(tests/target/test_kernel_selection.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from configs.engine import EngineConfig
from configs.kernels import KernelConfig, parse_choices


@pytest.mark.parametrize("field,name", [("attention", "attention_backend"),
                                        ("attention_prologue", "attention_prologue"),
                                        ("moe", "moe_backend"),
                                        ("moe_routing", "moe_routing"),
                                        ("gdn_rounds", "gdn_rounds"),
                                        ("gdn_recurrence", "gdn_recurrence"),
                                        ("gdn_prologue", "gdn_prologue"),
                                        ("pdl", "pdl"),
                                        ("penalties", "penalties")])
def test_an_unknown_choice_is_a_value_error_naming_its_field(field, name):
    with pytest.raises(ValueError, match=name):
        KernelConfig(**{field: "nope"})


def test_compile_elementwise_is_true_false_or_none():
    for value in (True, False, None):
        assert KernelConfig(compile_elementwise=value).compile_elementwise is value
    with pytest.raises(ValueError, match="compile_elementwise must be True, False or None"):
        KernelConfig(compile_elementwise="off")


def test_kernel_overrides_are_checked_at_configuration(tiny_demo):
    """EngineConfig.kernel_overrides (`serve --kernel-overrides`): "field=value,…" over the
    defaults; a malformed item, an unknown field, a bad value or a field that has its own
    setting is a ValueError naming what is wrong, when the EngineConfig is built."""
    target = str(tiny_demo[0])
    cfg = EngineConfig(model=target, kernel_overrides="gdn_rounds=per-seq, moe_routing=torch")
    assert cfg.kernels == KernelConfig(gdn_rounds="per-seq", moe_routing="torch")
    for text, match in (("pdl", "'pdl' is not field=value"),
                        ("fast=yes", "'fast' is not a kernel choice"),
                        ("compile_elementwise=off", "not a kernel choice"),
                        ("gdn_rounds=sometimes", "gdn_rounds must be one of"),
                        ("moe=pairs", "'moe' is set by moe_backend"),
                        ("attention=torch", "'attention' is set by attention_backend")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(model=target, kernel_overrides=text)
    assert parse_choices(" pdl=off ,, ") == {"pdl": "off"}


def test_engine_config_rejects_a_bad_moe_backend(tiny_demo):
    with pytest.raises(ValueError, match="moe_backend"):
        EngineConfig(model=str(tiny_demo[0]), moe_backend="triton")
    assert EngineConfig(model=str(tiny_demo[0])).kernels == KernelConfig()


def test_the_configs_import_no_model_code():
    """configs/ holds plain values: importing them loads no module of the model packages, so
    the kernels may import the configs without a circle."""
    code = ("import sys, configs.engine, configs.kernels, configs.model; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('target', 'draft', 'workers', 'cluster', 'deploy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
