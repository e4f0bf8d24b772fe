"""Where things live and which sources to try: project config + DSADAPT_* environment.

Precedence: environment > `dsadapt.toml` in the project root > defaults.

- DSADAPT_PROJECT      project root (default: nearest directory upward holding upstream.lock)
- DSADAPT_WORKDIR      work dir (default: <project>/.dsadapt)
- DSADAPT_CACHE        cache dir (default: <workdir>/cache)
- DSADAPT_SOURCES      comma list, order of sources to try (default: git,mirror,pypi)
- DSADAPT_MIRRORS      "engine=PATH[,PATH...];engine2=PATH" local git dirs, bare repos or bundles
- DSADAPT_ARTIFACTS    colon list of directories searched for release artifacts before PyPI
- DSADAPT_GIT_TIMEOUT  seconds for a network git operation (default 120)
- DSADAPT_LOCK_TIMEOUT seconds to wait for another dsadapt run on the same work dir (default 600)
- DSADAPT_VENVS        where per-pin virtual environments live (default: <workdir>/venvs)
- DSADAPT_REPORTS      where runs write their reports (default: <workdir>/reports; the committed
                       reports/ of the project change only with `--publish` or `--report-dir`)
- DSADAPT_DEBUG        1: print the traceback of an error (the CLI edge)

Every value is validated when the configuration is loaded, before a command changes anything:
a malformed one is a one-line input error (exit 2) naming the variable or the key.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from patcher.base.errors import ConfigError, UsageError, show
from patcher.base.textfile import read_text

SOURCE_KINDS = ("git", "mirror", "pypi")
CONFIG_FILE = "dsadapt.toml"
#: dsadapt.toml keys and their types, as documented in docs/user-guide.md.
CONFIG_KEYS = {
    "workdir": "a path string", "cache": "a path string", "venvs": "a path string", "reports": "a path string",
    "sources": "a table with `order = [...]`", "mirrors": "a table of ENGINE = PATH or [PATH, ...]",
    "artifact_dirs": "a list of path strings", "git_timeout": "a number of seconds",
    "lock_timeout": "a number of seconds",
}
DEFAULT_GIT_TIMEOUT = 120.0
DEFAULT_LOCK_TIMEOUT = 600.0


@dataclass(frozen=True)
class Config:
    project: Path
    workdir: Path
    cache: Path
    sources: tuple[str, ...] = SOURCE_KINDS
    mirrors: dict[str, tuple[Path, ...]] = field(default_factory=dict)
    artifact_dirs: tuple[Path, ...] = ()
    git_timeout: float = DEFAULT_GIT_TIMEOUT
    venvs: Path | None = None
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    reports: Path | None = None

    @property
    def lock_path(self) -> Path:
        return self.project / "upstream.lock"

    @property
    def patches_root(self) -> Path:
        return self.project / "patches"

    @property
    def reports_root(self) -> Path:
        """Where this run writes reports: scratch under the work dir unless told otherwise."""
        return self.reports or self.workdir / "reports"

    @property
    def published_reports(self) -> Path:
        """The project's committed reports (`--publish` writes here)."""
        return self.project / "reports"

    @property
    def report_roots(self) -> tuple[Path, ...]:
        """Every place reports are read from: the committed ones, then this machine's runs."""
        return tuple(dict.fromkeys((self.published_reports, self.reports_root)))

    @property
    def dist_dir(self) -> Path:
        return self.project / "dist"

    def checkout_dir(self, engine: str, tag: str) -> Path:
        return self.workdir / "checkouts" / engine / tag

    @property
    def venvs_root(self) -> Path:
        return self.venvs or self.workdir / "venvs"

    def venv_dir(self, engine: str, tag: str, variant: str) -> Path:
        return self.venvs_root / f"{engine}-{tag}-{variant}"


def find_project(start: Path) -> Path:
    for d in (start, *start.parents):
        if (d / "upstream.lock").is_file():
            return d
    raise UsageError(f"no upstream.lock in {show(start, 160)} or above",
                     hint="run dsadapt inside a dsadapt project, or pass --project DIR")


