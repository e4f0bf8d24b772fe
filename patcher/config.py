"""Where things live and which sources to try: project config + DSADAPT_* environment.

Precedence: environment > `dsadapt.toml` in the project root > defaults.

- DSADAPT_PROJECT     project root (default: nearest directory upward holding upstream.lock)
- DSADAPT_WORKDIR     work dir (default: <project>/.dsadapt)
- DSADAPT_CACHE       cache dir (default: <workdir>/cache)
- DSADAPT_SOURCES     comma list, order of sources to try (default: git,mirror,pypi)
- DSADAPT_MIRRORS     "engine=PATH[,PATH...];engine2=PATH" local git dirs, bare repos or bundles
- DSADAPT_ARTIFACTS   colon list of directories searched for release artifacts before PyPI
- DSADAPT_GIT_TIMEOUT seconds for a network git operation (default 120)
- DSADAPT_VENVS       where per-pin virtual environments live (default: <workdir>/venvs)
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError

SOURCE_KINDS = ("git", "mirror", "pypi")
CONFIG_FILE = "dsadapt.toml"


@dataclass(frozen=True)
class Config:
    project: Path
    workdir: Path
    cache: Path
    sources: tuple[str, ...] = SOURCE_KINDS
    mirrors: dict[str, tuple[Path, ...]] = field(default_factory=dict)
    artifact_dirs: tuple[Path, ...] = ()
    git_timeout: float = 120.0
    venvs: Path | None = None

    @property
    def lock_path(self) -> Path:
        return self.project / "upstream.lock"

    @property
    def patches_root(self) -> Path:
        return self.project / "patches"

    @property
    def reports_root(self) -> Path:
        return self.project / "reports"

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
    raise UsageError(f"no upstream.lock in {start} or above",
                     hint="run dsadapt inside a dsadapt project, or pass --project DIR")


def parse_sources(text: str, where: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in items if s not in SOURCE_KINDS]
    if bad or not items:
        raise UsageError(f"{where}: unknown source {bad[0] if bad else '(empty)'!r}",
                         hint=f"sources are {', '.join(SOURCE_KINDS)}")
    return items


def parse_mirrors(text: str, base: Path) -> dict[str, tuple[Path, ...]]:
    out: dict[str, tuple[Path, ...]] = {}
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        engine, sep, paths = part.partition("=")
        if not sep or not engine.strip():
            raise UsageError(f"DSADAPT_MIRRORS: {part!r} is not ENGINE=PATH",
                             hint="write DSADAPT_MIRRORS='triton=/srv/mirrors/vllm_backend.git;vllm=/srv/vllm.bundle'")
        out[engine.strip()] = out.get(engine.strip(), ()) + tuple(
            (base / p.strip()).resolve() for p in paths.split(",") if p.strip())
    return out


def load_config(project: Path | None = None, env: dict[str, str] | None = None) -> Config:
    env = dict(os.environ if env is None else env)
    if project is None:
        project = Path(env["DSADAPT_PROJECT"]) if env.get("DSADAPT_PROJECT") else find_project(Path.cwd())
    project = project.resolve()
    file_cfg: dict = {}
    cfg_path = project / CONFIG_FILE
    if cfg_path.is_file():
        try:
            file_cfg = tomllib.loads(cfg_path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise UsageError(f"{cfg_path}: not valid TOML ({e})", hint="fix the syntax") from None
    workdir = Path(env.get("DSADAPT_WORKDIR") or file_cfg.get("workdir") or project / ".dsadapt")
    workdir = (project / workdir).resolve() if not workdir.is_absolute() else workdir
    cache = Path(env.get("DSADAPT_CACHE") or file_cfg.get("cache") or workdir / "cache")
    cache = (project / cache).resolve() if not cache.is_absolute() else cache
    if env.get("DSADAPT_SOURCES"):
        sources = parse_sources(env["DSADAPT_SOURCES"], "DSADAPT_SOURCES")
    elif file_cfg.get("sources", {}).get("order"):
        sources = parse_sources(",".join(file_cfg["sources"]["order"]), f"{cfg_path} [sources] order")
    else:
        sources = SOURCE_KINDS
    mirrors: dict[str, tuple[Path, ...]] = {}
    for engine, paths in (file_cfg.get("mirrors") or {}).items():
        paths = [paths] if isinstance(paths, str) else paths
        mirrors[engine] = tuple((project / p).resolve() for p in paths)
    if env.get("DSADAPT_MIRRORS"):
        for engine, paths in parse_mirrors(env["DSADAPT_MIRRORS"], Path.cwd()).items():
            mirrors[engine] = paths + mirrors.get(engine, ())
    art_dirs = tuple(Path(p).resolve() for p in env.get("DSADAPT_ARTIFACTS", "").split(":") if p)
    art_dirs += tuple((project / p).resolve() for p in file_cfg.get("artifact_dirs", []))
    timeout = float(env.get("DSADAPT_GIT_TIMEOUT") or file_cfg.get("git_timeout") or 120)
    venvs = env.get("DSADAPT_VENVS") or file_cfg.get("venvs")
    venvs_path = None if not venvs else (Path(venvs) if Path(venvs).is_absolute() else (project / venvs)).resolve()
    return Config(project=project, workdir=workdir, cache=cache, sources=sources, mirrors=mirrors,
                  artifact_dirs=art_dirs, git_timeout=timeout, venvs=venvs_path)
