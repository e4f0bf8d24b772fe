"""What every command shares: the project context, output helpers, --json, progress.

Output rules: stdout carries the result (`out`: verdicts, what was applied or written, tables,
or exactly one JSON document with --json, which every command takes); progress and notes
(`note`, `Progress`) and errors go to stderr as plain text, with --json too. `-q` silences
progress and notes (errors and warnings stay), `-v` adds each line the current step's tool
prints (pip, the engine). Colour only on a terminal, never with NO_COLOR, or as `--color`
says. Text is never interpreted as markup: `[mirrors]` and `dsadapt[models]` print as written.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import click

from patcher.base.config import Config, load_config
from patcher.base.errors import UsageError, escape_line, plural  # noqa: F401 - plural is for the commands
from patcher.cli import options
from patcher.cli.options import color_enabled, verbosity
from patcher.formats.lock import Lock, load_lock
from patcher.formats.pinref import PinRef, near_pin, parse_pinref


@dataclass
class Context:
    project: Path | None
    _cfg: Config | None = None
    _lock: Lock | None = None
    json: bool = False
    report_dir: Path | None = None
    publish: bool = False

    @property
    def cfg(self) -> Config:
        if self._cfg is None:
            cfg = load_config(self.project, report_dir=self.report_dir)
            self._cfg = replace(cfg, reports=cfg.published_reports) if self.publish else cfg
        return self._cfg

    @property
    def lock(self) -> Lock:
        if self._lock is None:
            self._lock = load_lock(self.cfg.lock_path)
        return self._lock

    def reload_lock(self) -> Lock:
        self._lock = None
        return self.lock


pass_ctx = click.make_pass_decorator(Context)


def _json_default(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    """A command's --json, or the global `dsadapt --json CMD`."""
    obj = ctx.find_object(Context)
    return bool(value or (obj is not None and obj.json))


json_option = click.option("--json", "as_json", is_flag=True, callback=_json_default,
                           help="Machine-readable output: exactly one JSON document on stdout (errors too).")


class PinRefParam(click.ParamType):
    """ENGINE@TAG, parsed (and, for `pinned`, looked up in upstream.lock) while the arguments are
    parsed: a bad pin fails before the command does anything, even before the work-dir lock."""

    name = "ENGINE@TAG"

    def __init__(self, pinned: bool = True):
        self.pinned = pinned

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str):
        """Shell completion: the pins of upstream.lock (ENGINE@TAG) that start with what was typed."""
        from click.shell_completion import CompletionItem

        try:
            lock = load_lock(load_config(None).lock_path)
        except Exception:  # noqa: BLE001 - no project here: nothing to offer
            return []
        return [CompletionItem(p) for p in sorted(lock.pins) if p.startswith(incomplete)]

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> PinRef:
        if isinstance(value, PinRef):
            return value
        obj = ctx.find_object(Context) if ctx is not None and not ctx.resilient_parsing else None
        if obj is not None:
            try:
                ref = parse_pinref(str(value))
            except UsageError as e:
                _near_pin(obj, str(value), e)  # "did you mean vllm@v0.32.0" for vllm-v0.32.0, VLLM@v0.32.0
                raise
        else:
            ref = parse_pinref(str(value))
        if self.pinned and obj is not None:
            obj.lock.pin(ref)
        return ref


def _near_pin(obj: Context, text: str, error: UsageError) -> None:
    """The parser's `error` again, its hint naming the pinned ENGINE@TAG that `text` plainly means
    (`near_pin`), where the lock has one."""
    try:
        pins = obj.lock.pins
    except Exception:  # noqa: BLE001 - no readable lock: the parser's own error stands
        return
    meant = near_pin(text, pins)
    if meant:
        raise UsageError(error.message, hint=f"did you mean {meant}?") from None


def complete_model(ctx: click.Context, param: click.Parameter, incomplete: str):
    """Shell completion of --model: the built-in tiny models, then directories (the shell's own)."""
    from click.shell_completion import CompletionItem

    from patcher.checkpoints.tiny import VARIANTS

    return [CompletionItem(m, help="built-in tiny model") for m in VARIANTS if m.startswith(incomplete)] + \
        [CompletionItem(incomplete, type="dir")]