def parse_sources(text: str, where: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in items if s not in SOURCE_KINDS]
    if bad or not items:
        raise ConfigError(f"{where}: unknown source {show(bad[0], 40) if bad else '(empty)'!r}",
                          hint=f"sources are {', '.join(SOURCE_KINDS)} (comma-separated, in the order to try)")
    return items


def parse_mirrors(text: str, base: Path) -> dict[str, tuple[Path, ...]]:
    out: dict[str, tuple[Path, ...]] = {}
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        engine, sep, paths = part.partition("=")
        if not sep or not engine.strip() or not paths.strip(" ,"):
            raise ConfigError(f"DSADAPT_MIRRORS: {show(part, 60)!r} is not ENGINE=PATH",
                              hint="write DSADAPT_MIRRORS='triton=/srv/mirrors/vllm_backend.git;vllm=/srv/vllm.bundle'")
        out[engine.strip()] = out.get(engine.strip(), ()) + tuple(
            _path(base, p.strip(), "DSADAPT_MIRRORS") for p in paths.split(",") if p.strip())
    return out


def parse_seconds(text: str | float | int, where: str, *, allow_zero: bool = True) -> float:
    """A timeout: a finite, non-negative number of seconds."""
    if isinstance(text, bool):
        value = math.nan
    else:
        try:
            value = float(text)
        except (TypeError, ValueError):
            value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{where}: {show(text, 40)!r} is not a number of seconds",
                          hint=f"set it to a number such as 120, or unset it{' (0 means: do not wait)' if allow_zero else ''}")
    return value


def _path(base: Path, value: str, where: str) -> Path:
    if "\0" in value:
        raise ConfigError(f"{where}: the path contains a NUL byte", hint="fix the path")
    p = Path(os.path.expanduser(value))
    return (p if p.is_absolute() else base / p).resolve()


def _dir_path(base: Path, value: str, where: str) -> Path:
    """A directory dsadapt may create: it must not be an existing file."""
    p = _path(base, value, where)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{where}: {show(p, 160)} exists and is not a directory",
                          hint="point it at a directory (it is created when missing)")
    return p


def _toml_line(text: str, key: str) -> str:
    for i, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith((f"{key} ", f"{key}=", f"[{key}]", f"[{key}.")):
            return f":{i}"
    return ""


def _config_text(cfg_path: Path) -> str:
    """dsadapt.toml's text; a directory or a symbolic link to nothing of that name is a ConfigError."""
    try:
        return read_text(cfg_path, ConfigError, where=str(cfg_path))
    except FileNotFoundError:  # a symbolic link to nothing
        raise ConfigError(f"{cfg_path}: a symbolic link to nothing ({show(os.readlink(cfg_path), 120)})",
                          hint=f"point it at the real {cfg_path.name}, or remove it") from None


