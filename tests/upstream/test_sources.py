"""Sources: git, mirrors (plain repo, bare repo, snapshot bundle) and pypi (fixture wheel), each
verified against the lock; verification failures are hard errors that create nothing."""

from __future__ import annotations

import json

from conftest import REF1, TAG1, artifact_toml, files_snapshot, git, lock_text, make_wheel


def _state(project, tag=TAG1) -> dict:
    return json.loads((project.checkout(tag) / ".git" / "dsadapt" / "state.json").read_text())


def _assert_applied_tree(project):
    co = project.checkout()
    assert git(co, "rev-list", "--count", "refs/dsadapt/base..HEAD") == "3"
    assert (co / "vllm" / "newmod.py").is_file()
    assert git(co, "status", "--porcelain") == ""


def test_git_source_verifies_commit(project, clean_stack):
    r = project.run("apply", REF1, "--json")
    assert r.rc == 0, r
    src = r.json()["source"]
    assert src["kind"] == "git" and src["origin"] == project.upstream.url
    assert src["commit"] == project.upstream.commits[TAG1] and src["tree"] == project.upstream.trees[TAG1]
    assert src["snapshot"] is False and "commit id matches" in src["verified"]
    _assert_applied_tree(project)


def test_git_source_file_url(project, clean_stack):
    project.write_lock(lock_text(project.upstream, git_url=f"file://{project.upstream.path}"))
    r = project.run("apply", REF1, "--json")
    assert r.rc == 0, r
    assert r.json()["source"]["origin"].startswith("file://")
    assert git(project.checkout(), "rev-parse", "refs/dsadapt/base") == project.upstream.commits[TAG1]


def test_unreachable_git_falls_through_to_mirror(project, clean_stack, tmp_path):
    project.write_lock(lock_text(project.upstream, git_url=str(tmp_path / "no-such-repo")))
    r = project.run("apply", REF1, "--json",
                    env={"DSADAPT_SOURCES": "git,mirror", "DSADAPT_MIRRORS": f"vllm={project.upstream.path}"})
    assert r.rc == 0, r
    src = r.json()["source"]
    assert src["kind"] == "mirror" and src["passed_over"] and src["passed_over"][0].startswith("git:")


def test_mirror_plain_repo_dir(project, clean_stack, tmp_path):
    mirror = tmp_path / "mirror-plain"
    git(tmp_path, "clone", "-q", project.upstream.url, str(mirror))
    r = project.run("apply", REF1, "--json", env={"DSADAPT_SOURCES": "mirror", "DSADAPT_MIRRORS": f"vllm={mirror}"})
    assert r.rc == 0, r
    src = r.json()["source"]
    assert src["kind"] == "mirror" and src["origin"] == str(mirror)
    assert src["commit"] == project.upstream.commits[TAG1] and src["snapshot"] is False
    _assert_applied_tree(project)


def test_mirror_bare_repo_second_in_list(project, clean_stack, tmp_path):
    mirror = tmp_path / "mirror.git"
    git(tmp_path, "clone", "-q", "--bare", project.upstream.url, str(mirror))
    r = project.run("apply", REF1, "--json", env={
        "DSADAPT_SOURCES": "mirror", "DSADAPT_MIRRORS": f"vllm={tmp_path / 'missing.git'},{mirror}"})
    assert r.rc == 0, r
    assert r.json()["source"]["origin"] == str(mirror)
    assert git(project.checkout(), "rev-parse", "refs/dsadapt/base") == project.upstream.commits[TAG1]


def _snapshot_bundle(project, tmp_path, tree_of: str = TAG1) -> tuple:
    """A bundle holding a parentless snapshot commit of a tag's tree, under the pinned tag name."""
    scratch = tmp_path / "snap"
    git(tmp_path, "clone", "-q", "--bare", project.upstream.url, str(scratch))
    snap = git(scratch, "commit-tree", f"{tree_of}^{{tree}}", "-m", "snapshot of v1.0.0")
    git(scratch, "update-ref", f"refs/tags/{TAG1}", snap)
    bundle = tmp_path / "vllm.bundle"
    git(scratch, "bundle", "create", str(bundle), f"refs/tags/{TAG1}")
    return bundle, snap


def test_mirror_bundle_of_snapshot_commit_accepted_by_tree_id(project, clean_stack, tmp_path):
    bundle, snap = _snapshot_bundle(project, tmp_path)
    assert snap != project.upstream.commits[TAG1]
    r = project.run("apply", REF1, "--json", env={"DSADAPT_SOURCES": "mirror", "DSADAPT_MIRRORS": f"vllm={bundle}"})
    assert r.rc == 0, r
    src = r.json()["source"]
    assert src["kind"] == "mirror" and src["snapshot"] is True and src["commit"] == snap
    assert "tree id" in src["verified"] and src["tree"] == project.upstream.trees[TAG1]
    co = project.checkout()
    assert git(co, "rev-parse", "refs/dsadapt/base") == snap
    assert git(co, "rev-parse", "refs/dsadapt/base^{tree}") == project.upstream.trees[TAG1]
    _assert_applied_tree(project)


