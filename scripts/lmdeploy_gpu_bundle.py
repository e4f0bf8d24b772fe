"""Build the carry bundle for the LMDeploy GPU check and print the device command.

    python scripts/lmdeploy_gpu_bundle.py [--dest .carry/lmdeploy] [--wheel-dir /tmp/lmd]

Runs here (CPU, network for pip only). The bundle (about 27 MB) holds:

- ``lmd/``: the lmdeploy 0.18.0 cp312 wheel unpacked without TurboMind's binaries
  (``lmdeploy/turbomind/_turbomind*.so``, ``lmdeploy/turbomind/lib64/libxgrammar.a``);
  the PyTorch engine does not need them;
- ``overlay/``: the files patches/lmdeploy/v0.18.0 changes, after ``git apply`` of the
  stack on that tree (the device copies them over a second copy of ``lmd/``);
- ``whl/``: the 24 cp312 wheels LMDeploy imports that the device lacks
  (``--requirements``, default scripts/lmdeploy_gpu_wheels.txt);
- ``tok/``: a tokenizer for the probe models; ``tm/``: patcher/tinymodel.py and its data
  (the gate's built-in models, built on the device); ``prompts_*.json``: the gate's
  prompt set for each model (built here with patcher/prompts.py);
- the scripts (``lmdeploy_gpu_check.py``, ``lmdeploy_models.py``, ``lmdeploy_runner.py``,
  ``hf_reference.py``), ``run.sh`` and ``manifest.json`` (sha256 of every file, the stack
  hash, the wheel's sha256).

Where patcher/tinymodel.py, patcher/prompts.py or patcher/runners/hf_reference.py are not
in this checkout yet, ``--model-src`` / ``--gate-src`` name checkouts that have them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
WHEEL = "lmdeploy-0.18.0-cp312-cp312-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "fcef7cf0d210d766e02e2e6df025378d2f8ae36080400b2818eb9a34ef3392dc"
sys.path.insert(0, str(ROOT))
from patcher.engines import engine  # noqa: E402
from patcher.sourcetree import left_out  # noqa: E402

#: What the PyTorch engine never loads (TurboMind's extension, its static xgrammar...): the
#: members the `pytorch` variant leaves out, by dsadapt's one rule for what a variant ships.
DROP = engine("lmdeploy").variant("pytorch").leave_out
STACK = ROOT / "patches" / "lmdeploy" / "v0.18.0"
PIP_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
                 "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                 "manylinux1_x86_64", "manylinux_2_5_x86_64")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def stack_hash(stack_dir: Path) -> tuple[str, list[str]]:
    """The lead's stack hash (patcher/stack.py: sha256 over b"dsadapt-stack-v1\\0" and each
    patch's name and text, in series order) and the series names."""
    names = [ln.split("#", 1)[0].strip() for ln in (stack_dir / "series").read_text().splitlines()]
    names = [n for n in names if n]
    h = hashlib.sha256(b"dsadapt-stack-v1\0")
    for n in names:
        h.update(n.encode() + b"\0" + (stack_dir / n).read_text(encoding="utf-8").encode("utf-8") + b"\0")
    return h.hexdigest(), names


def unpack_wheel(wheel: Path, dest: Path) -> list[str]:
    dropped = []
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if left_out(info.filename, DROP):
                dropped.append(info.filename)
                continue
            z.extract(info, dest)
    return dropped


