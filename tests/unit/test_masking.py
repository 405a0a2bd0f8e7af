"""The masker: secret values out of texts, JSON values and byte streams read in arbitrary pieces."""

from __future__ import annotations

import random

import pytest

from leasecore.masking import MASK, MIN_MASKED_CHARS, Masker, StreamMasker


def stream_all(masker: Masker, pieces: list[bytes]) -> bytes:
    stream = masker.stream()
    out = [stream.feed(piece) for piece in pieces]
    out.append(stream.flush())
    return b"".join(out)


def test_a_value_inside_a_longer_line_is_masked() -> None:
    masker = Masker.of(["hunter22"])
    assert masker.mask("password=hunter22; next") == f"password={MASK}; next"
    assert masker.mask("hunter22hunter22 x") == f"{MASK} x"  # back to back: one run, nothing shows


def test_short_values_are_not_masked_and_the_minimum_is_masked() -> None:
    short = "x" * (MIN_MASKED_CHARS - 1)
    exact = "y" * MIN_MASKED_CHARS
    masker = Masker.of([short, exact, ""])
    assert masker.mask(f"{short} {exact}") == f"{short} {MASK}"
    assert not Masker.of([short])


def test_overlapping_values_show_no_character_of_either() -> None:
    masker = Masker.of(["abcdef", "defghi"])
    assert masker.mask("1abcdefghi2") == f"1{MASK}2"
    # One value inside another: the longer one wins, and the shorter alone is masked too.
    nested = Masker.of(["token", "my-token-42"])
    assert nested.mask("a my-token-42 b token c") == f"a {MASK} b {MASK} c"


def test_regex_characters_in_values_are_literal() -> None:
    masker = Masker.of(["a.b*c+d", "(x|y)"])
    assert masker.mask("aXb*c+d a.b*c+d (x|y) x") == f"aXb*c+d {MASK} {MASK} x"


def test_a_value_split_across_two_reads_is_masked() -> None:
    masker = Masker.of(["s3cr3t-value"])
    assert stream_all(masker, [b"key=s3cr", b"3t-value\n"]) == b"key=***\n"
    # split a byte at a time, and inside a multi-byte character
    secret = "pässwörd-ü"
    masker = Masker.of([secret])
    data = f"a {secret} b\n".encode()
    assert stream_all(masker, [data[i : i + 1] for i in range(len(data))]) == b"a *** b\n"


def test_the_stream_holds_back_only_what_may_start_a_value() -> None:
    masker = Masker.of(["abcdefgh"])
    stream = masker.stream()
    assert stream.feed(b"hello abc") == b"hello "  # "abc" may start the value
    assert stream.held_bytes == 3
    assert stream.feed(b"xyz\n") == b"abcxyz\n"  # it did not
    assert stream.held_bytes == 0
    assert stream.feed(b"no secret here") == b"no secret here"


def test_a_longer_value_that_may_follow_a_complete_shorter_one_waits() -> None:
    masker = Masker.of(["abcd", "abcdefgh"])
    assert stream_all(masker, [b"xx abcd", b"efgh yy"]) == b"xx *** yy"
    assert stream_all(masker, [b"xx abcd", b" yy"]) == b"xx *** yy"


def test_overlap_across_a_read_boundary_shows_nothing() -> None:
    # "abcd" completes in the first read; "cdXYZ" overlaps it and ends in the next.
    masker = Masker.of(["abcd", "cdXYZ"])
    assert stream_all(masker, [b"ab", b"cdXY", b"Z!"]) == b"***!"
    assert masker.mask("abcdXYZ!") == "***!"


def test_flush_masks_what_was_held() -> None:
    masker = Masker.of(["abcdefgh"])
    stream = masker.stream()
    assert stream.feed(b"x abcd") == b"x "
    assert stream.flush() == b"abcd"  # the stream ended: not the value after all
    stream = masker.stream()
    stream.feed(b"x abcdefg")
    assert stream.feed(b"h") == b"***"


def test_a_very_long_line_is_masked_with_bounded_holding() -> None:
    secret = "K" * 40 + "-end"
    masker = Masker.of([secret])
    line = (b"." * 100_000 + secret.encode()) * 20 + b"\n"
    pieces = [line[i : i + 4096] for i in range(0, len(line), 4096)]
    stream = masker.stream()
    out = []
    for piece in pieces:
        out.append(stream.feed(piece))
        assert stream.held_bytes < len(secret)  # never more than the longest value minus one
    out.append(stream.flush())
    masked = b"".join(out)
    assert secret.encode() not in masked
    assert masked.count(MASK.encode()) == 20
    assert len(masked) == len(line) - 20 * (len(secret) - len(MASK))


@pytest.mark.parametrize("many", [False, True], ids=["by-find", "by-regex"])
@pytest.mark.parametrize("seed", [*range(40), 2516])
def test_streaming_masks_exactly_as_the_whole_text_would(seed: int, many: bool) -> None:
    """Any split of any stream gives what masking the whole gives (small alphabet: many overlaps),
    with a few values (found one by one) and with many (one regular expression)."""
    rng = random.Random(seed)
    alphabet = "abcd" if many else "abc"
    count = rng.randint(20, 30) if many else rng.randint(1, 4)
    values = ["".join(rng.choice(alphabet) for _ in range(rng.randint(4, 9))) for _ in range(count)]
    masker = Masker.of(values)
    assert (len(set(values)) > 16) == many  # the two ways of finding values are both exercised
    text = "".join(rng.choice(alphabet + "\n") for _ in range(rng.randint(0, 300)))
    data = text.encode()
    cuts = sorted(rng.sample(range(len(data) + 1), min(len(data) + 1, rng.randint(0, 12))))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    expected = masker.mask(text).encode()
    assert stream_all(masker, pieces) == expected
    assert masker.mask_bytes(data) == expected
    for value in values:
        assert value not in expected.decode()


def test_mask_value_masks_every_string_keys_included_at_any_depth() -> None:
    masker = Masker.of(["topsecret"])
    deep: object = "topsecret!"
    for _ in range(5000):  # deeper than the recursion limit: iterative
        deep = [deep]
    value = {"a": "x topsecret y", "topsecret": 1, "n": 3, "t": True, "z": None, "deep": deep}
    masked = masker.mask_value(value)
    assert masked["a"] == "x *** y" and masked["***"] == 1 and masked["n"] == 3 and masked["t"] is True
    inner = masked["deep"]
    for _ in range(5000):
        inner = inner[0]
    assert inner == "***!"
    assert value["a"] == "x topsecret y"  # the input is not changed


def test_an_empty_masker_changes_nothing_and_repr_shows_no_value() -> None:
    empty = Masker.of([])
    assert not empty and empty.mask("abc") == "abc" and stream_all(empty, [b"ab", b"c"]) == b"abc"
    masker = Masker.of(["visible-secret"])
    assert "visible-secret" not in repr(masker)
    assert isinstance(masker.stream(), StreamMasker)
    assert masker.with_values(["visible-secret"]) is masker
    assert masker.with_values(["other-secret"]).mask("other-secret") == MASK
