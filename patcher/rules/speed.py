"""The speed gate's data and statistics (pure): workload, per-run metrics, paired ratios with
bootstrap confidence intervals, the verdict. No processes, no files: `patcher.gate.perf` runs
the engines; this module decides what their numbers mean.

Design (docs/speed.md has the method and the measurements behind the defaults):

- A *workload* is a fixed list of requests, several prompt/output length *mixes*
  interleaved (one of them past YaRN's original context), sent at each *concurrency*.
- A *run* is the workload sent once to one side (patched or unpatched build) at one
  concurrency; it yields per-request records (TTFT, latency, tokens).
- Rounds alternate the sides (A B, then B A, ...), so each round gives one *pair* of runs
  made back to back under the same machine load. Per metric and pair the ratio is
  oriented so that < 1 means the patched build is slower: throughput patched/unpatched,
  latency unpatched/patched.
- The estimate is the geometric mean of the per-round ratios; its confidence interval is
  a bootstrap over rounds (pairs are resampled whole): the percentile interval, expanded for
  the small number of rounds so that it covers about 95 % (see `bootstrap_ci`).
- Verdict: fail when, at any concurrency, a gated metric's interval lies entirely below
  the threshold (default 0.95), or when any request failed; pass otherwise.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from patcher.base.errors import UsageError

SCHEMA = "dsadapt.perf-report/1"
RUN_SCHEMA = "dsadapt.perf-run/1"

DEFAULT_THRESHOLD = 0.95
DEFAULT_CONCURRENCY = (1, 4, 16)
DEFAULT_ROUNDS = 6  # even: each side goes first in half the rounds at every level (`schedule`)
CI_LEVEL = 0.95
BOOTSTRAP_SAMPLES = 10_000
#: Side names: A is the build under test, B the baseline it is compared with.
PATCHED, UNPATCHED = "patched", "unpatched"
#: How far past YaRN's original context the long mix's prompt reaches (as the gate's prompts).
LONG_PAST_ORIGINAL = 48


@dataclass(frozen=True)
class Metric:
    name: str
    label: str
    unit: str
    higher_is_better: bool
    gated: bool


#: Every per-run metric, in display order. Gated ones decide the verdict.
METRICS: tuple[Metric, ...] = (
    Metric("output_throughput", "output tokens/s", "tok/s", True, True),
    Metric("request_throughput", "requests/s", "req/s", True, False),
    Metric("ttft_mean", "TTFT mean", "ms", False, True),
    Metric("ttft_p50", "TTFT p50", "ms", False, False),
    Metric("ttft_p90", "TTFT p90", "ms", False, False),
    Metric("ttft_p99", "TTFT p99", "ms", False, False),
    Metric("tpot_mean", "TPOT mean", "ms", False, True),
    Metric("tpot_p50", "TPOT p50", "ms", False, False),
    Metric("tpot_p90", "TPOT p90", "ms", False, False),
    Metric("tpot_p99", "TPOT p99", "ms", False, False),
    Metric("e2el_mean", "latency mean", "ms", False, False),
    Metric("e2el_p50", "latency p50", "ms", False, False),
    Metric("e2el_p90", "latency p90", "ms", False, False),
    Metric("e2el_p99", "latency p99", "ms", False, False),
)
METRIC = {m.name: m for m in METRICS}
GATED = tuple(m.name for m in METRICS if m.gated)


# ---------------------------------------------------------------- workload


@dataclass(frozen=True)
class Mix:
    """One prompt/output length mix: `requests` requests of `input_len` prompt tokens that
    generate exactly `output_len` tokens (EOS ignored)."""

    name: str
    input_len: int
    output_len: int
    requests: int


@dataclass(frozen=True)
class RequestSpec:
    index: int
    mix: str
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Workload:
    mixes: tuple[Mix, ...]
    concurrency: tuple[int, ...]
    rounds: int
    warmup_rounds: int = 1
    max_model_len: int = 256
    #: requests per run at each level (aligned with `concurrency`); () = every level runs all of `requests()`
    per_level: tuple[int, ...] = ()

    def requests(self) -> list[RequestSpec]:
        """The fixed request list: mixes interleaved round-robin (a, b, c, a, b, c, ...)."""
        out: list[RequestSpec] = []
        for k in range(max(m.requests for m in self.mixes)):
            for m in self.mixes:
                if k < m.requests:
                    out.append(RequestSpec(len(out), m.name, m.input_len, m.output_len))
        return out

    def requests_at(self, concurrency: int) -> list[RequestSpec]:
        """The requests of one run at `concurrency`: the first of the fixed list (the mixes stay
        interleaved, so every run of a level sends the same ones, as balanced as they go)."""
        every = self.requests()
        if not self.per_level:
            return every
        return every[:dict(zip(self.concurrency, self.per_level))[concurrency]]

    def to_json(self) -> dict:
        n = len(self.requests())
        return {"mixes": [asdict(m) for m in self.mixes], "concurrency": list(self.concurrency),
                "rounds": self.rounds, "warmup_rounds": self.warmup_rounds, "max_model_len": self.max_model_len,
                "requests_per_run": n,
                "requests_per_level": {str(c): len(self.requests_at(c)) for c in self.concurrency}}


def parse_int_list(text: str | None, option: str, *, zero: bool = False) -> tuple[int, ...] | None:
    """'1,4,16' -> (1, 4, 16); positive integers only (`zero`: 0 too, for a caller that says
    itself why 0 is wrong); None (the option not given) -> None. An empty value given on the
    command line (`--concurrency ''`) is refused: it never silently means the default."""
    if text is None:
        return None
    if not str(text).strip():
        raise UsageError(f"{option} is empty", hint=f"give a comma list, e.g. {option} 1,4,16, or leave the option out")
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit() or (int(part) <= 0 and not zero):
            raise UsageError(f"{option} {text!r}: {part!r} is not a positive integer",
                             hint=f"give a comma list, e.g. {option} 1,4,16")
        out.append(int(part))
    return tuple(out)


def default_mixes(original_context: int | None, max_model_len: int, requests_per_mix: int) -> tuple[Mix, ...]:
    """Decode-heavy, prefill-heavy, and a long prompt past YaRN's original context.

    With the tiny models (original context 64, max_model_len 256): 16->48, 48->16, 112->32.
    """
    long_in = (original_context + LONG_PAST_ORIGINAL) if original_context else max_model_len // 2
    long_out = 32
    long_in = max(1, min(long_in, max_model_len - long_out))
    return (Mix("short", 16, 48, requests_per_mix), Mix("medium", 48, 16, requests_per_mix),
            Mix("long", long_in, long_out, requests_per_mix))


#: Requests per run at concurrency c, by default: `REQUESTS_PER_STREAM` per concurrent stream, at
#: least `MIN_REQUESTS` -- 16 at concurrency 1 and 4, 64 at 16. A run at concurrency c keeps c
#: requests in flight (a closed loop), so four per stream make every level a steady state of
#: several waves rather than one opening burst, whose batching depends on the server's own speed.
REQUESTS_PER_STREAM = 4
MIN_REQUESTS = 16


def default_requests(concurrency: int) -> int:
    return max(MIN_REQUESTS, REQUESTS_PER_STREAM * concurrency)


def build_workload(*, original_context: int | None, max_model_len: int = 256,
                   input_lens: Sequence[int] | None = None, output_lens: Sequence[int] | None = None,
                   concurrency: Sequence[int] | None = None, rounds: int = DEFAULT_ROUNDS,
                   requests: int | Sequence[int] | None = None, warmup_rounds: int = 1) -> Workload:
    """The workload from the command-line options (validated; UsageError with a hint).

    `requests` is the number of requests per run: one number for every level, or a sequence with
    one per concurrency level (in the order of `concurrency`); default `default_requests(c)` at
    each level. A run sends exactly that many: the first of one fixed list, whose mixes are
    interleaved and hold as many requests as the largest run needs, spread as evenly as they go.
    `input_lens`/`output_lens` replace the default mixes (a single value is used for every mix).
    """
    conc = tuple(concurrency or DEFAULT_CONCURRENCY)
    _check_options(conc, rounds, warmup_rounds, max_model_len)
    per_level = _requests_per_level(requests, conc)
    n_mixes = 3 if not (input_lens or output_lens) else max(len(input_lens or ()), len(output_lens or ()))
    if min(per_level) < n_mixes:
        raise UsageError(f"--requests {min(per_level)} is fewer than the {n_mixes} prompt/output mixes "
                         "(each needs a request)", hint=f"use --requests {n_mixes} or more")
    total = max(per_level)
    # exactly `total` requests in the list: the first mixes get one more when it does not divide evenly
    per_mix = [total // n_mixes + (1 if i < total % n_mixes else 0) for i in range(n_mixes)]
    mixes = _mixes(original_context, max_model_len, input_lens, output_lens, per_mix)
    stored = () if len(set(per_level)) == 1 else per_level
    return Workload(mixes, conc, rounds, warmup_rounds, max_model_len, stored)


def _check_options(conc: tuple[int, ...], rounds: int, warmup_rounds: int, max_model_len: int) -> None:
    if len(set(conc)) != len(conc):
        raise UsageError(f"--concurrency {','.join(map(str, conc))}: a level is repeated", hint="list each level once")
    if rounds < 2:
        raise UsageError(f"--rounds {rounds}: the confidence interval needs at least 2 rounds",
                         hint=f"use --rounds 3 or more ({DEFAULT_ROUNDS} is the default)")
    if warmup_rounds < 0:
        raise UsageError("--warmup must be 0 or more", hint="1 warm-up round is the default")
    if max_model_len < 2:
        raise UsageError(f"--max-model-len {max_model_len} is too small", hint="use 256 for the built-in models")


def _requests_per_level(requests: int | Sequence[int] | None, conc: tuple[int, ...]) -> tuple[int, ...]:
    """Requests per run at each level (aligned with `conc`), from the option's one or per-level values."""
    if requests is None:
        return tuple(default_requests(c) for c in conc)
    given = (requests,) if isinstance(requests, int) else tuple(requests)
    if len(given) not in (1, len(conc)):
        raise UsageError(f"--requests has {len(given)} values for {len(conc)} concurrency levels",
                         hint="give one value for every level (in the order of --concurrency), or one for all")
    if min(given) < 1:
        raise UsageError("--requests must be positive", hint="e.g. --requests 32")
    return given * len(conc) if len(given) == 1 else given


