"""Numbers and sizes for people: what messages, tables and plots print (`patcher.base.errors`)."""

from __future__ import annotations

import pytest

from patcher.base.errors import number, plural, size_words


@pytest.mark.parametrize("x, text", [
    (0.000799984, "8.0e-4"),   # a scaled tolerance, not 0.000799984
    (1e-4, "1.0e-4"), (1.38e-5, "1.4e-5"), (-0.0005, "-5.0e-4"),
    (0.209, "0.21"), (1.5, "1.5"), (12.34, "12"), (3456, "3456"), (12345, "1.2e4"),
    (0, "0"), (None, "-"), (float("inf"), "inf"),
])
def test_number_has_two_significant_digits_and_a_short_exponent(x, text):
    assert number(x) == text


def test_number_with_more_digits():
    assert number(2.8e-4, 3) == "2.80e-4" and number(0.123456, 3) == "0.123" and number(1.2345e-5, 3) == "1.23e-5"


@pytest.mark.parametrize("n, text", [
    (0.93 * 2**30, "0.93 GiB"),    # a shard under a GiB is not "0.0 GiB" (nor "0.9")
    (31.2 * 2**30, "31.2 GiB"), (2**30, "1 GiB"), (150 * 2**30, "150 GiB"), (0.12 * 2**30, "0.12 GiB"),
    (0.05 * 2**30, "51.2 MiB"), (87.5 * 2**20, "87.5 MiB"), (12 * 1024, "12 KiB"), (900, "900 B"), (None, "-"),
])
def test_size_words_picks_the_unit_that_fits(n, text):
    assert size_words(n) == text


def test_plural():
    assert (plural(1, "patch"), plural(2, "patch"), plural(0, "file")) == ("1 patch", "2 patches", "0 files")