def overlay(tree: Path, stack_dir: Path, names: list[str], dest: Path) -> list[str]:
    """Apply the stack on a scratch copy of `tree` with git apply; copy the changed files."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "t"
        shutil.copytree(tree / "lmdeploy", work / "lmdeploy")
        changed: list[str] = []
        for n in names:
            patch = stack_dir / n
            subprocess.run(["git", "apply", "--check", str(patch)], cwd=work, check=True)
            subprocess.run(["git", "apply", str(patch)], cwd=work, check=True)
            out = subprocess.run(["git", "apply", "--numstat", str(patch)], cwd=work, check=True,
                                 capture_output=True, text=True).stdout
            changed += [line.split("\t")[2] for line in out.splitlines() if line.strip()]
        for rel in dict.fromkeys(changed):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(work / rel, dest / rel)
        return list(dict.fromkeys(changed))


def download_wheels(requirements: Path, dest: Path, cache: Path) -> None:
    names = [ln.strip() for ln in requirements.read_text().splitlines() if ln.strip().endswith(".whl")]
    cache.mkdir(parents=True, exist_ok=True)
    missing = [n for n in names if not (cache / n).exists()]
    if missing:
        specs = []
        for n in missing:
            dist, version = n.split("-")[:2]
            specs.append(f"{dist}=={version}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", "-d", str(cache), *sum((["--platform", p] for p in PIP_PLATFORMS), []),
               *specs]
        subprocess.run(cmd, check=True)
    dest.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copy2(cache / n, dest / n)


def prompts_for(model_dir: Path, gate_src: Path, out: Path) -> None:
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
            "from patcher.prompts import build_prompt_set, write_prompts_json;"
            "write_prompts_json(build_prompt_set(Path(sys.argv[2])), Path(sys.argv[3]))")
    subprocess.run([sys.executable, "-c", code, str(gate_src), str(model_dir), str(out)], check=True)


def first_with(path: str, *roots: Path) -> Path:
    for r in roots:
        if (r / path).is_file():
            return r
    raise SystemExit(f"{path} not found under {', '.join(map(str, roots))}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dest", default=str(ROOT / ".carry" / "lmdeploy"))
    ap.add_argument("--wheel-dir", default=os.environ.get("DSADAPT_LMDEPLOY_WHEEL_DIR", "/tmp/lmd"))
    ap.add_argument("--requirements", default=str(HERE / "lmdeploy_gpu_wheels.txt"))
    ap.add_argument("--gate-src", default=None, help="checkout with patcher/prompts.py and runners/hf_reference.py")
    ap.add_argument("--model-src", default=None, help="checkout with patcher/tinymodel.py")
    args = ap.parse_args()

    dest = Path(args.dest)
    wheel = Path(args.wheel_dir) / WHEEL
    if not wheel.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                        "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d",
                        args.wheel_dir, "lmdeploy==0.18.0"], check=True)
    if sha256(wheel) != WHEEL_SHA256:
        raise SystemExit(f"{wheel}: sha256 differs from the pinned {WHEEL_SHA256}")
    gate_src = Path(args.gate_src) if args.gate_src else first_with("patcher/prompts.py", ROOT, Path("/work/main"))
    model_src = Path(args.model_src) if args.model_src else first_with("patcher/tinymodel.py", ROOT, Path("/work/main"))

    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    dropped = unpack_wheel(wheel, dest / "lmd")
    shash, names = stack_hash(STACK)
    changed = overlay(dest / "lmd", STACK, names, dest / "overlay")
    download_wheels(Path(args.requirements), dest / "whl", Path(args.wheel_dir) / "gpu-wheels")
    for name in ("lmdeploy_gpu_check.py", "lmdeploy_models.py", "run.sh"):
        shutil.copy2(HERE / ("lmdeploy_gpu_run.sh" if name == "run.sh" else name), dest / name)
    # the runners import the stdlib runner protocol (dsadapt_runner.py) from their own directory
    shutil.copy2(ROOT / "patcher" / "engines" / "lmdeploy" / "runner.py", dest / "lmdeploy_runner.py")
    shutil.copy2(ROOT / "patcher" / "runners" / "dsadapt_runner.py", dest / "dsadapt_runner.py")
    shutil.copy2(gate_src / "patcher" / "runners" / "hf_reference.py", dest / "hf_reference.py")
    tm = dest / "tm" / "patcher"
    (tm / "data").mkdir(parents=True)
    (tm / "__init__.py").write_text("")
    shutil.copy2(model_src / "patcher" / "errors.py", tm / "errors.py")
    shutil.copy2(model_src / "patcher" / "tinymodel.py", tm / "tinymodel.py")
    for f in (model_src / "patcher" / "data").iterdir():
        shutil.copy2(f, tm / "data" / f.name)

    sys.path.insert(0, str(HERE))
    from lmdeploy_models import build_model, build_tokenizer, save

    build_tokenizer(str(model_src / "patcher" / "data" / "corpus.txt"), str(dest / "tok"))
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "v2"
        save(build_model("v2"), str(probe), str(dest / "tok"))
        prompts_for(probe, gate_src, dest / "prompts_v2.json")
        for variant in ("v2-lite", "v3"):
            d = Path(tmp) / variant
            code = ("import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path;"
                    "from patcher.tinymodel import make_model; make_model(Path(sys.argv[2]), variant=sys.argv[3])")
            subprocess.run([sys.executable, "-c", code, str(model_src), str(d), variant], check=True)
            prompts_for(d, gate_src, dest / f"prompts_tm-{variant}.json")

    files = sorted(p for p in dest.rglob("*") if p.is_file())
    manifest = {"wheel": WHEEL, "wheel_sha256": WHEEL_SHA256, "dropped_from_wheel": dropped,
                "stack": str(STACK.relative_to(ROOT)), "stack_hash": shash, "series": names,
                "overlay": changed, "files": {str(p.relative_to(dest)): sha256(p) for p in files}}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(p.stat().st_size for p in files)
    print(f"bundle: {dest} ({size / 2**20:.1f} MiB, {len(files)} files), stack hash {shash}")
    print(f"device command, from the repository that holds {dest.parent.name}/ (carry ['{dest.parent.name}']):")
    print(f"  bash {dest.parent.name}/{dest.name}/run.sh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