def _mixes(original_context: int | None, max_model_len: int, input_lens: Sequence[int] | None,
           output_lens: Sequence[int] | None, per_mix: list[int]) -> tuple[Mix, ...]:
    """The mixes with their request counts: the default three, or the ones --input-len/--output-len
    name; each checked against the context length."""
    if input_lens or output_lens:
        ins, outs = list(input_lens or ()), list(output_lens or ())
        if ins and outs and len(ins) != len(outs) and 1 not in (len(ins), len(outs)):
            raise UsageError(f"--input-len has {len(ins)} values and --output-len {len(outs)}",
                             hint="give both the same number of values (one mix each), or one value for all")
        n = max(len(ins), len(outs))
        ins = ins * n if len(ins) == 1 else ins or [16] * n
        outs = outs * n if len(outs) == 1 else outs or [32] * n
        mixes = tuple(Mix(f"in{i}-out{o}", i, o, k) for (i, o), k in zip(zip(ins, outs), per_mix))
    else:
        mixes = tuple(replace(m, requests=k) for m, k in zip(default_mixes(original_context, max_model_len, 1),
                                                            per_mix))
    for m in mixes:
        if m.output_len < 2:
            raise UsageError(f"mix {m.name}: --output-len must be at least 2 (TPOT needs two tokens)",
                             hint="e.g. --output-len 32")
        if m.input_len + m.output_len > max_model_len:
            raise UsageError(f"mix {m.name}: {m.input_len} prompt + {m.output_len} output tokens exceed "
                             f"--max-model-len {max_model_len}",
                             hint="shorten --input-len/--output-len or raise --max-model-len (within the model's context)")
    return mixes