def complete_engine(ctx: click.Context, param: click.Parameter, incomplete: str):
    """Shell completion of an ENGINE argument: the engines of upstream.lock."""
    from click.shell_completion import CompletionItem

    try:
        lock = load_lock(load_config(None).lock_path)
    except Exception:  # noqa: BLE001 - no project here: nothing to offer
        return []
    return [CompletionItem(e) for e in sorted(lock.engines) if e.startswith(incomplete)]


def complete_tag(ctx: click.Context, param: click.Parameter, incomplete: str):
    """Shell completion of a TAG option (`rebase --onto`): the pinned tags newer than the pin already
    on the command line (every pinned tag without one)."""
    from click.shell_completion import CompletionItem

    try:
        lock = load_lock(load_config(None).lock_path)
    except Exception:  # noqa: BLE001 - no project here: nothing to offer
        return []
    # the option waiting for its value leaves the words before it unparsed, in ctx.args
    pin = (ctx.params or {}).get("pin") or next((a for a in ctx.args if "@" in a), None)
    if pin and str(pin) in lock.pins:
        later = lock.pins_of(str(pin).partition("@")[0])
        tags = [p.tag for p in later[[str(p.ref) for p in later].index(str(pin)) + 1:]]
    else:
        tags = sorted({p.tag for p in lock.pins.values()})
    return [CompletionItem(t) for t in tags if t.startswith(incomplete)]


model_option = click.option(
    "--model", default="v3", show_default=True, shell_complete=complete_model,
    help="Built-in tiny model (v3, v2-lite, v2) or a model directory.")


junit_option = click.option(
    "--junit", "junit", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE",
    help="Also write the verdicts as JUnit XML to FILE (one test case per pin and configuration; CI test reports).")


def _publish(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    obj = ctx.find_object(Context)
    if value and obj is not None:
        obj.publish = True
        if obj._cfg is not None:
            obj._cfg = replace(obj._cfg, reports=obj._cfg.published_reports)
    return value


publish_option = click.option(
    "--publish", is_flag=True, expose_value=False, callback=_publish,
    help="Write the report into the project's committed reports/ (default: the work dir's reports/, "
         "so runs never change committed files).")


def parallel_options(f=None, *, served: bool = False):
    """--tp N and --ep: the engine's parallel configuration; the HF reference stays one process
    (`check`, `bisect`), or, with `served`, both servers of `perf` get the same (there is no reference)."""
    def deco(f):
        f = click.option("--ep", is_flag=True,
                         help="Expert parallelism: spread the routed experts over the --tp ranks (where the "
                              "engine offers it; needs --tp 2 or more).")(f)
        where = ("; the patched and the unpatched server run the same ranks" if served else
                 "; the HF reference stays one process")
        return click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
                            help=f"Run the engine with tensor parallel size N, one rank a device (CPU core or GPU, "
                                 f"as the engine's contract says){where}.")(f)

    return deco(f) if f is not None else deco


def model_options(f):
    """--model and --config-style: the checkpoint the gate runs on."""
    f = click.option("--config-style", type=click.Choice(["transformers", "deepseek"]), default=None,
                     help="config.json style of a built-in model: transformers (what save_pretrained writes) or "
                          "deepseek (DeepSeek's released keys). Default: the engine's own, which `dsadapt list` shows "
                          "(config_style with --json) and its page in docs/engines/ states under \"Default config "
                          "style\".")(f)
    return model_option(f)


def build_options(verb: str):
    """--variant, --unpatched and --unpatched-engine: which build of the pin the gate runs (`verb`:
    what the command does with it, for --unpatched's help)."""
    def add(f):
        f = click.option("--unpatched-engine", is_flag=True,
                         help="For a pin that serves another pinned engine (`serves` in upstream.lock): that engine "
                              "unpatched, this stack applied.")(f)
        f = click.option("--unpatched", is_flag=True,
                         help=f"{verb} the pristine upstream release instead of the stack.")(f)
        return click.option("--variant", default=None,
                            help="Engine build variant (default: the first this machine can run).")(f)
    return add