def test_mirror_bundle_with_other_tree_refused(project, clean_stack, tmp_path):
    bundle, _ = _snapshot_bundle(project, tmp_path, tree_of="v1.1.0")
    r = project.run("apply", REF1, env={"DSADAPT_SOURCES": "mirror", "DSADAPT_MIRRORS": f"vllm={bundle}"})
    assert r.rc == 3, r
    assert not project.checkout().exists()


def test_moved_tag_is_a_verification_error_and_creates_no_checkout(project, clean_stack):
    up = project.upstream
    git(up.path, "tag", "-f", "-a", TAG1, "-m", "moved", "v1.1.0")
    r = project.run("apply", REF1)
    assert r.rc == 3, r
    lines = r.err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: ")
    assert "tag moved" in lines[0] or "resolves to" in lines[0]
    assert up.commits[TAG1][:12] in lines[0] and up.commits["v1.1.0"][:12] in lines[0]
    assert not project.checkout().exists()
    assert [p.name for p in project.checkout().parent.glob(".*tmp*")] == []


def test_moved_tag_also_refused_through_a_mirror(project, clean_stack, tmp_path):
    mirror = tmp_path / "mirror.git"
    git(tmp_path, "clone", "-q", "--bare", project.upstream.url, str(mirror))
    git(mirror, "tag", "-f", TAG1, "v1.1.0")
    r = project.run("apply", REF1, env={"DSADAPT_SOURCES": "mirror", "DSADAPT_MIRRORS": f"vllm={mirror}"})
    assert r.rc == 3, r
    assert not project.checkout().exists()


# ---------------------------------------------------------------- pypi


def _pypi_project(project, tmp_path, **wheel_kw):
    wheel, sha = make_wheel(project.upstream, tmp_path / "artifacts", **wheel_kw)
    project.write_lock(lock_text(project.upstream, artifact=artifact_toml(wheel.name, sha)))
    project.env["DSADAPT_SOURCES"] = "pypi"
    return wheel, sha


def test_pypi_source_unpacks_fixture_wheel_without_binaries(project, clean_stack, tmp_path):
    wheel, sha = _pypi_project(project, tmp_path)
    r = project.run("apply", REF1, "--json")
    assert r.rc == 0, r
    src = r.json()["source"]
    assert src["kind"] == "pypi" and src["origin"] == wheel.name and src["snapshot"] is True
    assert sha[:12] in src["verified"]
    co = project.checkout()
    base_files = git(co, "ls-tree", "-r", "--name-only", "refs/dsadapt/base").splitlines()
    assert base_files == ["vllm/__init__.py", "vllm/mod.py", "vllm/util.py"]
    assert not (co / "vllm" / "_C.abi3.so").exists() and not list(co.glob("*.dist-info"))
    # the unpacked files are byte-identical to upstream's: same blob ids
    for f in base_files:
        assert git(co, "rev-parse", f"refs/dsadapt/base:{f}") == git(project.upstream.path, "rev-parse", f"{TAG1}:{f}")
    assert f"Artifact-Sha256: {sha}" in git(co, "log", "-1", "--format=%B", "refs/dsadapt/base")
    _assert_applied_tree(project)


def test_pypi_sha256_mismatch_creates_nothing(project, clean_stack, tmp_path):
    wheel, sha = _pypi_project(project, tmp_path)
    bad = "0" * 64
    project.write_lock(lock_text(project.upstream, artifact=artifact_toml(wheel.name, bad)))
    before = files_snapshot(project.root, project.workdir, ignore=("lock",))
    r = project.run("apply", REF1)
    assert r.rc == 3, r
    assert "sha256" in r.err and wheel.name in r.err
    assert not project.checkout().exists()
    assert files_snapshot(project.root, project.workdir, ignore=("lock",)) == before


def test_pypi_preimage_blob_mismatch_refused_before_any_patch(project, clean_stack, tmp_path):
    from conftest import MOD_V1

    _pypi_project(project, tmp_path, overrides={"vllm/mod.py": MOD_V1 + "# rebuilt by the packager\n"})
    r = project.run("apply", REF1)
    assert r.rc == 3, r
    assert "pre-image differs" in r.err and "vllm/mod.py" in r.err and "0001-" in r.err
    co = project.checkout()
    assert git(co, "rev-parse", "HEAD") == git(co, "rev-parse", "refs/dsadapt/base")
    assert git(co, "status", "--porcelain") == ""


def test_pypi_artifact_found_in_cache_is_still_verified(project, clean_stack, tmp_path):
    wheel, _ = _pypi_project(project, tmp_path)
    cache = tmp_path / "work" / "cache" / "artifacts"
    cache.mkdir(parents=True)
    (cache / wheel.name).write_bytes(b"tampered")
    r = project.run("apply", REF1)
    assert r.rc == 3 and "sha256" in r.err, r
    assert not project.checkout().exists()


def test_verify_through_pypi_reports_preimage_mismatch(project, clean_stack, tmp_path):
    from conftest import MOD_V1

    _pypi_project(project, tmp_path, overrides={"vllm/mod.py": MOD_V1 + "# rebuilt by the packager\n"})
    r = project.run("verify", REF1, "--json")
    assert r.rc == 1, r
    problems = r.json()["stacks"][0]["problems"]
    assert any(p.startswith("pre-image: 0001-") and "vllm/mod.py" in p for p in problems), problems
    assert r.json()["stacks"][0]["source"].startswith("pypi ")