# ---------------------------------------------------------------- runs


@dataclass(frozen=True)
class RequestRecord:
    """One request as the load generator saw it (seconds; output_len = tokens received)."""

    mix: str
    input_len: int
    output_len: int
    ttft_s: float
    latency_s: float
    ok: bool = True
    error: str = ""
    #: when it was sent, seconds from the run's first request (None: the load tool does not say);
    #: the spread of the opening burst is in the report (`arrival_spread`)
    sent_s: float | None = None


@dataclass
class RunRecord:
    side: str
    round: int                 # 0-based; warm-up rounds are not recorded
    concurrency: int
    duration_s: float
    requests: list[RequestRecord]
    order: int = 0             # position in the schedule (for drift plots)
    tool: dict = field(default_factory=dict)   # the load tool's own summary, as it reported it
    peak_rss: int | None = None                # bytes of the side's server group, sampled during the run
    peak_gpu: int | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["requests"] = [asdict(r) for r in self.requests]
        return d


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def tpot_s(r: RequestRecord) -> float | None:
    """Time per output token after the first: (latency - TTFT) / (tokens - 1)."""
    return (r.latency_s - r.ttft_s) / (r.output_len - 1) if r.ok and r.output_len > 1 else None


def request_metrics(reqs: Sequence[RequestRecord]) -> dict[str, float | None]:
    """TTFT/TPOT/latency statistics of a set of requests (ms), failed ones left out."""
    ok = [r for r in reqs if r.ok]
    ttft = [r.ttft_s * 1000 for r in ok]
    tpot = [t * 1000 for t in (tpot_s(r) for r in ok) if t is not None]
    e2el = [r.latency_s * 1000 for r in ok]
    out: dict[str, float | None] = {}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el)):
        out[f"{name}_mean"] = _mean(xs)
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(xs, q)
    return out