prompt_seed_option = click.option(
    "--prompt-seed", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
    help="0: the gate's fixed prompts; N: another prompt set of the same shape drawn from the shipped corpus "
         "(repeat a check on independent inputs; its report is named …-seedN).")


def to_parallel(tp: int, ep: bool):
    """The parallel configuration of --tp/--ep, or UsageError (exit 2) for --ep without ranks."""
    from patcher.engines.base import Parallel

    if ep and tp < 2:
        raise UsageError("--ep spreads the experts over the tensor-parallel ranks: it needs --tp 2 or more",
                         hint="e.g. --tp 2 --ep")
    return Parallel(tp, ep)


def pinref_arg(required: bool = True, pinned: bool = True):
    """The ENGINE@TAG argument; optional ones show as [ENGINE@TAG] in the usage line."""
    return click.argument("pin", metavar="ENGINE@TAG" if required else "[ENGINE@TAG]", required=required,
                          type=PinRefParam(pinned))


def to_ref(text: str | PinRef | None) -> PinRef | None:
    """An optional pin argument (None when not given)."""
    if text is None or text == "":
        return None
    return text if isinstance(text, PinRef) else parse_pinref(text)


def ref_of(text: str | PinRef) -> PinRef:
    """A required pin argument (already parsed by PinRefParam)."""
    return text if isinstance(text, PinRef) else parse_pinref(text)


def op_flags(f):
    """--continue / --skip / --abort: `git am --continue` habits, the same as `dsadapt continue`..."""
    for name, what in (("abort", "dsadapt abort"), ("skip", "dsadapt skip"), ("continue", "dsadapt continue")):
        f = click.option(f"--{name}", f"op_{name}", is_flag=True, help=f"Same as `{what} [ENGINE@TAG]`.")(f)
    return f


def run_op(click_ctx: click.Context, ctx: Context, pin, flags: dict[str, bool], command: str) -> bool:
    """Run the operation a --continue/--skip/--abort flag names (True), or nothing (False): the
    command of that name (`dsadapt continue`, `skip`, `abort`), found in the command group."""
    chosen = [n.removeprefix("op_") for n, on in flags.items() if on]
    if not chosen:
        return False
    if len(chosen) > 1:
        raise UsageError(f"pass one of --{', --'.join(chosen)}", hint=f"e.g. dsadapt {command} --continue")
    extra = [p.name for p in click_ctx.command.params
             if p.name not in ("pin", "as_json", *flags) and p.name is not None
             and click_ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE]
    if extra:
        raise UsageError(f"--{chosen[0]} takes only [ENGINE@TAG] (and --json), not --{extra[0].replace('_', '-')}",
                         hint=f"dsadapt {command} --{chosen[0]} [ENGINE@TAG]")
    root = click_ctx.find_root()
    target = root.command.get_command(root, chosen[0]) if isinstance(root.command, click.Group) else None
    assert target is not None, chosen[0]  # `dsadapt continue`, `skip` and `abort` are commands of the group
    click_ctx.invoke(target, pin=pin, as_json=click_ctx.params.get("as_json", False))
    return True



# ---------------------------------------------------------------- output

_emitted_json = False
#: off a terminal, table lines are kept within this many columns (COLUMNS overrides)
PLAIN_WIDTH = 100
#: a word (between spaces, or after a hyphen) up to this long is never broken by a table's wrapping
WORD_MAX = 40


_VERDICT_COLORS = {"PASS": "32", "OK": "32", "FAIL": "31", "FAILED": "31", "NOT VERIFIED": "33", "NOT RUN": "33"}


def verdict_word(word: str) -> str:
    """A verdict word (PASS, FAIL, ok, FAILED...), green or red where colour is on."""
    code = _VERDICT_COLORS.get(word.upper())
    return f"\x1b[{code};1m{word}\x1b[0m" if code and color_enabled() else word


def emit_json(data, schema: str | None = None) -> None:
    """The command's one JSON document on stdout. Every document names its `schema`
    ("dsadapt.<what>/<version>", docs/json.md): a document that carries none gets `schema`."""
    global _emitted_json
    if isinstance(data, dict) and schema and "schema" not in data:
        data = {"schema": schema, **data}
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    _emitted_json = True


