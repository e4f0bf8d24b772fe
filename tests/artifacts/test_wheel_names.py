"""Variants get distinct wheel names, and a build never replaces a different file in dist/."""

from __future__ import annotations

import pytest

from patcher.artifacts.builder import _install_output, overlay_version
from patcher.base.errors import ExitCode, RefusedToClobber
from patcher.engines.registry import adapter


def test_variant_overlaying_another_variants_wheel_is_named_in_the_local_label():
    h = "0123456789abcdef"
    assert overlay_version("0.18.0", h) == "0.18.0+ds.01234567"
    assert overlay_version("0.18.0", h, "pytorch") == "0.18.0+ds.01234567.pytorch"
    assert overlay_version("0.1+cpu", h, "pytorch") == "0.1+cpu.ds.01234567.pytorch"
    lm = adapter("lmdeploy")
    names = {overlay_version("0.18.0", h, v.name if v.wheel_variant else None) for v in lm.variants}
    assert len(names) == len(lm.variants) == 2  # cuda and pytorch build different files


def test_a_different_file_of_the_same_name_is_never_replaced(tmp_path):
    final = tmp_path / "x-1.0+ds.1-py3-none-any.whl"
    final.write_bytes(b"first build")
    tmp = tmp_path / ".x.tmp"
    tmp.write_bytes(b"another build")
    with pytest.raises(RefusedToClobber) as e:
        _install_output(tmp, final)
    assert e.value.exit_code == ExitCode.STOPPED and "exists with other content" in e.value.message
    assert final.read_bytes() == b"first build" and not tmp.exists()
    tmp.write_bytes(b"first build")  # the same bytes (a reproducible rebuild): fine
    _install_output(tmp, final)
    assert final.read_bytes() == b"first build" and not tmp.exists()