def run_metrics(run: RunRecord) -> dict[str, float | None]:
    """Every METRICS value of one run, plus `completed`/`failed` counts."""
    ok = [r for r in run.requests if r.ok]
    dur = run.duration_s if run.duration_s > 0 else None
    m: dict[str, float | None] = {
        "output_throughput": sum(r.output_len for r in ok) / dur if dur else None,
        "request_throughput": len(ok) / dur if dur else None,
    }
    m.update(request_metrics(run.requests))
    m["completed"] = len(ok)
    m["failed"] = len(run.requests) - len(ok)
    return m


def schedule(rounds: int, concurrency: Sequence[int], sides: tuple[str, str] = (PATCHED, UNPATCHED),
             warmup_rounds: int = 0) -> list[tuple[int, int, str]]:
    """(round, concurrency, side) in execution order; warm-up rounds have negative numbers.

    Every round runs every level, both sides back to back. In even rounds (0, 2, ...) the first
    side goes first at every level, in odd rounds the second: over an even number of measured
    rounds (the default, 6) each side goes first exactly as often as the other at every level,
    so an advantage of going first (or second) cancels in the estimate. Within a round the sides
    alternate run by run (A B A B ...), so a side runs twice in a row only where a round ends and
    the next begins -- never one side always right after its own run while the other waited.
    The warm-up rounds (both sides at every level) all come before the first measured round.
    """
    out = []
    for r in range(-warmup_rounds, rounds):
        first, second = sides if r % 2 == 0 else (sides[1], sides[0])
        for c in concurrency:
            out += [(r, c, first), (r, c, second)]
    return out


def order_balance(plan: Sequence[tuple[int, int, str]], sides: tuple[str, str]) -> dict[int, dict[str, int]]:
    """Pure: per concurrency, how many measured rounds each side went first in (from a schedule)."""
    out: dict[int, dict[str, int]] = {}
    seen: set[tuple[int, int]] = set()
    for rnd, conc, side in plan:
        if rnd < 0 or (rnd, conc) in seen:
            continue
        seen.add((rnd, conc))
        out.setdefault(conc, dict.fromkeys(sides, 0))[side] += 1
    return out


