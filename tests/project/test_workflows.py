"""The GitHub workflows parse, are wired as designed, and only call dsadapt subcommands/options that exist."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import click
import pytest
import yaml

from patcher.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
# command families registered only when their module is in this checkout (cli._register_optional)
OPTIONAL = ("bisect", "build", "check", "model", "rebase", "report", "serve")


def _load(name: str) -> dict:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def _runs(wf: dict) -> list[str]:
    return [s["run"] for job in wf["jobs"].values() for s in job.get("steps", []) if "run" in s]


def dsadapt_calls(script: str) -> list[list[str]]:
    """Every `dsadapt …` command line in a shell script, as argv (GitHub expressions made words)."""
    calls = []
    for line in script.splitlines():
        line = re.sub(r"\$\{\{[^}]*\}\}", "EXPR", line)
        for m in re.finditer(r"(?:^|[\s;&|(])dsadapt\s+([^;&|)]*)", line):
            calls.append(shlex.split(m.group(1).replace('"$', '"').replace("$", ""), comments=True))
    return calls


def test_dsadapt_calls_parser():
    assert dsadapt_calls('  dsadapt rebase "$old" --onto ${{ matrix.tag }} && echo ok') == [
        ["rebase", "old", "--onto", "EXPR"]]
    assert dsadapt_calls("dsadapt tags \"$engine\" || echo x") == [["tags", "engine"]]
    assert dsadapt_calls("pip install dsadapt-thing") == []


def test_ci_runs_the_project_test_command_on_every_push():
    wf = _load("ci.yml")
    assert "push" in wf["on"]
    assert any(r.strip() == "bash .ci/run" for r in _runs(wf))


def test_upstream_is_scheduled_and_feeds_the_matrix_json_to_strategy():
    wf = _load("upstream.yml")
    assert wf["on"]["schedule"][0]["cron"]
    plan, carry, pr = wf["jobs"]["plan"], wf["jobs"]["carry"], wf["jobs"]["pr"]
    assert any("dsadapt matrix --json --only new" in r for r in _runs({"jobs": {"plan": plan}}))
    assert carry["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    assert "matrix.runs_on" in carry["runs-on"]
    names = [s.get("name", "") for s in carry["steps"]]
    for step in ("Rebase", "Build", "Check", "Check skipped", "Upload reports"):
        assert step in names
    upload = carry["steps"][names.index("Upload reports")]
    assert upload["if"] == "always()" and upload["uses"].startswith("actions/upload-artifact@")
    assert pr["if"].endswith("needs.carry.result == 'success'")
    assert any(s.get("uses", "").startswith("peter-evans/create-pull-request@") for s in pr["steps"])


def _command_options(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}


def test_every_dsadapt_subcommand_and_option_in_the_workflows_exists():
    missing_optional, checked = set(), 0
    for wf in sorted(WORKFLOWS.glob("*.yml")):
        for script in _runs(_load(wf.name)):
            for argv in dsadapt_calls(script):
                sub = argv[0]
                if sub not in cli.commands:
                    assert sub in OPTIONAL, f"{wf.name}: `dsadapt {sub}` is not a dsadapt command"
                    try:
                        importlib.import_module(f"patcher.cli.commands.{sub}")
                    except ModuleNotFoundError:
                        missing_optional.add(sub)
                        continue
                    pytest.fail(f"{wf.name}: patcher.cli.commands.{sub} exists but does not register `{sub}`")
                opts = _command_options(cli.commands[sub]) | {"--help", "-h"}
                for tok in argv[1:]:
                    if tok.startswith("-"):
                        assert tok.split("=")[0] in opts, f"{wf.name}: `dsadapt {sub}` has no option {tok}"
                checked += 1
    assert checked >= 5
    if missing_optional:
        pytest.skip(f"command families not in this checkout yet, unchecked: {sorted(missing_optional)}")
