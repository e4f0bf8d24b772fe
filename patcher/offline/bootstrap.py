"""Make dsadapt's environment on an offline host from this bundle, then install the bundle.

Copied into every bundle as ``bootstrap.py`` by `dsadapt bundle` (patcher/offline/pack.py); it runs
with nothing but the Python standard library, on the target, in the bundle's folder:

    python3 bootstrap.py [--venv DIR] [--system-site-packages] [--no-install]

1. checks this Python against the bundle (its X.Y) and the files of dsadapt's part against
   bundle.json (sha256);
2. makes a virtual environment (default ``.dsadapt/env`` in the bundle). With
   ``--system-site-packages`` it sees the packages of the Python that runs this script (a
   ``.pth`` file: also when that Python is itself a venv or conda env holding the host's CUDA
   torch), after its own;
3. installs dsadapt and the wheels of its part: ``pip install --no-index --find-links wheels
   --require-hashes --no-deps --ignore-installed -r locks/dsadapt.txt``, into the environment
   even where the host has a package of the same name;
4. runs ``dsadapt install --offline .`` from the new environment (unless ``--no-install``),
   which verifies the whole bundle and installs the engine's environments.

Exit codes as dsadapt's (docs/user-guide.md): 2 bad input, 3 a file does not match
bundle.json, 6 this Python cannot run the bundle, 7 a tool (venv, pip) failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import site
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def fail(code: int, message: str, hint: str) -> int:
    sys.stderr.write(f"error: {message}\nhint: {hint}\n")
    return code


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def host_site_dirs() -> list[str]:
    """The site-packages this interpreter sees (its own, and those its .pth files add)."""
    dirs = [*site.getsitepackages(), *(p for p in sys.path if Path(p).name in ("site-packages", "dist-packages"))]
    return [p for p in dict.fromkeys(dirs) if Path(p).is_dir()]


def make_venv(venv: Path, lend: bool) -> Path:
    py = venv / "bin" / "python"
    if not py.exists():
        cmd = [sys.executable, "-m", "venv", str(venv)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 and "ensurepip" in r.stdout + r.stderr:
            r = subprocess.run([*cmd[:3], "--without-pip", str(venv)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"python -m venv {venv} failed: {(r.stderr or r.stdout).strip()[-300:]}")
    if lend:
        purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        # the same file dsadapt writes (patcher/artifacts/venvs.py host_pth_text): each folder through
        # site.addsitedir, after the environment's own site-packages
        (Path(purelib) / "dsadapt-host-packages.pth").write_text(
            "# written by dsadapt: the host's site-packages, seen after this environment's own\n"
            + "".join(f"import site; site.addsitedir({d!r})\n" for d in host_site_dirs()))
    return py


def pip_cmd(py: Path) -> list[str]:
    """The environment's own pip, or this interpreter's pip aimed at it (pip >= 22.3)."""
    if subprocess.run([str(py), "-m", "pip", "--version"], capture_output=True).returncode == 0:
        return [str(py), "-m", "pip"]
    return [sys.executable, "-m", "pip", "--python", str(py)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bootstrap.py", description=__doc__.split("\n")[0])
    ap.add_argument("--venv", type=Path, default=HERE / ".dsadapt" / "env", help="where dsadapt's environment goes")
    ap.add_argument("--system-site-packages", action="store_true",
                    help="let the environments see this Python's packages (the host's CUDA torch, ...)")
    ap.add_argument("--no-install", action="store_true", help="only make dsadapt's environment")
    args = ap.parse_args(argv)
    try:
        manifest = json.loads((HERE / "bundle.json").read_text(encoding="utf-8"))
        part = manifest["parts"]["dsadapt"]
        lock = HERE / part["lock"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return fail(2, f"{HERE} is not a readable dsadapt bundle ({e})", "copy the whole bundle folder again")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if here != manifest.get("python"):
        return fail(6, f"this bundle is for Python {manifest.get('python')}, this is Python {here}",
                    f"run bootstrap.py with a Python {manifest.get('python')}, or make the bundle with --python {here}")
    if manifest.get("host_packages") and not args.system_site_packages:
        need = sorted({n for p in manifest["parts"].values() for n in p.get("host", {})})
        return fail(2, f"this bundle relies on packages of the target's Python ({', '.join(need[:8])})",
                    "run this script with the Python environment that has them, with --system-site-packages")
    for rel in [part["lock"], *part["wheels"]]:
        want = manifest["files"].get(rel)
        if want is None or not (HERE / rel).is_file() or sha256(HERE / rel) != want:
            return fail(3, f"{rel} is missing or does not match bundle.json", "copy the whole bundle folder again")
    try:
        print(f"… making dsadapt's environment {args.venv}", file=sys.stderr, flush=True)
        py = make_venv(args.venv, args.system_site_packages)
        cmd = [*pip_cmd(py), "install", "--disable-pip-version-check", "--no-input", "--no-index", "--find-links",
               str(HERE / "wheels"), "--require-hashes", "--no-deps", "--ignore-installed", "-r", str(lock)]
        print(f"… {' '.join(cmd[-8:])}", file=sys.stderr, flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
            return fail(7, f"pip could not install dsadapt's part: {tail}", "see the lines above; nothing was fetched")
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        return fail(7, str(e), "check that this Python has the venv module (python3-venv)")
    dsadapt = args.venv / "bin" / "dsadapt"
    if not dsadapt.is_file():
        return fail(7, f"pip installed no dsadapt command into {args.venv}", "see pip's output above")
    print(f"dsadapt's environment: {args.venv} (activate: source {args.venv}/bin/activate)", file=sys.stderr)
    if args.no_install:
        return 0
    install = [str(dsadapt), "install", "--offline", str(HERE),
               *(["--system-site-packages"] if args.system_site_packages else [])]
    print(f"… {' '.join(install)}", file=sys.stderr, flush=True)
    return subprocess.run(install, cwd=HERE).returncode


if __name__ == "__main__":
    sys.exit(main())