# ---------------------------------------------------------------- ratios


@dataclass(frozen=True)
class Ratio:
    """patched vs unpatched for one metric at one concurrency (< 1: patched slower)."""

    metric: str
    estimate: float | None
    lo: float | None
    hi: float | None
    per_round: tuple[float, ...]
    gated: bool

    def below(self, threshold: float) -> bool:
        """The whole confidence interval is below `threshold`: slower beyond the band."""
        return self.hi is not None and self.hi < threshold

    def to_json(self) -> dict:
        return asdict(self) | {"per_round": list(self.per_round)}


def oriented_ratio(a: float | None, b: float | None, higher_is_better: bool) -> float | None:
    """a = patched, b = unpatched; the ratio with < 1 meaning a is worse. None if undefined."""
    if a is None or b is None or a <= 0 or b <= 0 or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b if higher_is_better else b / a


#: Two-sided 97.5 % Student-t quantiles by degrees of freedom (df > 30: the normal's 1.96).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
         2.042)
_Z975 = 1.959964


def expansion(n: int, level: float = CI_LEVEL) -> float:
    """How much wider than a plain percentile bootstrap interval the interval of `n` rounds is
    made: sqrt(n/(n-1)) * t(n-1) / z (the "expanded percentile" small-sample correction,
    Hesterberg 2015), for the 95 % level; 1 for other levels or n < 2."""
    if n < 2 or abs(level - 0.95) > 1e-9:
        return 1.0
    t = _T975[n - 2] if n - 1 <= len(_T975) else _Z975
    return math.sqrt(n / (n - 1)) * t / _Z975


def bootstrap_ci(values: Sequence[float], stat: Callable[[Sequence[float]], float] | None = None, *,
                 samples: int = BOOTSTRAP_SAMPLES, level: float = CI_LEVEL, seed: int = 0,
                 expand: bool = True) -> tuple[float, float]:
    """Bootstrap interval of `stat` (default: the mean) over resamples of `values`.

    The percentile interval of the resampled statistics, widened around the statistic of the
    data by `expansion(n)` (with few values a plain percentile interval covers far less than its
    level: measured here 74 % at 3 values and 84 % at 5 for a nominal 95 %; expanded, about
    95 %). `expand=False` gives the plain percentile interval. Deterministic for a given seed;
    one value gives a zero-width interval at that value.
    """
    if not values:
        raise ValueError("bootstrap of no values")
    center = float(stat(values)) if stat else sum(values) / len(values)
    if len(values) == 1:
        return center, center
    rng = random.Random(seed)
    n = len(values)
    if stat is None:
        boots = sorted(sum(rng.choices(values, k=n)) / n for _ in range(samples))
    else:
        boots = sorted(stat(rng.choices(values, k=n)) for _ in range(samples))
    alpha = (1.0 - level) / 2.0
    lo, hi = _quantile_sorted(boots, alpha), _quantile_sorted(boots, 1.0 - alpha)
    if not expand:
        return lo, hi
    f = expansion(n, level)
    return center - f * (center - lo), center + f * (hi - center)


def _quantile_sorted(xs: Sequence[float], q: float) -> float:
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def paired_ratio(metric: str, a: Sequence[float | None], b: Sequence[float | None], *,
                 samples: int = BOOTSTRAP_SAMPLES, level: float = CI_LEVEL, seed: int = 0) -> Ratio:
    """Ratio of paired per-round values a[i] (patched) and b[i] (unpatched) for `metric`:
    geometric mean of the per-round ratios, with a bootstrap interval over rounds."""
    spec = METRIC[metric]
    if len(a) != len(b):
        raise ValueError(f"{metric}: {len(a)} patched rounds vs {len(b)} unpatched")
    ratios = [oriented_ratio(x, y, spec.higher_is_better) for x, y in zip(a, b)]
    good = [r for r in ratios if r is not None]
    if not good or len(good) < len(ratios):
        return Ratio(metric, None, None, None, tuple(r for r in good), spec.gated)
    logs = [math.log(r) for r in good]
    lo, hi = bootstrap_ci(logs, samples=samples, level=level, seed=seed)
    est = math.exp(sum(logs) / len(logs))
    return Ratio(metric, est, math.exp(lo), math.exp(hi), tuple(good), spec.gated)