def json_emitted() -> bool:
    return _emitted_json


def reset_output() -> None:
    global _emitted_json
    _emitted_json = False
    options.reset()


def out(msg: str, *, verdict: str | None = None) -> None:
    """A line of the command's result, on stdout (`dsadapt check ... > log` keeps the verdict).
    `verdict`: the first occurrence of that word (PASS, FAIL, ok...) is coloured where colour is on."""
    _live_clear()
    msg = "\n".join(escape_line(line) for line in msg.split("\n"))  # data never drives the terminal
    if verdict and verdict in msg:
        msg = msg.replace(verdict, verdict_word(verdict), 1)
    click.echo(msg)


def note(msg: str) -> None:
    """A note for people (progress aside), on stderr; silenced by -q."""
    if verbosity() < 0:
        return
    warn(msg)


def warn(msg: str) -> None:
    """A warning, on stderr, even with -q."""
    _live_clear()
    msg = "\n".join(escape_line(line) for line in msg.split("\n"))
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()





def table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A table on stdout: rich's box drawing on a terminal, plain aligned columns in pipes and logs
    (without importing rich, which would be most of a short command's start-up time)."""
    if not sys.stdout.isatty() and options.color() != "always":
        _live_clear()
        click.echo(plain_table(title, columns, rows, width=plain_width()))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(title) if title else None, show_lines=False)
    for c in columns:
        t.add_column(escape(c), overflow="fold")
    for r in rows:  # cells are data (paths, error texts with [brackets]), never markup
        t.add_row(*[escape(str(x)) for x in r])
    # --color=always in a pipe: rich's table with colour, as wide as the plain one
    console = Console(file=sys.stdout, highlight=False, soft_wrap=True, emoji=False,
                      width=None if sys.stdout.isatty() else plain_width(), no_color=not color_enabled(),
                      force_terminal=True if options.color() == "always" else None)
    console.print(t)


def plain_width() -> int:
    """Columns a table may use off a terminal: COLUMNS when set, else PLAIN_WIDTH."""
    import os

    try:
        return max(int(os.environ.get("COLUMNS", "")), 40)
    except ValueError:
        return PLAIN_WIDTH