def load_file_config(cfg_path: Path) -> dict:
    """dsadapt.toml, validated: known keys with the documented types."""
    where = str(cfg_path)
    text = _config_text(cfg_path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: not valid TOML ({e})", hint="fix the syntax; the file is TOML") from None

    def bad(key: str, msg: str | None = None) -> ConfigError:
        return ConfigError(f"{where}{_toml_line(text, key)}: '{key}' must be {msg or CONFIG_KEYS[key]}",
                           hint=f"fix '{key}' in {cfg_path.name} (see docs/user-guide.md, configuration)")

    for key, value in data.items():
        if key not in CONFIG_KEYS:
            raise ConfigError(f"{where}{_toml_line(text, key)}: unknown key {show(key, 40)!r}",
                              hint=f"known keys: {', '.join(sorted(CONFIG_KEYS))}")
        if key in ("workdir", "cache", "venvs", "reports"):
            if not isinstance(value, str) or not value:
                raise bad(key)
        elif key in ("git_timeout", "lock_timeout"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise bad(key)
        elif key == "artifact_dirs":
            if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
                raise bad(key)
        elif key == "sources":
            if not isinstance(value, dict) or set(value) - {"order"}:
                raise bad(key)
            order = value.get("order", [])
            if not isinstance(order, list) or not all(isinstance(x, str) for x in order):
                raise bad(key, "a table with `order = [\"git\", \"mirror\", \"pypi\"]`")
            parse_sources(",".join(order), f"{where}{_toml_line(text, 'order')} [sources] order")
        elif key == "mirrors":
            if not isinstance(value, dict):
                raise bad(key)
            for engine, paths in value.items():
                ok = isinstance(paths, str) or (isinstance(paths, list) and all(isinstance(p, str) for p in paths))
                if not ok:
                    raise bad(key, f"a table of ENGINE = PATH or [PATH, ...] (mirrors.{show(engine, 30)} is not)")
    return data


def load_config(project: Path | None = None, env: dict[str, str] | None = None,
                report_dir: Path | None = None) -> Config:
    env = dict(os.environ if env is None else env)
    if project is None:
        if env.get("DSADAPT_PROJECT"):
            project = _path(Path.cwd(), env["DSADAPT_PROJECT"], "DSADAPT_PROJECT")
            if not project.is_dir():
                raise ConfigError(f"DSADAPT_PROJECT: {show(project, 160)} is not a directory",
                                  hint="point it at the project root (the directory holding upstream.lock)")
        else:
            project = find_project(Path.cwd())
    project = project.resolve()
    file_cfg: dict = {}
    cfg_path = project / CONFIG_FILE
    if os.path.lexists(cfg_path):  # a directory or a link loop of that name is an error, not "no file"
        file_cfg = load_file_config(cfg_path)

    def setting(var: str, key: str) -> tuple[str | None, str]:
        if env.get(var):
            return env[var], var
        if file_cfg.get(key) is not None:
            return file_cfg[key], f"{cfg_path.name} {key}"
        return None, var

    raw, where = setting("DSADAPT_WORKDIR", "workdir")
    workdir = _dir_path(project, raw, where) if raw else project / ".dsadapt"
    raw, where = setting("DSADAPT_CACHE", "cache")
    cache = _dir_path(project, raw, where) if raw else workdir / "cache"
    if env.get("DSADAPT_SOURCES"):
        sources = parse_sources(env["DSADAPT_SOURCES"], "DSADAPT_SOURCES")
    elif (file_cfg.get("sources") or {}).get("order"):
        sources = parse_sources(",".join(file_cfg["sources"]["order"]), f"{cfg_path} [sources] order")
    else:
        sources = SOURCE_KINDS
    mirrors: dict[str, tuple[Path, ...]] = {}
    for engine, paths in (file_cfg.get("mirrors") or {}).items():
        paths = [paths] if isinstance(paths, str) else paths
        mirrors[engine] = tuple(_path(project, p, f"{cfg_path.name} mirrors.{engine}") for p in paths)
    if env.get("DSADAPT_MIRRORS"):
        for engine, mpaths in parse_mirrors(env["DSADAPT_MIRRORS"], Path.cwd()).items():
            mirrors[engine] = mpaths + mirrors.get(engine, ())
    art_dirs = tuple(_path(Path.cwd(), p, "DSADAPT_ARTIFACTS") for p in env.get("DSADAPT_ARTIFACTS", "").split(":") if p)
    art_dirs += tuple(_path(project, p, f"{cfg_path.name} artifact_dirs") for p in file_cfg.get("artifact_dirs", []))
    raw, where = setting("DSADAPT_GIT_TIMEOUT", "git_timeout")
    git_timeout = parse_seconds(raw, where, allow_zero=False) if raw is not None else DEFAULT_GIT_TIMEOUT
    raw, where = setting("DSADAPT_LOCK_TIMEOUT", "lock_timeout")
    lock_timeout = parse_seconds(raw, where) if raw is not None else DEFAULT_LOCK_TIMEOUT
    raw, where = setting("DSADAPT_VENVS", "venvs")
    venvs = _dir_path(project, raw, where) if raw else None
    if report_dir is not None:
        reports: Path | None = _dir_path(Path.cwd(), str(report_dir), "--report-dir")
    else:
        raw, where = setting("DSADAPT_REPORTS", "reports")
        reports = _dir_path(project, raw, where) if raw else None
    return Config(project=project, workdir=workdir, cache=cache, sources=sources, mirrors=mirrors,
                  artifact_dirs=art_dirs, git_timeout=git_timeout, venvs=venvs, lock_timeout=lock_timeout,
                  reports=reports)