@dataclass
class Point:
    """Everything measured at one concurrency level."""

    concurrency: int
    sides: dict[str, dict]            # side -> aggregated metrics (means over rounds, pooled percentiles)
    per_round: dict[str, list[dict]]  # side -> per-round metric dicts (round order)
    ratios: dict[str, Ratio]
    mixes: dict[str, dict] = field(default_factory=dict)  # mix -> {side: {ttft_mean, tpot_mean}, ratios}

    def to_json(self) -> dict:
        return {"concurrency": self.concurrency, "sides": self.sides, "per_round": self.per_round,
                "ratios": {k: r.to_json() for k, r in self.ratios.items()}, "mixes": self.mixes}


def aggregate(runs: Sequence[RunRecord]) -> dict:
    """One side at one level over its rounds: throughputs as the mean of the runs, request
    statistics over all requests pooled, peak memory the highest seen, failures summed."""
    per = [run_metrics(r) for r in runs]
    reqs = [q for r in runs for q in r.requests]
    out: dict = {"rounds": len(runs)}
    for key in ("output_throughput", "request_throughput"):
        vals: list[float] = [v for v in (p[key] for p in per) if v is not None]
        out[key] = _mean(vals)
    out.update(request_metrics(reqs))
    out["completed"] = sum(int(p["completed"] or 0) for p in per)
    out["failed"] = sum(int(p["failed"] or 0) for p in per)
    rss = [r.peak_rss for r in runs if r.peak_rss is not None]
    gpu = [r.peak_gpu for r in runs if r.peak_gpu is not None]
    out["peak_rss"] = max(rss) if rss else None
    out["peak_gpu"] = max(gpu) if gpu else None
    spreads = [x for x in (burst_spread_s(r) for r in runs) if x is not None]
    out["burst_spread_ms_max"] = round(1000 * max(spreads), 3) if spreads else None
    return out


def build_points(runs: Iterable[RunRecord], concurrency: Sequence[int], sides: tuple[str, str] = (PATCHED, UNPATCHED),
                 *, samples: int = BOOTSTRAP_SAMPLES, level: float = CI_LEVEL, seed: int = 0) -> list[Point]:
    """Pair the measured runs by (concurrency, round) and compute every ratio.

    Raises ValueError when a round lacks one side (the schedule always runs both)."""
    a_side, b_side = sides
    by: dict[tuple[int, int, str], RunRecord] = {}
    for r in runs:
        if r.round >= 0:
            by[(r.concurrency, r.round, r.side)] = r
    boot: dict[str, Any] = {"samples": samples, "level": level, "seed": seed}
    points = []
    for c in concurrency:
        rounds = sorted({rd for (cc, rd, _s) in by if cc == c})
        missing = [rd for rd in rounds if (c, rd, a_side) not in by or (c, rd, b_side) not in by]
        if missing:
            raise ValueError(f"concurrency {c}: round(s) {missing} lack a side")
        a_runs = [by[(c, rd, a_side)] for rd in rounds]
        b_runs = [by[(c, rd, b_side)] for rd in rounds]
        a_per, b_per = [run_metrics(r) for r in a_runs], [run_metrics(r) for r in b_runs]
        ratios = {m.name: paired_ratio(m.name, [p[m.name] for p in a_per], [p[m.name] for p in b_per], **boot)
                  for m in METRICS}
        points.append(Point(c, {a_side: aggregate(a_runs), b_side: aggregate(b_runs)},
                            {a_side: a_per, b_side: b_per}, ratios, _mix_entries(sides, a_runs, b_runs, boot)))
    return points