def plain_table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[object]],
                width: int | None = None) -> str:
    """Aligned columns for pipes and logs. With `width`, no line is longer: the widest columns are
    narrowed and their cells wrapped onto continuation lines, at spaces and after hyphens
    (`v2-lite-deepseek-` / `bfloat16.json`); a column is never narrowed below its longest word (up
    to `WORD_MAX` characters: names never break mid-word, a longer run of characters does)."""
    import textwrap

    cells = [[escape_line(str(c)) for c in columns]] + [[escape_line(str(x)) for x in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    if width is not None:
        gaps = 2 * (len(columns) - 1)
        # columns of short values (pins, verdicts, dates) keep their width; long text wraps
        words = [max((len(w) for r in cells for w in _words(r[i])), default=0) for i in range(len(columns))]
        # narrowed in stages: down to 18 columns or the longest word, then to the longest word (up to
        # WORD_MAX), and only then inside words
        stages = [[min(widths[i], max(len(columns[i]), 18, min(words[i], WORD_MAX))) for i in range(len(columns))],
                  [min(widths[i], words[i], WORD_MAX) for i in range(len(columns))],
                  [1] * len(columns)]
        for floor in stages:
            while sum(widths) + gaps > width:
                i = max(range(len(widths)), key=lambda j: widths[j] - floor[j])
                if widths[i] <= floor[i]:
                    break
                widths[i] -= 1

    def wrap(text: str, w: int) -> list[str]:
        if len(text) <= w:
            return [text]
        return textwrap.wrap(text, w, break_long_words=True, break_on_hyphens=True) or [""]

    def lines(r: list[str]) -> list[str]:
        parts = [wrap(c, w) for c, w in zip(r, widths)]
        return ["  ".join((p[n] if n < len(p) else "").ljust(w) for p, w in zip(parts, widths)).rstrip()
                for n in range(max(len(p) for p in parts))]

    text = [escape_line(title)] if title else []
    text += lines(cells[0]) + ["  ".join("-" * w for w in widths)]
    for r in cells[1:]:
        text += lines(r)
    return "\n".join(text)


def _words(text: str) -> list[str]:
    """The pieces a table's wrapping may put on separate lines (textwrap's own split: at spaces, and
    after a hyphen that follows a word)."""
    import textwrap

    return [w for w in textwrap.TextWrapper.wordsep_re.split(text) if w and not w.isspace()]


def isatty() -> bool:
    return sys.stderr.isatty()


# ---------------------------------------------------------------- progress


class Progress:
    """Progress on stderr: the current phase, its elapsed time, and what it waits on.

    Calling it (`progress("installing torch")`) starts a phase; `note(line)` says what the phase
    is waiting on (pip's last line, the engine's last log line). On a TTY one live line shows
    the phase with a running clock; otherwise (CI logs) plain lines: the phase when it starts, a
    line every `heartbeat` seconds while it lasts, and its time when it ends after `slow` seconds.
    """

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None, heartbeat: float = 15.0,
                 slow: float = 2.0, verbose: bool = False):
        self._stream = stream
        self.verbose = verbose
        self.live = self.stream.isatty() if live is None else live
        self.heartbeat, self.slow = heartbeat, slow
        self.phase: str | None = None
        self.detail = ""
        self.t0 = self.started = time.monotonic()
        self._last_beat = self._detail_at = self.t0
        self._beat_detail = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._line_shown = False

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stderr

    def __call__(self, msg: str) -> None:
        self.start(msg)

    def start(self, msg: str) -> None:
        with self._lock:
            self._end_phase()
            self.phase, self.detail = escape_line(msg), ""
            self.t0 = self._last_beat = self._detail_at = time.monotonic()
            self._beat_detail = ""
            self._write(f"… {self.phase}\n")
        self._ensure_thread()

    def end(self) -> None:
        """The current step is over (its time is printed if it was slow); heartbeats stop until the next."""
        with self._lock:
            self._end_phase()
            self.phase, self.detail = None, ""

    def step(self, msg: str) -> None:
        """Start a phase whose outcome `done` reports (one line per step in a log): on a TTY the
        live line shows it; in plain output only heartbeats do, until `done`."""
        with self._lock:
            self._end_phase()
            self.phase, self.detail = escape_line(msg), ""
            self.t0 = self._last_beat = time.monotonic()
            if self.live:
                self._write("\r\x1b[K" + f"… {self.phase}"[:_width() - 1])
                self._line_shown = True
        self._ensure_thread()

    def done(self, outcome: str) -> None:
        """End the current phase with one line: `outcome` (the step's result), with its time when slow."""
        with self._lock:
            took = time.monotonic() - self.t0
            if self._line_shown:
                self._write("\r\x1b[K")
                self._line_shown = False
            text = escape_line(outcome)
            self._write(f"  {text} ({took:.0f} s)\n" if self.phase is not None and took >= self.slow else f"  {text}\n")
            self.phase = None

    def note(self, line: str) -> None:
        """What the current phase is waiting on (shown live, or in the next heartbeat line)."""
        line = escape_line(line.strip())
        if line:
            self.detail = line[:160]
            self._detail_at = time.monotonic()
            if self.verbose:  # -v: every line, as it comes
                with self._lock:
                    if self._line_shown:
                        self._write("\r\x1b[K")
                        self._line_shown = False
                    self._write(f"    | {line}\n")

    def close(self) -> None:
        """Stop the clock without a closing line: the command's result says how it ended."""
        self._stop.set()
        with self._lock:
            if self._line_shown:
                self._write("\r\x1b[K")
                self._line_shown = False
            self.phase = None
        _ACTIVE.discard(self)

    def clear_line(self) -> None:
        with self._lock:
            if self._line_shown:
                self._write("\r\x1b[K")
                self._line_shown = False

    # -------------------------------------------------------------- internals

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr never fails the command
            pass

    def _end_phase(self) -> None:
        if self.phase is None:
            return
        took = time.monotonic() - self.t0
        if self._line_shown:
            self._write("\r\x1b[K")
            self._line_shown = False
        if took >= self.slow:
            self._write(f"  {self.phase}: {took:.0f} s\n")

    def _ensure_thread(self) -> None:
        if self._thread is None:
            _ACTIVE.add(self)
            self._thread = threading.Thread(target=self._tick, name="dsadapt-progress", daemon=True)
            self._thread.start()

    def _tick(self) -> None:
        while not self._stop.wait(0.25 if self.live else 1.0):
            with self._lock:
                if self.phase is None:
                    continue
                now = time.monotonic()
                took = now - self.t0
                if took < self.slow:
                    continue
                waiting = f" — {self.detail}" if self.detail else ""
                if self.live:
                    text = f"… {self.phase} ({took:.0f} s){waiting}"
                    self._write("\r\x1b[K" + text[:_width() - 1])
                    self._line_shown = True
                elif now - self._last_beat >= self.heartbeat:
                    self._last_beat = now
                    if self.detail and self.detail == self._beat_detail:  # said already: how long it is quiet
                        waiting = f" — no new output for {now - self._detail_at:.0f} s"
                    self._beat_detail = self.detail
                    self._write(f"  … still {self.phase} ({took:.0f} s){waiting}\n")


_ACTIVE: set[Progress] = set()


def _width() -> int:
    import shutil

    return max(shutil.get_terminal_size((100, 20)).columns, 40)


def _live_clear() -> None:
    for p in list(_ACTIVE):
        p.clear_line()


def close_progress() -> None:
    """End every live progress line (the CLI edge calls this before printing a result or error)."""
    for p in list(_ACTIVE):
        p.close()


def progress_printer(enabled: bool = True) -> Progress | None:
    """The command's progress on stderr (with --json too); None with -q or when not `enabled`."""
    return Progress(verbose=verbosity() > 0) if enabled and verbosity() >= 0 else None


def version_info() -> dict:
    """What `dsadapt --version` says: dsadapt's version, the Python and environment it runs in,
    where it was imported from, and the versions of the packages its gate relies on."""
    import importlib.metadata as md
    import platform

    import patcher

    def v(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {"schema": "dsadapt.version/1", "dsadapt": patcher.__version__,
            "python": platform.python_version(), "implementation": platform.python_implementation(),
            "executable": sys.executable, "environment": sys.prefix, "venv": sys.prefix != sys.base_prefix,
            "source": str(Path(patcher.__file__).resolve().parent),
            "packages": {n: v(n) for n in ("torch", "transformers", "click", "GitPython", "uv")}}


def rel_path(path, root) -> str:
    """`path` relative to `root` where it lies inside it, else as it is."""
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return str(path)


def lock_for_new_pin(ctx: Context, ref, *, as_json: bool = False) -> dict:
    """What `pin` and `rebase --onto` do for the pin they add: make the hash lock of each of its
    environments that has none (PyPI only). When that is not possible, one line, said at once,
    names why and the command to run later; the pin itself stands. Returns the JSON part."""
    from patcher.artifacts.envlocks import lock_command, lock_pin, pin_envs
    from patcher.base.errors import DsadaptError, one_line

    lock = ctx.reload_lock()
    try:
        envs = pin_envs(lock, ref)
    except DsadaptError:  # nothing to lock (a pin without release artifacts, a served engine not pinned)
        return {}
    if all(e.spec is None for e in envs):
        return {}
    try:
        done = lock_pin(ctx.cfg.project, lock, ref, progress=progress_printer())
    except DsadaptError as e:
        line = f"no environment lock for {ref}: {one_line(e.message)}; run `{lock_command(str(ref))}` when that is fixed"
        warn(f"warning: {line}")
        return {"locks": [], "lock_error": {"message": e.message, "hint": e.hint, "exit_code": int(e.exit_code),
                                            "command": lock_command(str(ref))}}
    if not as_json:
        for d in done:
            if d.env is None:
                out(f"  environment lock ({d.variant}): not needed ({d.note})")
            else:
                where = rel_path(d.path, ctx.cfg.project) if d.origin == "project" else f"{d.path} (shipped with dsadapt)"
                out(f"  environment lock ({d.variant}): {d.state} {where}")
            if d.note and d.env is not None:
                note(f"  note: {d.note}")
    return {"locks": [d.to_json() for d in done]}