def _mix_entries(sides: tuple[str, str], a_runs: Sequence[RunRecord], b_runs: Sequence[RunRecord],
                 boot: dict) -> dict[str, dict]:
    """Per mix: each side's pooled TTFT/TPOT/latency and the paired TTFT and TPOT ratios (never gated)."""
    a_side, b_side = sides
    mixes: dict[str, dict] = {}
    for mix in sorted({q.mix for r in (*a_runs, *b_runs) for q in r.requests}):
        entry: dict = {}
        per_side: dict[str, list[dict]] = {}
        for side, side_runs in ((a_side, a_runs), (b_side, b_runs)):
            per_side[side] = [request_metrics([q for q in r.requests if q.mix == mix]) for r in side_runs]
            pooled = request_metrics([q for r in side_runs for q in r.requests if q.mix == mix])
            entry[side] = {k: pooled[k] for k in ("ttft_mean", "tpot_mean", "e2el_p50")}
        entry["ratios"] = {k: replace(paired_ratio(k, [p[k] for p in per_side[a_side]],
                                                   [p[k] for p in per_side[b_side]], **boot), gated=False).to_json()
                           for k in ("ttft_mean", "tpot_mean")}
        mixes[mix] = entry
    return mixes


def burst_spread_s(run: RunRecord) -> float | None:
    """Seconds between the first and the last send of a run's opening burst (its first
    `concurrency` requests); None when the load tool does not record send times."""
    sent = sorted(q.sent_s for q in run.requests[:run.concurrency] if q.sent_s is not None)
    return sent[-1] - sent[0] if len(sent) >= 2 else None


# ---------------------------------------------------------------- verdict


def decide(points: Sequence[Point], threshold: float = DEFAULT_THRESHOLD,
           sides: tuple[str, str] = (PATCHED, UNPATCHED)) -> tuple[str, list[str]]:
    """('pass' | 'fail', reasons). Fail when a gated ratio's interval lies below `threshold`
    at any level, when a gated ratio cannot be computed, or when any request failed."""
    reasons: list[str] = []
    for p in points:
        for name in GATED:
            r = p.ratios[name]
            if r.estimate is None:
                reasons.append(f"concurrency {p.concurrency}: {METRIC[name].label} could not be compared "
                               f"(a run produced no value)")
            elif r.below(threshold):
                reasons.append(f"concurrency {p.concurrency}: {METRIC[name].label} {sides[0]}/{sides[1]} "
                               f"{r.estimate:.3f} (95% CI {r.lo:.3f}-{r.hi:.3f}) is below {threshold:g}")
    for side in sides:
        failed = sum(int(p.sides[side]["failed"] or 0) for p in points)
        total = failed + sum(int(p.sides[side]["completed"] or 0) for p in points)
        if failed:
            reasons.append(f"{side}: {failed} of {total} requests failed")
    return ("fail" if reasons else "pass"), reasons


def band(points: Sequence[Point], threshold: float = DEFAULT_THRESHOLD) -> dict:
    """What a run says about the noise band (read it from an A/A run): over the gated
    ratios, the lowest and highest estimate, the lowest upper CI end (the value the rule
    compares with the threshold), the widest interval, and the margin to the threshold."""
    rs = [p.ratios[m] for p in points for m in GATED if p.ratios[m].estimate is not None]
    if not rs:
        return {}
    lowest_hi = min(r.hi for r in rs if r.hi is not None)
    return {
        "gated_ratios": len(rs),
        "estimate_min": min(r.estimate for r in rs if r.estimate is not None),
        "estimate_max": max(r.estimate for r in rs if r.estimate is not None),
        "ci_lo_min": min(r.lo for r in rs if r.lo is not None),
        "ci_hi_min": lowest_hi,
        "ci_hi_max": max(r.hi for r in rs if r.hi is not None),
        "ci_width_max": max((r.hi - r.lo) for r in rs if r.hi is not None and r.lo is not None),
        "round_ratio_min": min(x for r in rs for x in r.per_round),
        "round_ratio_max": max(x for r in rs for x in r.per_round),
        "threshold": threshold,
        "margin": lowest_hi - threshold,
    }
